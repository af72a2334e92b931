"""scripts/linear_cost.py: every kind is timed for every row count, and bad values are refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("linear_cost", ROOT / "scripts" / "linear_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_linear_cost_times_every_kind_and_row_count(capsys):
    script = _script()
    out = script.main(["--rows", "1,3", "--reps", "1", "--layers", "1", "--threads", "1"])
    assert set(out) == set(script.KINDS) and all(set(v) == {1, 3} and min(v.values()) > 0 for v in out.values())
    printed = capsys.readouterr().out
    assert "| 3 |" in printed and "fbgemm dynamic int8" in printed


def test_linear_cost_refuses_bad_values(capsys):
    with pytest.raises(SystemExit):
        _script().main(["--reps", "0"])
    assert "--reps 0" in capsys.readouterr().err
