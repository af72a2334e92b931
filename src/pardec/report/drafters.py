"""Trained drafters side by side: distilled drafts (kind ``draft``), Medusa heads / FIRP projections / EAGLE-3
/ DFlash (kind ``drafter``) or SDSAT models (kind ``sdsat``); training curves and held-out results of one or
more runs, e.g. a corpus-size study (the same recipe at ``draft.corpus_fraction`` / ``drafter.corpus_fraction`` / an
sdsat completions source's ``fraction`` 0.5 and 1):

    python -m pardec.report drafters --run full=outputs/train/runs/draft_smollm2/default \
        --run half=outputs/train/runs/draft_smollm2/half [--out outputs/draft_report]
    python -m pardec.report drafters --run c1000=outputs/train/runs/heads_medusa_smollm2/c1000 --run q250=... --out ...

Per run: its logged steps (``log_history.json``, else the newest checkpoint's state), its train summary
(``train_summary.json`` of the train stage: samples, corpus fraction, steps, seconds) when there is one, and its
held-out evaluation: a draft's ``draft_eval.json`` (teacher-forced top-1 agreement and expected acceptance at
temperature 1, 1 - TVD, per held-out dataset; forward cost vs the target), or a drafter's ``drafter_eval.json``
(Medusa / FIRP: top-1 / top-5 per depth, expected tokens per step of the chain and the searched trees; EAGLE-3 /
DFlash: top-1 agreement and chain acceptance per draft position, expected tokens per target forward), or an SDSAT
model's ``sdsat_eval.json`` (held-out perplexity against the base per source, the adaptive token's top-1 against the
model's own greedy token per depth, expected tokens per two-step loop). Writes ``report.md``, ``report.json``,
``draft_curves.png`` (KL and top-1 agreement on the training batches against the optimizer step; a drafter run logs
the mean over its depths, a DFlash run its cross-entropy in place of the KL), ``slot_curves.png`` (the same per
draft position 1, 2, 4, 8, 15, against the step and the training minutes) and, for SDSAT runs,
``sdsat_curves.png`` (plain and masked losses).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from pardec.report.markdown import markdown_table  # noqa: E402
from pardec.report.plots import save_figure  # noqa: E402
from pardec.report.run_dirs import log_history  # noqa: E402

CURVES = {"kl": "KL(target || draft) (DFlash: CE to the label), nats",
          "agreement": "top-1 agreement (training batches)"}
SDSAT_CURVES = {"plain_loss": "plain loss (ordinary tokens), nats", "masked_loss": "masked loss (adaptive tokens), nats"}
SDSAT_DEPTHS = 3  # adaptive-token depths in the table
SLOTS = (1, 2, 4, 8, 15)  # the draft positions whose logged curves slot_plot draws (DFlash's block slots, EAGLE-3's steps)


def read_run(run_dir: Path) -> dict:
    """What one run left behind; missing parts are None (a run still training has no eval)."""
    def load(name: str) -> dict | None:
        f = run_dir / name
        return json.loads(f.read_text()) if f.is_file() else None

    summary = load("train_summary.json")
    train = summary.get("train") if summary and isinstance(summary.get("train"), dict) else None
    steps = [h for h in log_history(run_dir) if "loss" in h and "step" in h]
    return {"dir": str(run_dir), "history": steps, "train": train, "eval": load("draft_eval.json"),
            "drafter_eval": load("drafter_eval.json"), "sdsat_eval": load("sdsat_eval.json")}


def _fmt(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _markdown(head: list[str], rows: list[list]) -> str:
    """A markdown table; the train minutes with one decimal, other floats with three."""
    minutes = head.index("train min")
    return markdown_table(head, [[_fmt(x, 1 if i == minutes else 3) for i, x in enumerate(row)] for row in rows]) + "\n"


def table(runs: dict[str, dict]) -> str:
    datasets = sorted({d for r in runs.values() if r["eval"] for d in r["eval"]["agreement"]})
    head = ["run", "samples", "corpus fraction", "steps", "train min", "last logged kl", "last logged agreement",
            *[f"held-out agreement {d}" for d in datasets],
            *[f"held-out expected acceptance at T=1 {d}" for d in datasets], "draft / target forward"]
    rows = []
    for label, r in runs.items():
        t, e, last = r["train"] or {}, r["eval"] or {}, (r["history"] or [{}])[-1]
        secs = t.get("train_seconds")
        row = [label, t.get("samples"), t.get("corpus_fraction"), t.get("steps") or last.get("step"),
               None if secs is None else secs / 60, last.get("kl"), last.get("agreement"),
               *[e.get("agreement", {}).get(d, {}).get("agreement") for d in datasets],
               *[e.get("agreement", {}).get(d, {}).get("expected_acceptance_t1") for d in datasets],  # older evals: –
               e.get("cost", {}).get("draft_over_target")]
        rows.append(row)
    return _markdown(head, rows)


def heads_table(runs: dict[str, dict]) -> str:
    """Heads runs (each with a ``drafter_eval.json``): held-out top-1 / top-5 per depth, expected tokens per step of
    the chain and of each searched tree."""
    depth = max(len(r["drafter_eval"]["overall"]["topk_accuracy"]) for r in runs.values())
    trees = sorted({t for r in runs.values() for t in r["drafter_eval"]["trees"]}, key=lambda t: (t != "chain", len(t), t))
    head = ["run", "samples", "corpus fraction", "steps", "train min", "last logged kl", "last logged top-1",
            *[f"held-out top-1 step {d + 1}" for d in range(depth)],
            *[f"held-out top-5 step {d + 1}" for d in range(depth)], *[f"expected tokens/step {t}" for t in trees]]
    rows = []
    for label, r in runs.items():
        t, e, last = r["train"] or {}, r["drafter_eval"], (r["history"] or [{}])[-1]
        acc = e["overall"]["topk_accuracy"]
        secs = t.get("train_seconds")
        row = [label, t.get("samples"), t.get("corpus_fraction"), t.get("steps") or last.get("step"),
               None if secs is None else secs / 60, last.get("kl"), last.get("top1"),
               *[acc[d][0] if d < len(acc) else None for d in range(depth)],
               *[acc[d][4] if d < len(acc) and len(acc[d]) > 4 else None for d in range(depth)],
               *[e["trees"].get(k, {}).get("expected_accept_length") for k in trees]]
        rows.append(row)
    return _markdown(head, rows)


def chain_table(runs: dict[str, dict]) -> str:
    """EAGLE-3 / DFlash runs (a ``drafter_eval.json`` of a chain drafter: :func:`pardec.training.drafter.trainer.
    evaluate_chain`): held-out top-1 agreement and chain acceptance per draft position, expected tokens per target
    forward pooled and per held-out dataset. Their logged loss is the KL (EAGLE-3) or the cross-entropy (DFlash)."""
    depth = max(r["drafter_eval"]["steps"] for r in runs.values())
    datasets = sorted({d for r in runs.values() for d in r["drafter_eval"].get("per_dataset", {})})
    head = ["run", "kind", "samples", "corpus fraction", "steps", "train min", "last logged kl / ce",
            "last logged top-1", *[f"held-out top-1 position {d + 1}" for d in range(depth)],
            *[f"chain acceptance position {d + 1}" for d in range(depth)], "expected tokens/forward",
            *[f"expected tokens/forward {d}" for d in datasets]]
    rows = []
    for label, r in runs.items():
        t, e, last = r["train"] or {}, r["drafter_eval"], (r["history"] or [{}])[-1]
        o, secs = e["overall"], t.get("train_seconds")
        rows.append([label, e["kind"], t.get("samples"), t.get("corpus_fraction"), t.get("steps") or last.get("step"),
                     None if secs is None else secs / 60, last.get("kl", last.get("ce")), last.get("top1"),
                     *[o["top1_agreement"][d] if d < len(o["top1_agreement"]) else None for d in range(depth)],
                     *[o["chain_acceptance"][d] if d < len(o["chain_acceptance"]) else None for d in range(depth)],
                     o["expected_tokens_per_forward"],
                     *[e["per_dataset"].get(d, {}).get("expected_tokens_per_forward") for d in datasets]])
    return _markdown(head, rows)


def _chain_drafter(run: dict) -> bool:
    """A run whose ``drafter_eval.json`` measured a chain drafter (EAGLE-3, DFlash) rather than trees of heads."""
    return "trees" not in run["drafter_eval"] and "chain_acceptance" in run["drafter_eval"].get("overall", {})


def sdsat_table(runs: dict[str, dict]) -> str:
    """SDSAT runs (each with an ``sdsat_eval.json``): held-out perplexity ratio (trained / base) per source and
    overall, the adaptive token's top-1 against the model's greedy token at the first depths, expected tokens per
    two-step loop (all sources)."""
    sources = sorted({k for r in runs.values() for k in r["sdsat_eval"]["per_source"]})
    head = ["run", "records", "masked positions", "steps", "train min", "last plain loss", "last masked loss",
            *[f"perplexity ratio {k}" for k in sources], "perplexity ratio all",
            *[f"held-out top-1 depth {d + 1}" for d in range(SDSAT_DEPTHS)], "expected tokens per loop"]
    rows = []
    for label, r in runs.items():
        t, e, last = r["train"] or {}, r["sdsat_eval"], (r["history"] or [{}])[-1]
        acc = e["overall"]["adaptive"]["accuracy_vs_model"]
        secs = t.get("train_seconds")
        rows.append([label, t.get("records"), t.get("masked_positions"), t.get("steps") or last.get("step"),
                     None if secs is None else secs / 60, last.get("plain_loss"), last.get("masked_loss"),
                     *[e["per_source"].get(k, {}).get("ppl_ratio") for k in sources], e["overall"]["ppl_ratio"],
                     *[acc[d] if d < len(acc) else None for d in range(SDSAT_DEPTHS)],
                     e["overall"]["adaptive"]["expected_tokens_per_loop_vs_model"]])
    return _markdown(head, rows)


def plot(runs: dict[str, dict], path: Path, curves: dict[str, str] = CURVES) -> bool:
    """``curves`` (logged key -> axis label) against the optimizer step, one panel each; False when no run logged
    any of them."""
    keys = set(curves) | ({"top1"} if "agreement" in curves else set()) | ({"ce"} if "kl" in curves else set())
    if not any(k in h for r in runs.values() for h in r["history"] for k in keys):
        return False
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6))
    for ax, (key, ylabel) in zip(axes, curves.items()):
        for label, r in runs.items():
            name = "top1" if key == "agreement" and r.get("drafter_eval") else key  # a drafter run's mean top-1
            if key == "kl" and not any("kl" in h for h in r["history"]):
                name = "ce"  # DFlash logs its cross-entropy to the label instead
            pts = [(h["step"], float(h[name])) for h in r["history"] if name in h]
            if pts:
                ax.plot(*zip(*pts), label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
    save_figure(fig, path, axes, legend={"fontsize": 8})
    return True


def slot_plot(runs: dict[str, dict], path: Path) -> bool:
    """Per draft position k in :data:`SLOTS` that any run logged: its cross-entropy (DFlash) or KL (EAGLE-3, Medusa,
    FIRP) and top-1 on the training batches against the optimizer step, and against the training minutes (the
    run's train seconds spread evenly over its steps), one column per position; False when none logged one."""
    slots = [k for k in SLOTS if any(f"top1_d{k}" in h for r in runs.values() for h in r["history"])]
    if not slots:
        return False
    fig, axes = plt.subplots(3, len(slots), figsize=(3.6 * len(slots), 8.4), squeeze=False)
    colors = {label: f"C{i % 10}" for i, label in enumerate(runs)}  # one color per run in every panel
    for col, k in enumerate(slots):
        for label, r in runs.items():
            hist = [h for h in r["history"] if f"top1_d{k}" in h]
            if not hist:
                continue
            loss = f"ce_d{k}" if f"ce_d{k}" in hist[0] else f"kl_d{k}"
            steps = (r["train"] or {}).get("steps") or hist[-1]["step"]
            per_step = ((r["train"] or {}).get("train_seconds") or 0) / 60 / max(steps, 1)
            for row, key in ((0, loss), (1, f"top1_d{k}")):
                axes[row][col].plot([h["step"] for h in hist], [float(h[key]) for h in hist], label=label,
                                    color=colors[label])
            if per_step:
                axes[2][col].plot([h["step"] * per_step for h in hist], [float(h[f"top1_d{k}"]) for h in hist],
                                  label=label, color=colors[label])
        axes[0][col].set_title(f"draft position {k}")
        axes[0][col].set_ylabel("CE (DFlash) / KL, nats")
        axes[1][col].set_ylabel("top-1 (training batches)")
        axes[1][col].set_xlabel("optimizer step")
        axes[2][col].set_ylabel("top-1 (training batches)")
        axes[2][col].set_xlabel("training minutes")
    save_figure(fig, path, [ax for row in axes for ax in row], legend={"fontsize": 7})
    return True


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="LABEL=DIR", help="a draft, drafter or sdsat run dir (repeat)")
    ap.add_argument("--out", type=Path, default=Path("outputs/draft_report"))
    a = ap.parse_args(argv)
    runs = {}
    for item in a.run:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_dir():
            ap.error(f"--run {item!r}: give LABEL=DIR with an existing run directory")
        runs[label] = read_run(Path(path))
    a.out.mkdir(parents=True, exist_ok=True)
    chains = {k: r for k, r in runs.items() if r["drafter_eval"] and _chain_drafter(r)}
    heads = {k: r for k, r in runs.items() if r["drafter_eval"] and k not in chains}
    sdsat = {k: r for k, r in runs.items() if r["sdsat_eval"] and k not in heads and k not in chains}
    drafts = {k: r for k, r in runs.items() if k not in heads and k not in chains and k not in sdsat}
    tables = [f(group) for f, group in ((table, drafts), (heads_table, heads), (chain_table, chains),
                                        (sdsat_table, sdsat)) if group]
    md = "\n".join(tables)
    if plot({k: r for k, r in runs.items() if k not in sdsat}, a.out / "draft_curves.png"):
        md += "\n![training curves](draft_curves.png)\n"
    if slot_plot({k: r for k, r in runs.items() if k not in sdsat}, a.out / "slot_curves.png"):
        md += "\n![training curves per draft position](slot_curves.png)\n"
    if sdsat and plot(sdsat, a.out / "sdsat_curves.png", SDSAT_CURVES):
        md += "\n![SDSAT training curves](sdsat_curves.png)\n"
    (a.out / "report.md").write_text(md)
    (a.out / "report.json").write_text(json.dumps(runs, indent=1) + "\n")
    print(md)
    return 0

