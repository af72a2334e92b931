"""``make demo`` (``python -m pardec.demo``) on the tiny model: one evaluate run, then the compact comparison table."""

from __future__ import annotations

import json

import pytest

from pardec import demo


@pytest.mark.slow
def test_demo_prints_pld_beside_ar(tmp_path, capsys):
    demo.main(["--model", "tiny_random", "--n", "1", "--max-new-tokens", "4", "--out", str(tmp_path),
               "bench.warmup=0", "bench.include_hf=false"])
    s = json.loads((tmp_path / "summary.json").read_text())
    out = capsys.readouterr().out
    assert s["method"] == "pld" and s["model"] == "tiny_random" and s["n_samples"] == 1
    assert "tiny_random fp32, humaneval x 1, 4 new tokens, greedy" in out
    head, base, method = out.strip().splitlines()[-3:]
    assert "speedup vs ar" in head and base.split()[:2] == ["baseline", "ar"] and method.split()[:2] == ["method", "pld"]
