"""pardec.report.sdsat (`python -m pardec.report sdsat`): rows of sdsat runs and roles against k, the base-model metric beside them, the plot."""

from __future__ import annotations

import json
from pathlib import Path

from pardec.report import sdsat as sdsat_report


def _run(path: Path, summary: dict) -> None:
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(summary))


def test_rows_plot_and_markdown(tmp_path):
    peers = {f"also:sdsat:k={k}:variant=fused": {"method": "sdsat", "params": {"k": k, "variant": "fused"},
                                                 "tokens_per_s": 10.0 + k, "speedup": 0.5 + k / 10,
                                                 "tokens_per_forward": 1.5, "draft_acceptance": 0.5 - k / 100,
                                                 "exact_match_rate": 1.0}
             for k in (3, 8)}
    peers["hf"] = {"method": "hf_generate", "params": {}}
    _run(tmp_path / "sd" / "humaneval", {
        "dataset": "humaneval", "method": "sdsat", "method_params": {"k": 5}, "sampling": {"temperature": 0.0},
        "tokens_per_s": 20.0, "baseline_tokens_per_s": 16.0, "speedup": 1.25, "tokens_per_forward": 2.0,
        "draft_acceptance": 0.4, "exact_match_rate": 1.0, "metric_name": "pass@1", "metric": 0.2,
        "baseline_metric": 0.2, "peers": peers})
    _run(tmp_path / "base" / "humaneval", {"dataset": "humaneval", "method": "ar", "sampling": {"temperature": 0.0},
                                            "metric_name": "pass@1", "metric": 0.25, "n_samples": 5, "peers": {}})
    rows = sdsat_report.sdsat_rows([tmp_path / "sd"])
    assert [(r["variant"], r["k"], r["tokens_per_s"]) for r in rows] == [("fused", 3, 13.0), ("fused", 8, 18.0),
                                                                        ("two_step", 5, 20.0)]
    base = sdsat_report.base_rows([tmp_path / "base"])
    assert [(b["dataset"], b["metric"]) for b in base] == [("humaneval", 0.25)]
    sdsat_report.plot(rows, tmp_path / "k.png")
    assert (tmp_path / "k.png").stat().st_size > 1000
    md = sdsat_report.render(rows, base, {"perplexity": {"ratio": 1.01}})
    assert "| humaneval | fp32 | greedy | two_step | 5 | 20.0 | 1.25 (–) | 2.00 | 0.40 | 1.00 |" in md  # no dtype: fp32
    assert "| humaneval (5 prompts, greedy) | pass@1 | 0.25 | 0.20 |" in md  # the sdsat run's baseline
    _run(tmp_path / "sd" / "humaneval_bf16", {  # another dtype of the same settings: its own rows, not merged
        "dataset": "humaneval", "dtype": "bf16", "method": "sdsat", "method_params": {"k": 5},
        "sampling": {"temperature": 0.0}, "tokens_per_s": 30.0, "speedup": 1.5, "peers": {}})
    rows2 = sdsat_report.sdsat_rows([tmp_path / "sd"])
    assert [(r["dtype"], r["k"], r["tokens_per_s"]) for r in rows2] == [("bf16", 5, 30.0), ("fp32", 3, 13.0),
                                                                       ("fp32", 8, 18.0), ("fp32", 5, 20.0)]
    assert "| humaneval | bf16 | greedy | two_step | 5 | 30.0 | 1.50 (–) |" in sdsat_report.render(rows2, base, None)
    ar = [{**base[0], "metric": 0.3}]
    assert "| humaneval (5 prompts, greedy) | pass@1 | 0.25 | 0.30 |" in sdsat_report.render(rows, base, None, ar)


def test_loss_curves_from_the_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-10").mkdir(parents=True)
    (run / "checkpoint-2").mkdir()
    hist = [{"step": i, "loss": 1.0, "plain_loss": 0.5, "masked_loss": 5.0 - i / 10} for i in range(1, 11)]
    (run / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"log_history": hist}))
    (run / "checkpoint-2" / "trainer_state.json").write_text(json.dumps({"log_history": hist[:2]}))
    assert sdsat_report.log_history(run) == hist  # the newest checkpoint (by step, not by name)
    (run / "log_history.json").write_text(json.dumps(hist[:5]))
    assert sdsat_report.log_history(run) == hist[:5]  # the file train_sdsat writes wins
    assert sdsat_report.plot_losses(hist, tmp_path / "l.png") and (tmp_path / "l.png").stat().st_size > 1000
    assert not sdsat_report.plot_losses([{"step": 1, "loss": 1.0}], tmp_path / "none.png")
