"""The CLLM report (issue: a CLLM that pays off on SmolLM2): Jacobi and lookahead on the base model and the CLLM,
side by side, plus the training curves.

    python -m pardec.report cllm --bench base=outputs/bench/cllm_base --bench cllm=outputs/bench/cllm_trained \
        [--quality base=<evaluate run dir> --quality cllm=<evaluate run dir>] \
        [--run outputs/train/runs/cllm_gsm8k_smollm2/<run>] [--base base] [--out outputs/bench/cllm]

* ``--bench LABEL=DIR``: a ``python -m pardec.bench speed`` output (``--methods jacobi,lookahead``) on one model; ``ar`` of the
  same model is each run's baseline. One table row per (model, method): tokens/s, speedup over ``ar`` (total and
  median over prompts), tokens per forward, the Jacobi extras (fast-forward: tokens committed per iteration;
  stationary tokens per block; means over prompts), exact match vs ``ar`` and the task metric.
* ``--quality LABEL=DIR``: an ``evaluate`` run of ``ar`` with room for whole answers (e.g. 256 tokens) on one model:
  accuracy, mean answer length, how many answers ended with EOS, how many fall into a loop (some <= 8-gram
  repeated 9+ times in a row, the collection's cleaning rule) and the distinct-4-gram ratio. A CLLM trained on
  the first ``max_new_tokens`` of each answer is only constrained there; this shows what happens past it. Each
  label's EOS-ended and looping answers are also compared with the ``--base`` label's prompt by prompt (how many
  it gained and lost, and an exact McNemar p-value): on 50 prompts a count differs by a few between runs by chance.
* Trade-off plot: every label with both a ``--bench`` Jacobi row and a ``--quality`` row becomes a point of
  fast-forward (test prompts) against loops and distinct 4-grams, beside the bounds the CPU CLLM recipe sets from the
  ``--base`` label's quality (loops within +-3, distinct 4-grams within 10%) and its fast-forward goal of 1.8
  (``<out>/cllm_tradeoff.png``).
* ``--run``: the training run dir; plots the consistency and AR losses and the fast-forward proxy on held-out
  trajectories against the optimizer step (``<out>/cllm_training.png``).

Writes ``<out>/cllm_report.md`` (printed too) and ``<out>/cllm_report.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pardec import REPO_ROOT  # noqa: E402
from pardec.evaluation.tables import comparison_rows  # noqa: E402
from pardec.report.plots import save_figure  # noqa: E402
from pardec.report.run_dirs import log_history, read_results  # noqa: E402
from pardec.training.cllm.augment import has_degenerate_repetition  # noqa: E402

ROOT = REPO_ROOT
EXTRAS = ("fast_forward", "stationary_per_block")


def role_extras(run_dir: Path) -> dict[str, dict[str, float | None]]:
    """Per role of one evaluate run (``method`` or ``also:<label>``): the Jacobi extras' means over prompts."""
    by_role: dict[str, list[dict]] = {}
    for rec in read_results(run_dir / "results.jsonl"):
        if "error" not in rec:
            by_role.setdefault(rec["role"], []).append(rec.get("extras") or {})
    out = {}
    for role, extras in by_role.items():
        out[role] = {k: (statistics.mean(v) if (v := [e[k] for e in extras if e.get(k) is not None]) else None)
                     for k in EXTRAS}
    return out


def bench_rows(label: str, bench_dir: Path) -> list[dict]:
    """One row per jacobi / lookahead role of the runs under ``bench_dir`` (their summaries read by
    :func:`~pardec.evaluation.tables.comparison_rows`), and each such run's baseline (``ar``) first."""
    rows = []
    for f in sorted(Path(bench_dir).glob("**/summary.json")):
        s = json.loads(f.read_text())
        roles = [r for r in comparison_rows(s) if r["role"] == "baseline" or r["method"] in ("jacobi", "lookahead")]
        if all(r["role"] == "baseline" for r in roles):
            continue
        extras = role_extras(f.parent)  # a bench.also role's extras are under its key in the summary's peers
        for r in roles:
            base = r["role"] == "baseline"
            rows.append({"model": label, "method": r["label"], "tokens_per_s": r["tokens_per_s"],
                         "speedup": r["speedup"], "speedup_median": 1.0 if base else r.get("speedup_median"),
                         "tokens_per_forward": r["tokens_per_forward"], "exact_match": r["exact_match_rate"],
                         "metric": r["metric"], "metric_name": s.get("metric_name"), "n": s.get("n_samples"),
                         "dtype": s.get("dtype"), "max_new_tokens": s.get("max_new_tokens"),
                         **(dict.fromkeys(EXTRAS) if base else extras.get(r["role"]) or dict.fromkeys(EXTRAS))})
    return rows


