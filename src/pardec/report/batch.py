"""The batched-decoding overview of docs/batch.md: every published batch run, one row each, with the batch size at
which each of its methods first falls below batched ``ar`` (the crossover), generated from the result files
``python -m pardec.bench batch --publish`` (or a manual publication) wrote under ``docs/results/batch_*.json``.

    <!-- batch-crossover -->
    ...
    <!-- /batch-crossover -->
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pardec.report.markdown import DocsError, _rel, markdown_table, method_label

CROSSOVER = re.compile(r"(<!-- batch-crossover -->\n)(?P<body>.*?)(<!-- /batch-crossover -->)", re.S)


def run_mode(ident: dict) -> str:
    """A batch run's attention and forward where they are not the defaults, for its captions."""
    return "".join(f" ({ident[k]} {what})" for k, what in (("attention", "attention"), ("forward", "forward"))
                   if ident.get(k))


def host_class(host: dict) -> str:
    """``AMD EPYC, AVX2 only`` / ``..., AVX-512`` / ``..., AMX``: what separates pardec's CPU hosts' figures."""
    flags = set(host.get("flags") or ())
    vec = "AMX" if any(f.startswith("amx") for f in flags) else "AVX-512" if "avx512f" in flags else "AVX2 only"
    return f"{host.get('gpu') or host.get('cpu', '?')}, {vec}"


def render_crossover(md_file: Path, docs: Path) -> str:
    """One row per published batch run (newest first): date, dataset, dtype and mode, prompts x new tokens, host,
    batch sizes, batched ``ar`` at its largest batch against batch 1, each method's crossover ("never": above
    batched ``ar`` at every batch size of the run), and the methods some of whose rows differ from batch-1 ``ar``'s
    (lossy by design, or a mode that is not exact)."""
    rows = []
    for f in sorted((docs / "results").glob("batch_*.json")):
        data = json.loads(f.read_text())
        ident, cells = data.get("identity"), data.get("cells")
        if not ident or not cells or "crossover" not in data:
            raise DocsError(f"{f}: not a batch run's result file (identity, cells and crossover expected)")
        sizes = sorted({c["batch_size"] for c in cells})
        top = [c for c in cells if c["method"] == "ar" and c["batch_size"] == sizes[-1]]
        ar_top = f"{top[0]['vs_ar_at_1']:.2f}× at {sizes[-1]}" if top and top[0].get("vs_ar_at_1") else "–"
        cross = ", ".join(f"{method_label(m)}: {b if b is not None else f'never (up to {sizes[-1]})'}"
                          for m, b in data["crossover"].items())
        differ = sorted({method_label(c["method"]) for c in cells if c.get("exact_match") is not None
                         and c["exact_match"] < 1})
        rows.append((data.get("date", ""), f.name, [
            f"[{data.get('date', '?')}]({_rel(f, md_file)})", ident["dataset"], f"{ident['dtype']}{run_mode(ident)}",
            f"{ident['n']} × {ident['max_new_tokens']}", host_class(ident["host"]),
            ", ".join(map(str, sizes)), ar_top, cross or "–", ", ".join(differ) or "none"]))
    rows.sort(key=lambda r: (r[0], r[1]), reverse=True)
    return markdown_table(["run", "dataset", "dtype", "prompts × tokens", "host", "batch sizes",
                           "batched ar vs batch 1", "crossover (first batch size below batched ar)",
                           "rows not equal to batch-1 ar in"],
                          [r[2] for r in rows]) + "\n"
