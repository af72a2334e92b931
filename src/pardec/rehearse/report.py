"""The rehearsal's table and its result file: what ran, on which host, and how each recipe ended."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from pardec import REPO_ROOT
from pardec.rehearse.running import Result, note

COLUMNS = ("recipe", "stages", "ranks", "DeepSpeed", "wall", "result", "notes")


def table_rows(results: list[Result]) -> list[tuple[str, ...]]:
    return [(r.recipe, " + ".join(r.stages), str(r.ranks), r.deepspeed, f"{r.wall_s:.0f} s",
             "pass" if r.ok else "FAIL", note(r)) for r in results]


def as_result_file(doc: dict[str, Any]) -> dict[str, Any]:
    """A ``--json`` document as a result file docs/ can cite: its date, commit and host on top (results as data), n
    and dtype, and the table docs/rehearsal.md renders (``tables.rehearsal``)."""
    results = [Result(**r) for r in doc["results"]]
    h = doc["host"]
    return {**doc, "title": "The paper recipes rehearsed on the CPU: every stage, tiny models of each family",
            "date": h["date"][:10], "commit": h["commit"] + (" + uncommitted changes" if h.get("dirty") else ""),
            "dtype": "as each recipe says (fp32 / bf16 on tiny models)", "n": f"{len(results)} recipes",
            "passed": sum(r.ok for r in results),
            "tables": {"rehearsal": {"columns": list(COLUMNS), "rows": [list(x) for x in table_rows(results)]}}}


def table(results: list[Result]) -> str:
    rows = [COLUMNS, *table_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    """Markdown of a ``--json`` file: host line, the table, every recipe's overrides (docs/rehearsal.md)."""
    results = [Result(**r) for r in doc["results"]]
    h = doc["host"]
    lines = [f"`{doc['command']}` on {h['cpu']} ({h['cores']} cores; {' '.join(h['cpu_flags']) or 'no AVX'}), "
             f"{h['date']}, commit {h['commit']}{' + uncommitted changes' if h.get('dirty') else ''}; "
             f"{sum(r.ok for r in results)}/{len(results)} passed, {doc['total_wall_s']:.0f} s in all.", "",
             table(results), "", "Overrides per recipe (everything else is the recipe's):", ""]
    for r in results:  # the work dir as $OUT (--out)
        out = str(Path(r.log).parent.parent) + "/" if r.log else None
        r.overrides = {k: [o.replace(out, "$OUT/") if out else o for o in v] for k, v in r.overrides.items()}
        lines.append(f"* `{r.recipe}`: " + "; ".join(f"{what}: `{' '.join(ovs)}`" if ovs else
                                                     f"{what}: (none{': the trained tiny model' if what == 'model' else ''})"
                                                     for what, ovs in r.overrides.items()))
    return "\n".join(lines)


def host() -> dict[str, Any]:
    from pardec.models.host import cpu_flags, cpu_model  # heavy: transformers

    cpu, flags = cpu_model(), cpu_flags()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                                text=True).stdout.strip())
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "commit": commit, "dirty": dirty,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version()}
