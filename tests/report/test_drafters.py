"""pardec.report.drafters (`python -m pardec.report drafters`): runs side by side (train summary, held-out agreement, curves)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pardec.report import drafters as draft_report


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


def _heads_run(root: Path, frac: float, top1: float) -> Path:
    root.mkdir(parents=True)
    hist = [{"step": s, "loss": 3.0 / s, "kl": 3.0 / s, "top1": top1 * s / 4, "kl_d1": 1.0} for s in (2, 4)]
    (root / "log_history.json").write_text(json.dumps(hist + [{"step": 4, "train_runtime": 12.0}]))
    (root / "train_summary.json").write_text(json.dumps({"stage": "train", "train": {
        "samples": int(1000 * frac), "corpus_fraction": frac, "steps": 4, "train_seconds": 120.0}}))
    acc = [[top1 / (d + 1) + 0.1 * r for r in range(10)] for d in range(3)]  # cumulative top-k per depth
    (root / "drafter_eval.json").write_text(json.dumps({
        "overall": {"topk_accuracy": acc}, "positions": 50,
        "trees": {"T16": {"expected_accept_length": 1.9}, "chain": {"expected_accept_length": 1.4},
                  "T63": {"expected_accept_length": 2.1 + frac}}}))
    return root


def test_report_puts_heads_runs_side_by_side(tmp_path):
    full, quarter = _heads_run(tmp_path / "full", 1.0, 0.4), _heads_run(tmp_path / "q", 0.25, 0.3)
    assert draft_report.main(["--run", f"full={full}", "--run", f"q={quarter}", "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "held-out agreement" not in md  # no draft run: the draft table is left out
    assert ("| run | samples | corpus fraction | steps | train min | last logged kl | last logged top-1 | held-out top-1 "
            "step 1 | held-out top-1 step 2 | held-out top-1 step 3 | held-out top-5 step 1") in md
    assert "expected tokens/step chain | expected tokens/step T16 | expected tokens/step T63 |" in md
    row = next(line for line in md.splitlines() if line.startswith("| q |"))
    assert row == ("| q | 250 | 0.250 | 4 | 2.0 | 0.750 | 0.300 | 0.300 | 0.150 | 0.100 | 0.700 | 0.550 | 0.500 | "
                   "1.400 | 1.900 | 2.350 |")
    assert (tmp_path / "r" / "draft_curves.png").stat().st_size > 1000


def test_report_mixes_draft_and_heads_runs(tmp_path):
    d, h = _run(tmp_path / "draft", 1.0, 0.6), _heads_run(tmp_path / "heads", 1.0, 0.4)
    assert draft_report.main(["--run", f"d={d}", "--run", f"h={h}", "--out", str(tmp_path / "r")]) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert "held-out agreement gsm8k" in md and "held-out top-1 step 1" in md
    assert sum(line.startswith("| d |") for line in md.splitlines()) == 1
    assert sum(line.startswith("| h |") for line in md.splitlines()) == 1


def _sdsat_run(root: Path, records: int, top1: float) -> Path:
    root.mkdir(parents=True)
    hist = [{"step": s, "loss": 2.0, "plain_loss": 0.5 / s, "masked_loss": 8.0 / s} for s in (1, 2)]
    (root / "log_history.json").write_text(json.dumps(hist + [{"step": 2, "train_runtime": 60.0}]))
    (root / "train_summary.json").write_text(json.dumps({"stage": "eval", "train": {
        "records": records, "masked_positions": 30 * records, "steps": 2, "train_seconds": 300.0}}))
    adaptive = {"accuracy_vs_model": [top1, top1 / 2, top1 / 4, 0.01], "expected_tokens_per_loop_vs_model": 1 + top1}
    (root / "sdsat_eval.json").write_text(json.dumps({
        "per_source": {"gsm8k": {"ppl_ratio": 0.9}, "ref:gsm8k": {"ppl_ratio": 1.02 + top1 / 10}},
        "overall": {"ppl_ratio": 0.95, "adaptive": adaptive}}))
    return root


def test_report_puts_sdsat_runs_side_by_side(tmp_path):
    full, quarter = _sdsat_run(tmp_path / "full", 1300, 0.4), _sdsat_run(tmp_path / "q", 325, 0.2)
    h = _heads_run(tmp_path / "heads", 1.0, 0.4)
    argv = ["--run", f"full={full}", "--run", f"q={quarter}", "--run", f"h={h}", "--out", str(tmp_path / "r")]
    assert draft_report.main(argv) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert ("| run | records | masked positions | steps | train min | last plain loss | last masked loss | perplexity "
            "ratio gsm8k | perplexity ratio ref:gsm8k | perplexity ratio all | held-out top-1 depth 1 | held-out top-1 "
            "depth 2 | held-out top-1 depth 3 | expected tokens per loop |") in md
    assert ("| q | 325 | 9750 | 2 | 5.0 | 0.250 | 4.000 | 0.900 | 1.040 | 0.950 | 0.200 | 0.100 | 0.050 | 1.200 |"
            in md.splitlines())
    assert sum(line.startswith("| h |") for line in md.splitlines()) == 1 and "held-out agreement" not in md
    assert (tmp_path / "r" / "sdsat_curves.png").stat().st_size > 1000
    assert (tmp_path / "r" / "draft_curves.png").stat().st_size > 1000  # the heads run's curves


def _chain_run(root: Path, kind: str, expected: float) -> Path:
    """A run of a chain drafter as training leaves it: EAGLE-3 logs ``kl``, DFlash ``ce``; ``drafter_eval.json`` as
    :func:`pardec.training.drafter.trainer.evaluate_chain` writes it."""
    root.mkdir(parents=True)
    loss = "kl" if kind == "eagle3" else "ce"
    hist = [{"step": s, "loss": 4.0 / s, loss: 4.0 / s, "top1": 0.1 * s,
             **{f"{loss}_d{k}": 4.0 / s + k for k in (1, 2, 3)}, **{f"top1_d{k}": 0.1 * s / k for k in (1, 2, 3)}}
            for s in (1, 2)]
    (root / "log_history.json").write_text(json.dumps(hist + [{"step": 2, "train_runtime": 30.0}]))
    (root / "train_summary.json").write_text(json.dumps({"stage": "eval", "train": {
        "samples": 400, "corpus_fraction": 1.0, "steps": 2, "train_seconds": 180.0}}))

    def part(scale):
        return {"steps": 3, "top1_agreement": [0.6 * scale, 0.4 * scale, 0.3 * scale],
                "chain_acceptance": [0.5 * scale, 0.3 * scale, 0.2 * scale],
                "expected_tokens_per_forward": 1 + scale}
    (root / "drafter_eval.json").write_text(json.dumps({
        "kind": kind, "steps": 3, "per_dataset": {"gsm8k": part(1.0), "mt_bench": part(0.5)},
        "overall": {**part(0.8), "expected_tokens_per_forward": expected}, "expected_tokens_per_forward": expected}))
    return root


def test_report_puts_eagle3_and_dflash_runs_beside_heads_runs(tmp_path):
    e, d = _chain_run(tmp_path / "e", "eagle3", 1.74), _chain_run(tmp_path / "d", "dflash", 1.13)
    h = _heads_run(tmp_path / "h", 1.0, 0.4)
    argv = ["--run", f"e={e}", "--run", f"d={d}", "--run", f"h={h}", "--out", str(tmp_path / "r")]
    assert draft_report.main(argv) == 0
    md = (tmp_path / "r" / "report.md").read_text()
    assert ("| run | kind | samples | corpus fraction | steps | train min | last logged kl / ce | last logged top-1 | "
            "held-out top-1 position 1 | held-out top-1 position 2 | held-out top-1 position 3 | chain acceptance "
            "position 1 | chain acceptance position 2 | chain acceptance position 3 | expected tokens/forward | "
            "expected tokens/forward gsm8k | expected tokens/forward mt_bench |") in md
    lines = md.splitlines()
    assert ("| e | eagle3 | 400 | 1.000 | 2 | 3.0 | 2.000 | 0.200 | 0.480 | 0.320 | 0.240 | 0.400 | 0.240 | 0.160 | "
            "1.740 | 2.000 | 1.500 |") in lines
    assert "| d | dflash | 400 | 1.000 | 2 | 3.0 | 2.000 | 0.200 |" in next(x for x in lines if x.startswith("| d |"))
    assert sum(x.startswith("| h |") for x in lines) == 1 and "expected tokens/step T16" in md  # the trees' table
    assert (tmp_path / "r" / "draft_curves.png").stat().st_size > 1000  # DFlash's ce in the KL panel
    assert (tmp_path / "r" / "slot_curves.png").stat().st_size > 1000 and "slot_curves.png" in md  # positions 1, 2


def test_slot_curves_are_drawn_for_the_logged_positions_only(tmp_path):
    e = draft_report.read_run(_chain_run(tmp_path / "e", "eagle3", 1.74))
    assert draft_report.slot_plot({"e": e}, tmp_path / "s.png") and (tmp_path / "s.png").stat().st_size > 1000
    e["history"] = [{k: v for k, v in h.items() if not k.startswith("top1_d")} for h in e["history"]]
    assert not draft_report.slot_plot({"e": e}, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
