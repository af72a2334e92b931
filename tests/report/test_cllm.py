"""pardec.report.cllm (`python -m pardec.report cllm`): rows per (model, method) with the Jacobi extras of the right role, answer quality of
long `ar` runs, the training plot."""

from __future__ import annotations

import json
from pathlib import Path

from pardec.report import cllm as cllm_report


def _bench(path: Path, ff: float) -> None:
    run = path / "runs" / "gsm8k"
    run.mkdir(parents=True)
    peer = {"method": "lookahead", "params": {"window": 4}, "tokens_per_s": 11.0, "speedup": 0.8,
            "speedup_median": 0.82, "tokens_per_forward": 1.4, "exact_match_rate": 1.0, "metric": 0.02}
    (run / "summary.json").write_text(json.dumps({
        "dataset": "gsm8k", "method": "jacobi", "baseline": "ar", "method_params": {"block_size": 16}, "dtype": "fp32",
        "max_new_tokens": 48, "n_samples": 2, "tokens_per_s": 12.0, "speedup": 0.9, "speedup_median": 0.88,
        "tokens_per_forward": 1.45, "exact_match_rate": 1.0, "metric": 0.02, "metric_name": "correct",
        "baseline_tokens_per_s": 14.0, "baseline_metric": 0.04, "peers": {"also:lookahead:window=4": peer}}))
    recs = [{"role": "baseline", "extras": {}}, {"role": "also:lookahead:window=4", "extras": {"pool_hit_rate": 0.3}}]
    recs += [{"role": "method", "extras": {"fast_forward": ff + d, "stationary_per_block": 1.0 + d}} for d in (-0.1, 0.1)]
    recs.append({"role": "method", "error": "boom"})  # a failed prompt counts for nothing
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))


def test_rows_and_markdown(tmp_path):
    _bench(tmp_path / "b", 1.05)
    _bench(tmp_path / "c", 1.5)
    rows = cllm_report.bench_rows("base", tmp_path / "b") + cllm_report.bench_rows("cllm", tmp_path / "c")
    got = {(r["model"], r["method"]): r for r in rows}
    assert set(got) == {(m, k) for m in ("base", "cllm") for k in ("ar", "jacobi", "lookahead (window=4)")}
    assert got["cllm", "jacobi"]["fast_forward"] == 1.5 and got["cllm", "jacobi"]["stationary_per_block"] == 1.0
    assert got["base", "lookahead (window=4)"]["fast_forward"] is None  # the extras belong to jacobi's role only
    assert got["base", "ar"]["metric"] == 0.04 and got["base", "ar"]["tokens_per_s"] == 14.0
    md = cllm_report.render(rows)
    assert "| cllm | jacobi | 12.0 | 0.90 (0.88) | 1.45 | 1.50 | 1.00 | 1.00 | 0.02 |" in md
    assert "2 prompts per model, fp32, max_new_tokens=48" in md


def test_two_variants_of_one_method_keep_their_own_extras(tmp_path):
    """``bench.also`` with jacobi at two block sizes beside the run's jacobi: each row's extras come from its own
    role (the summary's peers key), not from the first role whose name holds the method."""
    run = tmp_path / "v" / "runs" / "gsm8k"
    run.mkdir(parents=True)
    peer = {"method": "jacobi", "tokens_per_s": 11.0, "speedup": 1.0, "speedup_median": 1.0, "metric": 0.0}
    peers = {f"also:jacobi:block_size={n}": {**peer, "params": {"block_size": n}, "tokens_per_forward": n / 5}
             for n in (8, 4)}
    (run / "summary.json").write_text(json.dumps({
        "dataset": "gsm8k", "method": "jacobi", "baseline": "ar", "method_params": {"block_size": 16}, "n_samples": 1,
        "tokens_per_forward": 1.8, "baseline_tokens_per_s": 10.0, "peers": peers}))
    recs = [{"role": "baseline", "extras": {}}, {"role": "method", "extras": {"fast_forward": 1.9}}]
    recs += [{"role": f"also:jacobi:block_size={n}", "extras": {"fast_forward": ff}} for n, ff in ((8, 1.7), (4, 1.4))]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = {r["method"]: r["fast_forward"] for r in cllm_report.bench_rows("m", tmp_path / "v")}
    assert got == {"ar": None, "jacobi": 1.9, "jacobi (block_size=8)": 1.7, "jacobi (block_size=4)": 1.4}


