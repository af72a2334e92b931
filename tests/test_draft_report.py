"""scripts/draft_report.py: runs side by side (train summary, held-out agreement, curves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import load_script

draft_report = load_script("draft_report")


def _run(root: Path, frac: float, agree: float, eval_: bool = True) -> Path:
    root.mkdir(parents=True)
    hist = [{"step": s, "loss": 2.0 / s, "kl": 2.0 / s, "agreement": agree * s / 4, "teacher_kept_mass": 0.9}
            for s in (1, 2, 3, 4)] + [{"step": 4, "train_runtime": 10.0}]
    (root / "log_history.json").write_text(json.dumps(hist))
    (root / "train_summary.json").write_text(json.dumps({"stage": "train", "train": {
        "samples": int(1000 * frac), "corpus_fraction": frac, "steps": 4, "train_seconds": 600.0}}))
    if eval_:
        (root / "draft_eval.json").write_text(json.dumps({
            "agreement": {"gsm8k": {"agreement": agree, "positions": 10, "expected_acceptance_t1": agree - 0.1},
                          "humaneval": {"agreement": agree / 2}},  # an eval from before the acceptance field
            "cost": {"draft_over_target": 0.14}}))
    return root


def test_report_puts_runs_side_by_side(tmp_path, capsys):
    full, half = _run(tmp_path / "full", 1.0, 0.6), _run(tmp_path / "half", 0.5, 0.5, eval_=False)
    assert draft_report.main(["--run", f"full={full}", "--run", f"half={half}", "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| full") or
            line.startswith("| half")}
    assert "| 1000 | 1.000 | 4 | 10.0 | 0.500 | 0.600 | 0.600 | 0.300 | 0.500 | – | 0.140 |" in rows["full"]
    assert rows["half"].endswith("| 500 | 0.500 | 4 | 10.0 | 0.500 | 0.500 | – | – | – | – | – |")  # no eval yet
    assert "held-out expected acceptance at T=1 gsm8k" in md
    assert "held-out agreement gsm8k" in md and (tmp_path / "r" / "draft_curves.png").stat().st_size > 1000
    assert json.loads((tmp_path / "r" / "report.json").read_text())["half"]["eval"] is None


def test_report_refuses_a_missing_run(tmp_path):
    with pytest.raises(SystemExit):
        draft_report.main(["--run", f"x={tmp_path / 'nope'}", "--out", str(tmp_path / "r")])
