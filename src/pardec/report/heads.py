"""The FIRP paper's analyses, Medusa vs FIRP on the same target (`make heads-report` runs it on the trained ones):

1. per-step top-1 / top-5 accuracy of the drafts on held-out data (teacher-forced; from each drafter's
   ``drafter_eval.json``, written by the training recipe's eval stage),
2. accepted tokens per target forward with trees T16 / T32 / T63 (the paper's Table 3 setting; from the bench
   runs' ``summary.json``: every ``medusa`` / ``firp`` run or ``bench.also`` role found under --bench),
3. cosine similarity between FIRP's pseudo hidden states and the real hidden states of the same positions, layer by
   layer from the layer each is born at (the paper's "progressively refined" figure), on held-out completions,
4. draft size in parameters (and as a share of the target's),
5. FIRP's Fig. 7: per-step accuracy of the same projections when a pseudo state also sees the earlier pseudo states
   ("No masked", the paper's inference and decoding's default) and when it sees only the real states and itself
   ("Masked"), from ``drafter_eval.json``'s ``attention_views``.

    python -m pardec.report heads --medusa outputs/train/runs/heads_medusa_smollm2/default/final \
        --firp outputs/train/runs/heads_firp_smollm2/default/final [--bench outputs/bench/heads] \
        [--records data/completions/draft_smollm2/eval/gsm8k/completions.jsonl] [--n 16] [--out outputs/heads_report]

Writes ``report.md`` (tables), ``report.json`` and the plots ``cosine.png``, ``accuracy.png`` and ``fig7.png`` to
--out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import matplotlib
from hydra import compose, initialize_config_dir

from pardec import CONF_DIR
from pardec.config import ConfigError, ModelConfig, to_dataclass
from pardec.models.cached import CachedModel
from pardec.models.drafters import load_drafter, read_meta
from pardec.models.loading import load_model

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from pardec import REPO_ROOT  # noqa: E402
from pardec.models.pseudo import forward_pseudo  # noqa: E402
from pardec.report.plots import save_figure  # noqa: E402
from pardec.report.run_dirs import method_entries  # noqa: E402

ROOT = REPO_ROOT


def load_eval(final: Path) -> dict:
    """``drafter_eval.json`` of a trained drafter (in its run dir, the parent of ``final``)."""
    for f in (final / "drafter_eval.json", final.parent / "drafter_eval.json"):
        if f.is_file():
            return json.loads(f.read_text())
    raise FileNotFoundError(f"no drafter_eval.json next to {final}: run the recipe's stage=eval first")


def pseudo_cosine(model, proj, records: list[dict], n: int) -> dict:
    """Mean cosine(pseudo state, real state of the same position) per step and layer, over the completion
    positions of ``n`` records; layer ``l`` = entering decoder layer l, ``L`` = after the last layer."""
    cm = CachedModel(model)
    k, n_layers = proj.k, model.config.num_hidden_layers
    sums = torch.zeros(k, n_layers + 1, dtype=torch.float64)
    counts = torch.zeros(k, n_layers + 1, dtype=torch.float64)
    for r in records[:n]:
        ids = r["prompt_ids"] + r["completion_ids"]
        start = len(r["prompt_ids"]) - 1  # anchors from the last prompt token on
        cm.reset()
        with torch.inference_mode():
            out = forward_pseudo(cm, torch.tensor([ids]), proj, proj.layers, capture=True, attention=proj.attention)
        for layer, (real, pseudo) in enumerate(out.layers):  # real [1, T, H], pseudo [1, T, born, H]
            for i in range(pseudo.shape[2]):
                anchors = torch.arange(start, len(ids) - i - 1)
                if anchors.numel() == 0:
                    continue
                cos = torch.cosine_similarity(pseudo[0, anchors, i].double(), real[0, anchors + i + 1].double(), -1)
                sums[i, layer] += float(cos.sum())
                counts[i, layer] += anchors.numel()
    mean = (sums / counts.clamp(min=1)).tolist()
    return {"layers": list(range(n_layers)) + ["out"], "born": proj.layers,
            "cosine": [[mean[i][x] if counts[i, x] else None for x in range(n_layers + 1)] for i in range(k)],
            "positions": int(counts[0].max())}


def bench_rows(bench_dirs: list[Path]) -> list[dict]:
    """(dataset, method, tree, tokens/forward, speedup, exact match) of every medusa/firp run or role found."""
    rows = []
    for s, method, params, e in method_entries(bench_dirs, ("medusa", "medusa_typical", "firp")):
        rows.append({"dataset": s["dataset"], "method": method, "tree": params.get("tree", "chain"),
                     "tokens_per_forward": e.get("tokens_per_forward"), "speedup": e.get("speedup"),
                     "exact_match_rate": e.get("exact_match_rate"), "run": s["_dir"]})
    return rows


def _fmt(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--medusa", type=Path, required=True, help="trained heads (<run>/final)")
    ap.add_argument("--firp", type=Path, required=True, help="trained projections (<run>/final)")
    ap.add_argument("--bench", type=Path, action="append", default=[], help="bench output dirs (repeatable)")
    ap.add_argument("--records", type=Path, default=ROOT / "data/completions/draft_smollm2/eval/gsm8k/completions.jsonl")
    ap.add_argument("--n", type=int, default=16, help="held-out records for the cosine analysis")
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "heads_report")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)

    try:
        metas = {"medusa": read_meta(a.medusa, "--medusa"), "firp": read_meta(a.firp, "--firp")}
        evals = {"medusa": load_eval(a.medusa), "firp": load_eval(a.firp)}
    except (ConfigError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    if not a.records.is_file():
        sys.exit(f"error: --records {a.records} does not exist (held-out completions: the recipe's eval stage)")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        mcfg = to_dataclass(ModelConfig, compose("evaluate", overrides=[f"model={a.model}"]).model, "model")
    lm = load_model(mcfg)
    target_params = sum(p.numel() for p in lm.model.parameters())
    proj, _ = load_drafter(a.firp, lm.model.config, "firp", "--firp")
    records = [json.loads(x) for x in a.records.read_text().splitlines() if x.strip()]
    t0 = time.perf_counter()
    cos = pseudo_cosine(lm.model, proj, records, a.n)
    cos["seconds"] = time.perf_counter() - t0
    acc = {k: e.get("overall", e) for k, e in evals.items()}
    rows = bench_rows(a.bench)
    report = {"date": time.strftime("%Y-%m-%d"), "model": a.model, "records": str(a.records), "n": a.n,
              "parameters": {k: m["parameters"] for k, m in metas.items()}, "target_parameters": target_params,
              "accuracy": acc, "cosine": cos, "bench": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    md = [f"# Medusa vs FIRP on {a.model} ({report['date']})", ""]
    md += ["## Draft size", "", "| drafter | parameters | share of the target |", "|---|---:|---:|"]
    for k, p in report["parameters"].items():
        md.append(f"| {k} | {p / 1e6:.2f} M | {p / target_params:.1%} |")
    ratio = report["parameters"]["medusa"] / max(1, report["parameters"]["firp"])
    md += ["", f"Medusa / FIRP parameters: {ratio:.1f}x (target {target_params / 1e6:.1f} M).", ""]
    md += ["## Per-step accuracy (held-out, teacher-forced)", "", "| drafter | step | top-1 | top-5 |",
           "|---|---:|---:|---:|"]
    for k, e in acc.items():
        for d, row in enumerate(e["topk_accuracy"]):
            md.append(f"| {k} | {d + 1} | {_fmt(row[0], 3)} | {_fmt(row[min(4, len(row) - 1)], 3)} |")
    views = evals["firp"].get("attention_views")  # FIRP Fig. 7 (an eval stage older than it has none)
    if views:
        md += ["", "## FIRP Fig. 7: the same projections, pseudo states masked or not (held-out)", "",
               "| view | attention | step | top-1 | top-5 |", "|---|---|---:|---:|---:|"]
        for v, e in views.items():
            for d, row in enumerate(e["topk_accuracy"]):
                md.append(f"| {e['fig7_name']} | {v} | {d + 1} | {_fmt(row[0], 3)} | "
                          f"{_fmt(row[min(4, len(row) - 1)], 3)} |")
    md += ["", "## Accepted tokens per target forward (bench runs)", "",
           "| dataset | method | tree | tokens/forward | speedup vs ar | exact match |", "|---|---|---|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["dataset"], r["method"], r["tree"])):
        md.append(f"| {r['dataset']} | {r['method']} | {r['tree']} | {_fmt(r['tokens_per_forward'])} | "
                  f"{_fmt(r['speedup'])} | {_fmt(r['exact_match_rate'])} |")
    md += ["", f"## Pseudo vs real hidden states (cosine, {cos['positions']} positions of {a.n} held-out records)",
           "", "| step | born at layer | at birth | " + " | ".join(f"+{x}" for x in (4, 8)) + " | after the last layer |",
           "|---:|---:|---:|---:|---:|---:|"]
    for i, row in enumerate(cos["cosine"]):
        b = cos["born"][i]
        pick = [row[b + x] if b + x < len(row) - 1 else None for x in (0, 4, 8)]
        md.append(f"| {i + 1} | {b} | " + " | ".join(_fmt(x, 3) for x in pick) + f" | {_fmt(row[-1], 3)} |")
    (a.out / "report.md").write_text("\n".join(md) + "\n")

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(len(cos["layers"])))
    for i, row in enumerate(cos["cosine"]):
        pts = [(x, y) for x, y in zip(xs, row) if y is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=f"step {i + 1} (born at {cos['born'][i]})")
    ax.set_xticks(xs[::3] + [xs[-1]], [str(x) for x in cos["layers"][::3]] + ["out"])
    ax.set_xlabel("layer (input of)")
    ax.set_ylabel("cosine(pseudo, real)")
    ax.set_title(f"FIRP pseudo states refined layer by layer ({a.model})")
    save_figure(fig, a.out / "cosine.png", (ax,), legend={})
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, e in acc.items():
        steps = range(1, len(e["topk_accuracy"]) + 1)
        ax.plot(steps, [r[0] for r in e["topk_accuracy"]], marker="o", label=f"{k} top-1")
        ax.plot(steps, [r[min(4, len(r) - 1)] for r in e["topk_accuracy"]], marker="s", ls="--", label=f"{k} top-5")
    ax.set_xlabel("step ahead")
    ax.set_ylabel("held-out accuracy")
    save_figure(fig, a.out / "accuracy.png", (ax,), legend={})
    if views:
        fig, ax = plt.subplots(figsize=(6, 4))
        k = len(next(iter(views.values()))["topk_accuracy"])
        width = 0.8 / len(views)
        for j, (v, e) in enumerate(views.items()):
            ax.bar([d + 1 + (j - (len(views) - 1) / 2) * width for d in range(k)],
                   [r[0] for r in e["topk_accuracy"]], width, label=f"{e['fig7_name']} ({v})")
        ax.set_xticks(range(1, k + 1))
        ax.set_xlabel("pseudo step")
        ax.set_ylabel("held-out top-1 accuracy")
        ax.set_title("FIRP Fig. 7: Masked vs No masked (same projections)")
        save_figure(fig, a.out / "fig7.png", (ax,), legend={})
    print("\n".join(md))
    print(f"\nwritten: {a.out}/report.md, report.json, cosine.png, accuracy.png" + (", fig7.png" if views else ""))

