"""Method extras per role, averaged over prompts, from evaluate run dirs (their results.jsonl).

    python -m pardec.report extras outputs/bench/<run>/runs/*   [--keys block_efficiency,pool_hit_rate]

One row per (dataset, role) whose records carry any of the keys: the Ouroboros split of accepted tokens
(``accepted_from_draft`` / ``accepted_from_phrases``, summed), its block efficiency and draft forwards per token,
lookahead's tokens per step and pool hit rate (means over prompts).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from pardec.evaluation.tables import method_label
from pardec.report.markdown import markdown_table

KEYS = ("block_efficiency", "draft_forwards_per_token", "accepted_from_draft", "accepted_from_phrases",
        "accepted_per_step", "pool_lookup_rate", "pool_hit_rate")
SUMMED = ("accepted_from_draft", "accepted_from_phrases")


def rows(run_dir: Path, keys: tuple[str, ...]) -> list[dict]:
    """Per role of one run: n prompts and the keys' means (sums for SUMMED)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    by_role: dict[str, list[dict]] = {}
    for line in (run_dir / "results.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "error" not in rec and any(k in (rec.get("extras") or {}) for k in keys):
            by_role.setdefault(rec["role"], []).append(rec["extras"])
    out = []
    for role, extras in sorted(by_role.items()):
        label = role.removeprefix("also:")
        if role == "method":  # the run's method, with the parameters that differ from its defaults
            label = method_label(summary["method"], summary.get("method_params") or {})
        row = {"dataset": summary["dataset"], "role": label, "n": len(extras)}
        for k in keys:
            vals = [e[k] for e in extras if e.get(k) is not None]
            row[k] = (sum(vals) if k in SUMMED else statistics.mean(vals)) if vals else None
        out.append(row)
    return out


def table(all_rows: list[dict], keys: tuple[str, ...]) -> str:
    return markdown_table(
        ["dataset", "role", "n", *keys],
        [[r["dataset"], r["role"], str(r["n"]),
          *("–" if r[k] is None else (f"{r[k]:.0f}" if k in SUMMED else f"{r[k]:.2f}") for k in keys)]
         for r in all_rows])


def main(argv: list[str] | None = None, prog: str | None = None) -> str:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="evaluate run dirs (each with summary.json, results.jsonl)")
    ap.add_argument("--keys", default=",".join(KEYS))
    a = ap.parse_args(argv)
    keys = tuple(a.keys.split(","))
    text = table([r for d in a.runs if (d / "summary.json").is_file() for r in rows(d, keys)], keys)
    print(text)
    return text

