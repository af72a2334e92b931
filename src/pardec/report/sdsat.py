"""The SDSAT report: the paper's Figures 3/4 (draft acceptance and tokens/s against k) and the quality-parity table.

    python -m pardec.report sdsat --bench outputs/bench/sdsat_humaneval [--bench ...] \
        [--base outputs/bench/sdsat_base_humaneval ...] [--eval outputs/train/runs/sdsat_smollm2/default/sdsat_eval.json] \
        [--out outputs/bench/sdsat]

* ``--bench``: bench runs on the SDSAT model (``pardec.bench speed --model local model.path=<final>``) whose method or
  ``bench.also`` roles include ``sdsat``; ar of the same model is each run's baseline.
* ``--base``: runs of ``ar`` on the base model; ``--ar``: runs of ``ar`` on the SDSAT model over the same prompts
  (default: the sdsat runs' baseline): the task metric of both side by side.
* ``--eval``: the training run's ``sdsat_eval.json`` (held-out plain-text perplexity, base vs trained; teacher-forced
  adaptive-token accuracy per depth).

Writes ``<out>/sdsat_report.md`` (printed too), ``<out>/sdsat_k.png`` (acceptance and tokens/s against k, one line
per variant and dataset, ar's tokens/s dashed), ``<out>/sdsat_losses.png`` (with ``--run <training run dir>``: the
plain and masked losses against the step, the paper's Figure 5) and ``<out>/sdsat_report.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pardec import REPO_ROOT  # noqa: E402
from pardec.report.plots import save_figure  # noqa: E402
from pardec.report.run_dirs import log_history, method_entries  # noqa: E402

ROOT = REPO_ROOT


def sdsat_rows(bench_dirs: list[Path]) -> list[dict]:
    """One row per sdsat run or role: dataset, dtype, sampling, variant, k, speed, acceptance, exact match, metric."""
    rows = []
    for s, _, params, e in method_entries(bench_dirs, ("sdsat",)):
        rows.append({"dataset": s["dataset"], "dtype": s.get("dtype") or "fp32", "sampling": _sampling(s),
                     "variant": params.get("variant", "two_step"),
                     "k": int(params.get("k", 5)), "top_k": params.get("top_k"), "tokens_per_s": e.get("tokens_per_s"),
                     "ar_tokens_per_s": s.get("baseline_tokens_per_s"), "speedup": e.get("speedup"),
                     "speedup_median": e.get("speedup_median"), "tokens_per_forward": e.get("tokens_per_forward"),
                     "acceptance": e.get("draft_acceptance"), "exact_match_rate": e.get("exact_match_rate"),
                     "metric": e.get("metric"), "ar_metric": s.get("baseline_metric"), "metric_name": s.get("metric_name"),
                     "perplexity": e.get("perplexity"), "run": s["_dir"]})
    return sorted(rows, key=lambda r: (r["dataset"], r["dtype"], r["sampling"], r["variant"], r["k"]))


def base_rows(base_dirs: list[Path]) -> list[dict]:
    """Runs of ar alone (on the base or the SDSAT model): dataset, the task metric, perplexity, tokens/s, prompts."""
    return [{"dataset": s["dataset"], "sampling": _sampling(s), "metric": e.get("metric"),
             "metric_name": s.get("metric_name"), "perplexity": e.get("perplexity"), "tokens_per_s": e.get("tokens_per_s"),
             "n": s.get("n_samples"), "run": s["_dir"]}
            for s, _, _, e in method_entries(base_dirs, ("ar",)) if e is s]


def _sampling(s: dict) -> str:
    samp = s.get("sampling") or {}
    t = samp.get("temperature", 0.0) if isinstance(samp, dict) else 0.0
    return "greedy" if not t else f"T={t:g}"


def _f(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def plot(rows: list[dict], path: Path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["dataset"], r["dtype"], r["sampling"], r["variant"]), []).append(r)
    for (ds, dtype, samp, variant), rs in sorted(groups.items()):
        ks = [r["k"] for r in rs]
        label = f"{ds} {dtype} {samp} {variant}"
        ax1.plot(ks, [r["acceptance"] or 0 for r in rs], marker="o", label=label)
        ax2.plot(ks, [r["tokens_per_s"] or 0 for r in rs], marker="o", label=label)
    ars = {(r["dataset"], r["dtype"], r["sampling"]): r["ar_tokens_per_s"] for r in rows if r["ar_tokens_per_s"]}
    for (ds, dtype, samp), v in sorted(ars.items()):
        ax2.axhline(v, linestyle="--", linewidth=1, color="grey")
        ax2.annotate(f"ar {ds} {dtype} {samp}", (ax2.get_xlim()[0], v), fontsize=7, va="bottom")
    ax1.set(xlabel="k (adaptive tokens)", ylabel="draft acceptance (accepted / drafted)", title="Acceptance vs k")
    ax2.set(xlabel="k (adaptive tokens)", ylabel="tokens / s", title="Speed vs k")
    ax1.legend(fontsize=7)
    save_figure(fig, path, (ax1, ax2))


def plot_losses(history: list[dict], path: Path) -> bool:
    """plain_loss and masked_loss against the step (the paper's Figure 5); False when nothing was logged."""
    steps = [h for h in history if "plain_loss" in h]
    if not steps:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("plain_loss", "plain tokens (plain rows)"), ("masked_loss", "adaptive positions")):
        ax.plot([h["step"] for h in steps], [h[key] for h in steps], marker=".", label=label)
    ax.set(xlabel="optimizer step", ylabel="cross-entropy", yscale="log", title="SDSAT training losses")
    save_figure(fig, path, (ax,), legend={})
    return True


