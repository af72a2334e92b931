"""scripts/linear_cost.py: every kind is timed for every row count, and bad values are refused."""

from __future__ import annotations

import pytest

from scripts import linear_cost


def test_linear_cost_times_every_kind_and_row_count(capsys):
    out = linear_cost.main(["--rows", "1,3", "--reps", "1", "--layers", "1", "--threads", "1"])
    assert set(out) == set(linear_cost.KINDS) and all(set(v) == {1, 3} and min(v.values()) > 0 for v in out.values())
    printed = capsys.readouterr().out
    assert "| 3 |" in printed and "fbgemm dynamic int8" in printed


def test_linear_cost_refuses_bad_values(capsys):
    with pytest.raises(SystemExit):
        linear_cost.main(["--reps", "0"])
    assert "--reps 0" in capsys.readouterr().err