def distinct_ngrams(ids: list[int], n: int = 4) -> float | None:
    """Distinct n-grams / n-grams of one answer (1.0: no n-gram repeats); None when shorter than n."""
    grams = [tuple(ids[i:i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def quality_row(label: str, run_dir: Path) -> dict:
    """Answer quality of one ``evaluate`` run (its method's records; for ``ar`` against ``ar``, the baseline's):
    see ``--quality``."""
    s = json.loads((run_dir / "summary.json").read_text())
    role = "baseline" if s["method"] == s.get("baseline") else "method"  # evaluate runs a method equal to its baseline once
    recs = [r for r in read_results(run_dir / "results.jsonl") if r.get("role") == role and "error" not in r]
    if not recs:
        raise SystemExit(f"error: --quality {label}={run_dir}: no successful {role} records in results.jsonl")
    cap = s["max_new_tokens"]
    d4 = [v for r in recs if (v := distinct_ngrams(r["tokens"])) is not None]
    flags = {str(r.get("id", i)): {"eos": r["n_tokens"] < cap, "loop": has_degenerate_repetition(r["tokens"])}
             for i, r in enumerate(recs)}
    return {"model": label, "method": s["method"], "n": len(recs), "max_new_tokens": cap, "dtype": s.get("dtype"),
            "metric_name": s.get("metric_name"), "metric": s.get("metric"),
            "mean_tokens": statistics.mean(r["n_tokens"] for r in recs),
            "eos_stops": sum(f["eos"] for f in flags.values()),
            "loops": sum(f["loop"] for f in flags.values()),
            "distinct_4": statistics.mean(d4) if d4 else None, "per_prompt": flags}


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value of ``b`` pairs changed one way and ``c`` the other (a binomial test of
    min(b, c) among b + c at 1/2): how often two models equally likely to end (or loop) on a prompt would split
    their discordant prompts at least this unevenly."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_vs_base(base: dict, row: dict) -> dict:
    """Per flag (``eos``, ``loop``), over the prompts both rows answered: how many the model has where the base has
    not (``gained``), the reverse (``lost``), and the exact McNemar p-value of that split."""
    ids = sorted(set(base["per_prompt"]) & set(row["per_prompt"]))
    out: dict = {"n": len(ids)}
    for key in ("eos", "loop"):
        gained = sum(row["per_prompt"][i][key] and not base["per_prompt"][i][key] for i in ids)
        lost = sum(base["per_prompt"][i][key] and not row["per_prompt"][i][key] for i in ids)
        out[key] = {"gained": gained, "lost": lost, "p": mcnemar_exact(gained, lost)}
    return out


def render_quality(rows: list[dict], base: str | None = None) -> str:
    """The quality table; with ``base`` (a row's label), each other row's EOS-ended and looping answers compared
    with the base's prompt by prompt (gained / lost, exact McNemar p; stored in the row as ``vs_base``): is a
    difference in counts more than the noise of 50 prompts?"""
    ref = next((r for r in rows if r["model"] == base), None)
    paired = ref is not None and len(rows) > 1
    md = ["| model | method | accuracy | mean tokens | ended with EOS | in a loop | distinct 4-grams |"
          + (" EOS vs base: +gained / -lost (p) | loops vs base (p) |" if paired else ""),
          "|---|---|---|---|---|---|---|" + ("---|---|" if paired else "")]
    for r in rows:
        cells = ""
        if paired:
            if r is ref:
                cells = " – | – |"
            else:
                d = r["vs_base"] = paired_vs_base(ref, r)  # kept in the row: the JSON output has it
                cells = "".join(f" +{d[k]['gained']} / -{d[k]['lost']} (p {d[k]['p']:.3f}) |" for k in ("eos", "loop"))
        md.append(f"| {r['model']} | {r['method']} | {_f(r['metric'])} | {_f(r['mean_tokens'], 1)} | "
                  f"{r['eos_stops']}/{r['n']} | {r['loops']}/{r['n']} | {_f(r['distinct_4'])} |" + cells)
    r = rows[0]
    md.append(f"\n{r['n']} prompts per model, {r['dtype']}, max_new_tokens={r['max_new_tokens']}, greedy; "
              f"accuracy = {r['metric_name']}; in a loop = some <= 8-gram repeated 9+ times in a row."
              + (f" vs base: prompt by prompt against `{base}` (+ the model ends / loops where the base does not, - "
                 "the reverse), p: exact two-sided McNemar test." if paired else ""))
    return "\n".join(md) + "\n"


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def render(rows: list[dict]) -> str:
    md = ["| model | method | tokens/s | speedup vs ar (median) | tokens/forward | fast-forward | stationary / block | "
          "exact match vs ar | accuracy |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['method']} | {_f(r['tokens_per_s'], 1)} | {_f(r['speedup'])} "
                  f"({_f(r['speedup_median'])}) | {_f(r['tokens_per_forward'])} | {_f(r['fast_forward'])} | "
                  f"{_f(r['stationary_per_block'])} | {_f(r['exact_match'])} | {_f(r['metric'])} |")
    if rows:
        r = rows[0]
        md.append(f"\n{r['n']} prompts per model, {r['dtype']}, max_new_tokens={r['max_new_tokens']}, greedy; "
                  f"accuracy = {r['metric_name']}.")
    return "\n".join(md) + "\n"


def plot_training(history: list[dict], path: Path) -> bool:
    """Consistency and AR losses, and the fast-forward proxy, against the step; False when nothing was logged."""
    train = [h for h in history if "consistency_loss" in h]
    proxy = [h for h in history if "eval_ff_proxy" in h]
    if not train and not proxy:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, label in (("consistency_loss", "consistency (per counted position)"), ("ar_loss", "AR (per token)")):
        ax1.plot([h["step"] for h in train], [h[key] for h in train], marker=".", label=label)
    ax1.set(xlabel="optimizer step", ylabel="loss", yscale="log", title="CLLM training losses")
    for key, label in (("eval_ff_proxy", "teacher-forced, all states"),
                       ("eval_ff_proxy_init", "teacher-forced, from the random initial state"),
                       ("eval_ff_decode", "jacobi decoding of the held-out prompts")):
        if pts := [(h["step"], h[key]) for h in proxy if key in h]:  # ff_decode: runs since 2026-11-26
            ax2.plot(*zip(*pts), marker="o", label=label)
    ax2.axhline(1.0, linestyle="--", color="grey", linewidth=1)
    ax2.set(xlabel="optimizer step", ylabel="tokens committed per Jacobi step",
            title="Fast-forward proxies (held-out records)")
    save_figure(fig, path, (ax1, ax2), legend={"fontsize": 8})
    return True


FF_GOAL, LOOP_SLACK, EOS_SLACK, DISTINCT_SLACK = 1.8, 3, 3, 0.10  # the CPU CLLM recipe's goals (docs/training/cllm.md)


def tradeoff_points(rows: list[dict], quality: list[dict], base: str) -> list[dict]:
    """Labels other than ``base`` with a Jacobi fast-forward and a quality row: {label, fast_forward, loops, n,
    distinct_4, eos_stops} (the first Jacobi row of a label when it has several)."""
    ff = {}
    for r in rows:
        if r["method"].startswith("jacobi") and r["fast_forward"] is not None:
            ff.setdefault(r["model"], r["fast_forward"])
    return [{"label": q["model"], "fast_forward": ff[q["model"]], "loops": q["loops"], "n": q["n"],
             "distinct_4": q["distinct_4"], "eos_stops": q["eos_stops"]}
            for q in quality if q["model"] != base and q["model"] in ff]


def plot_tradeoff(points: list[dict], base: dict, path: Path) -> bool:
    """Fast-forward against loops, EOS-ended answers and distinct 4-grams, with the goals' region shaded; False
    without points."""
    if not points:
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    lo_x = min(1.0, *(p["fast_forward"] for p in points)) - 0.05
    hi_x = max(FF_GOAL, *(p["fast_forward"] for p in points)) + 0.1
    bounds = ((max(0, base["loops"] - LOOP_SLACK), base["loops"] + LOOP_SLACK),
              (max(0, base["eos_stops"] - EOS_SLACK), base["eos_stops"] + EOS_SLACK),
              ((1 - DISTINCT_SLACK) * base["distinct_4"], 1.0))
    for ax, key, ylabel, (lo, hi) in zip(axes, ("loops", "eos_stops", "distinct_4"),
                                         (f"answers in a loop (of {base['n']})", f"answers ended with EOS (of "
                                          f"{base['n']})", "distinct 4-grams"), bounds):
        ax.axvspan(FF_GOAL, hi_x, ymin=0, ymax=1, color="tab:green", alpha=0.08)
        ax.axhspan(lo, hi, color="tab:green", alpha=0.12, label=f"goal: within the bound of {base['model']}")
        ax.axhline(base[key], color="grey", linestyle="--", linewidth=1, label=f"{base['model']} model")
        ax.axvline(FF_GOAL, color="tab:green", linestyle=":", linewidth=1, label=f"goal: fast-forward >= {FF_GOAL}")
        for p in points:
            ax.plot(p["fast_forward"], p[key], "o", color="tab:blue")
            ax.annotate(p["label"], (p["fast_forward"], p[key]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set(xlabel="fast-forward on the test prompts (tokens per Jacobi step)", ylabel=ylabel, xlim=(lo_x, hi_x))
    ys = [p["distinct_4"] for p in points if p["distinct_4"] is not None] + [base["distinct_4"], bounds[2][0]]
    axes[2].set_ylim(min(ys) - 0.03, max(ys) + 0.05)  # the band's top (1.0) would squeeze the points together
    axes[0].set_title("Speed against looping answers")
    axes[1].set_title("Speed against answers that end")
    axes[2].set_title("Speed against distinct 4-grams")
    save_figure(fig, path, tuple(axes), legend={"fontsize": 7})
    return True


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", action="append", default=[], metavar="LABEL=DIR", help="a bench dir on one model")
    ap.add_argument("--quality", action="append", default=[], metavar="LABEL=DIR",
                    help="an evaluate run of ar with long answers on one model (answer quality)")
    ap.add_argument("--run", type=Path, default=None, help="the training run dir (loss and proxy curves)")
    ap.add_argument("--base", default="base", help="the --quality label of the base model (the trade-off's bounds)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs/bench/cllm")
    a = ap.parse_args(argv)
    rows, quality = [], []
    for flag, specs in (("--bench", a.bench), ("--quality", a.quality)):
        for spec in specs:
            label, sep, d = spec.partition("=")
            if not sep or not Path(d).is_dir():
                raise SystemExit(f"error: {flag} {spec!r}: expected LABEL=DIR with an existing DIR")
            if flag == "--bench":
                rows += bench_rows(label, Path(d))
            else:
                quality.append(quality_row(label, Path(d)))
    if a.bench and not rows:
        raise SystemExit(f"error: no jacobi or lookahead run under {', '.join(a.bench)}")
    a.out.mkdir(parents=True, exist_ok=True)
    md = render(rows) if rows else ""
    if quality:
        md += ("\n" if md else "") + render_quality(quality, a.base)
    base = next((q for q in quality if q["model"] == a.base), None)  # render_quality set each other row's vs_base
    points = tradeoff_points(rows, quality, a.base)
    if base and plot_tradeoff(points, base, a.out / "cllm_tradeoff.png"):
        md += f"\nTrade-off plot: {a.out / 'cllm_tradeoff.png'}\n"
    history = log_history(a.run) if a.run else []
    if history and plot_training(history, a.out / "cllm_training.png"):
        md += f"\nTraining curves: {a.out / 'cllm_training.png'}\n"
        proxy = [h for h in history if "eval_ff_proxy" in h]
        if proxy:
            md += (f"Fast-forward proxy: {proxy[0]['eval_ff_proxy']:.3f} (step {proxy[0]['step']}) -> "
                   f"{proxy[-1]['eval_ff_proxy']:.3f} (step {proxy[-1]['step']}); from the initial state "
                   f"{proxy[0]['eval_ff_proxy_init']:.3f} -> {proxy[-1]['eval_ff_proxy_init']:.3f}"
                   + (f"; decoded {proxy[0]['eval_ff_decode']:.3f} -> {proxy[-1]['eval_ff_decode']:.3f}"
                      if "eval_ff_decode" in proxy[0] else "") + "\n")
    (a.out / "cllm_report.md").write_text(md)
    (a.out / "cllm_report.json").write_text(json.dumps({"rows": rows, "quality": quality}, indent=1) + "\n")
    print(md)