def render(rows: list[dict], base: list[dict], ev: dict | None, ar: list[dict] = ()) -> str:
    md = ["## sdsat against k (bench runs on the SDSAT model; speedup vs ar of the same model)", "",
          "| dataset | dtype | sampling | variant | k | tokens/s | speedup (median) | tokens/forward | acceptance | "
          "exact match |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['dataset']} | {r['dtype']} | {r['sampling']} | {r['variant']} | {r['k']} | "
                  f"{_f(r['tokens_per_s'], 1)} | "
                  f"{_f(r['speedup'])} ({_f(r['speedup_median'])}) | {_f(r['tokens_per_forward'])} | "
                  f"{_f(r['acceptance'])} | {_f(r['exact_match_rate'])} |")
    md += ["", "## Quality parity: ar on the base model vs ar on the SDSAT model (same prompts)", "",
           "| dataset | metric | base | SDSAT |", "|---|---|---|---|"]
    # ar of the SDSAT model: its own runs (--ar) where given, else the sdsat bench runs' baseline
    sd = {(r["dataset"], r["sampling"]): r["ar_metric"] for r in rows}
    sd.update({(r["dataset"], r["sampling"]): r["metric"] for r in ar})
    for b in base:
        m = sd.get((b["dataset"], b["sampling"]))
        md.append(f"| {b['dataset']} ({b['n']} prompts, {b['sampling']}) | {b['metric_name']} | {_f(b['metric'])} | "
                  f"{_f(m)} |")
    if ev:
        md += ["", "## Held-out evaluation of the training run (sdsat_eval.json)", "", "```",
               json.dumps(ev, indent=1)[:4000], "```"]
    return "\n".join(md) + "\n"


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, action="append", default=[], help="bench dirs on the SDSAT model")
    ap.add_argument("--base", type=Path, action="append", default=[], help="ar runs on the base model")
    ap.add_argument("--ar", type=Path, action="append", default=[],
                    help="ar runs on the SDSAT model over the --base prompts (default: the sdsat runs' baseline)")
    ap.add_argument("--eval", type=Path, default=None, help="the training run's sdsat_eval.json")
    ap.add_argument("--run", type=Path, default=None, help="the training run dir (loss curves)")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs/bench/sdsat")
    a = ap.parse_args(argv)
    rows, base, ar = sdsat_rows(a.bench), base_rows(a.base), base_rows(a.ar)
    if not rows:
        raise SystemExit(f"error: no sdsat run or role under {', '.join(map(str, a.bench)) or '(no --bench)'}")
    ev = json.loads(a.eval.read_text()) if a.eval and a.eval.is_file() else None
    a.out.mkdir(parents=True, exist_ok=True)
    plot(rows, a.out / "sdsat_k.png")
    md = render(rows, base, ev, ar)
    if a.run and plot_losses(log_history(a.run), a.out / "sdsat_losses.png"):
        md += f"\nLoss curves: {a.out / 'sdsat_losses.png'}\n"
    (a.out / "sdsat_report.md").write_text(md)
    (a.out / "sdsat_report.json").write_text(json.dumps({"rows": rows, "base": base, "ar": ar, "eval": ev}, indent=1) + "\n")
    print(md)
    print(f"wrote {a.out / 'sdsat_report.md'}, {a.out / 'sdsat_k.png'}")