def test_training_plot(tmp_path):
    hist = [{"step": i, "loss": 3.0, "consistency_loss": 4.0 - i / 10, "ar_loss": 0.5} for i in range(1, 6)]
    hist += [{"step": i, "eval_ff_proxy": 1.0 + i / 10, "eval_ff_proxy_init": 1.0} for i in (0, 5)]
    hist[-1]["eval_ff_decode"] = 1.2  # runs since 2026-11-26 log the decoded proxy too
    assert cllm_report.plot_training(hist, tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 1000
    assert not cllm_report.plot_training([{"step": 1, "loss": 1.0}], tmp_path / "none.png")


def test_quality(tmp_path):
    run = tmp_path / "q"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps({"method": "ar", "max_new_tokens": 40, "dtype": "fp32",
                                                  "metric_name": "correct", "metric": 0.5}))
    recs = [{"role": "method", "n_tokens": 12, "tokens": list(range(12))},  # stopped by EOS, all 4-grams distinct
            {"role": "method", "n_tokens": 40, "tokens": [5, 6] * 20},      # a 2-gram 20 times in a row: a loop
            {"role": "method", "error": "boom"}, {"role": "baseline", "n_tokens": 40, "tokens": [1] * 40}]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    r = cllm_report.quality_row("cllm", run)
    assert (r["n"], r["eos_stops"], r["loops"], r["mean_tokens"]) == (2, 1, 1, 26)
    assert r["distinct_4"] == (1.0 + 2 / 37) / 2  # [5, 6] * 20 has 37 4-grams, 2 of them distinct
    assert "| cllm | ar | 0.50 | 26.0 | 1/2 | 1/2 | 0.53 |" in cllm_report.render_quality([r])
    assert cllm_report.distinct_ngrams([1, 2, 3]) is None
    # ar against ar runs once, as the baseline: its records are the run's
    (run / "summary.json").write_text(json.dumps({"method": "ar", "baseline": "ar", "max_new_tokens": 40}))
    (run / "results.jsonl").write_text(json.dumps(recs[-1]) + "\n")
    assert cllm_report.quality_row("base", run)["loops"] == 1


def test_mcnemar_exact_and_paired_comparison_with_the_base():
    # two-sided exact binomial test of the discordant pairs at 1/2 (values from the binomial distribution)
    assert cllm_report.mcnemar_exact(0, 0) == 1.0 and cllm_report.mcnemar_exact(3, 3) == 1.0
    assert cllm_report.mcnemar_exact(0, 5) == cllm_report.mcnemar_exact(5, 0) == 2 / 32
    assert abs(cllm_report.mcnemar_exact(2, 10) - 2 * (1 + 12 + 66) / 4096) < 1e-12  # 0.0386
    assert cllm_report.mcnemar_exact(1, 20) < 1e-4

    def row(label, eos, loop):
        flags = {f"p{i}": {"eos": e, "loop": lp} for i, (e, lp) in enumerate(zip(eos, loop))}
        return {"model": label, "method": "ar", "metric": None, "mean_tokens": 1.0, "n": len(flags), "dtype": "fp32",
                "max_new_tokens": 8, "metric_name": "correct", "eos_stops": sum(eos), "loops": sum(loop),
                "distinct_4": None, "per_prompt": flags}

    base = row("base", [1, 1, 0, 0, 0, 1], [0, 0, 0, 1, 0, 0])
    cllm = row("cllm", [1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0])
    d = cllm_report.paired_vs_base(base, cllm)
    assert d["n"] == 6 and d["eos"] == {"gained": 3, "lost": 1, "p": cllm_report.mcnemar_exact(3, 1)}
    assert d["loop"]["gained"] == 0 and d["loop"]["lost"] == 1
    cllm["per_prompt"]["extra"] = {"eos": True, "loop": True}  # a prompt the base did not answer is left out
    assert cllm_report.paired_vs_base(base, cllm)["n"] == 6
    md = cllm_report.render_quality([base, cllm], "base")
    assert "| base | ar | – | 1.0 | 3/6 | 1/6 | – | – | – |" in md
    assert f"+3 / -1 (p {cllm_report.mcnemar_exact(3, 1):.3f}) | +0 / -1 (p 1.000) |" in md
    assert cllm["vs_base"] == cllm_report.paired_vs_base(base, cllm) and "vs_base" not in base  # for the JSON
    assert "EOS vs base" not in cllm_report.render_quality([cllm], "base")  # no base row: no paired columns


def test_tradeoff_points_and_plot(tmp_path):
    _bench(tmp_path / "a", 1.6)
    _bench(tmp_path / "b", 1.9)
    rows = cllm_report.bench_rows("aug", tmp_path / "a") + cllm_report.bench_rows("noaug", tmp_path / "b")
    q = {"n": 50, "eos_stops": 28, "model": "base", "loops": 3, "distinct_4": 0.61}
    quality = [q, {**q, "model": "aug", "loops": 1, "distinct_4": 0.58},
               {**q, "model": "noaug", "loops": 12, "distinct_4": 0.52}, {**q, "model": "no_bench", "loops": 0}]
    points = cllm_report.tradeoff_points(rows, quality, "base")
    assert [(p["label"], p["fast_forward"], p["loops"]) for p in points] == [("aug", 1.6, 1), ("noaug", 1.9, 12)]
    assert cllm_report.plot_tradeoff(points, q, tmp_path / "t.png") and (tmp_path / "t.png").stat().st_size > 1000
    assert not cllm_report.plot_tradeoff([], q, tmp_path / "none.png") and not (tmp_path / "none.png").exists()
