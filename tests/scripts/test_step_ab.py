"""scripts/step_ab.py on the tiny model: both forwards timed round by round, the same tokens, bad values refused."""

from __future__ import annotations

import pytest

from scripts import step_ab


def test_step_ab_times_both_forwards_and_they_agree(capsys):
    out = step_ab.main(["--model", "tiny_random", "--steps", "3", "--rounds", "2", "--threads", "1"])
    assert out["same_tokens"] is True and list(out["impls"]) == ["hf", "lean"]
    for r in out["impls"].values():
        assert len(r["ms_per_step"]) == 2 and all(x > 0 for x in r["ms_per_step"]) and r["median"] > 0
    assert out["impls"]["hf"]["speedup_vs_first"] == 1.0
    printed = capsys.readouterr().out
    assert "cores" in printed and "same tokens on every forward: True" in printed

@pytest.mark.parametrize("args, msg", [(["--impls", "hf,fast"], "--impls ['fast'] not valid; choose from: hf, lean"),
                                       (["--steps", "0"], "--steps 0 / --rounds 5: both must be >= 1")])
def test_step_ab_refuses_bad_values(args, msg, capsys):
    with pytest.raises(SystemExit):
        step_ab.main(["--model", "tiny_random", *args])
    assert msg in capsys.readouterr().err
