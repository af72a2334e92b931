"""A table's directory (``python -m pardec.bench table``): what a table run must keep across its processes (its
identity: host, dtype, methods, the zoo artifacts by their manifests' sha256), the commits each run ran at, the date
it started, and the runs set aside to run anew after a zoo artifact was rebuilt (``--redo``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from pardec.config.schema import settings_diff
from pardec.evaluation.results import write_json
from pardec.jsonl import read_json
from pardec.zoo.build import git_state

RUN_FILE = "table_run.json"


class TableError(ValueError):
    """A run that cannot continue (one line)."""


def check_identity(out: Path, ident: dict[str, Any], ignore: tuple[str, ...] = ()) -> None:
    """Record the run's identity, or refuse a rerun whose identity differs, in one line naming each difference
    (but in the keys ``ignore``)."""
    f = out / RUN_FILE
    if f.is_file():
        skip = ("commits", "started", *ignore)
        kept = {k: v for k, v in read_json(f, TableError).items() if k not in skip}
        diff = settings_diff(kept, json.loads(json.dumps({k: v for k, v in ident.items() if k not in skip})))
        if diff:
            zoo = " (a rebuilt zoo artifact: --redo the runs that decode with it)" if all(
                d.startswith("zoo.") for d in diff) else ""
            raise TableError(f"cannot continue the table in {out}: it was started with other settings "
                             f"({'; '.join(diff)}){zoo}; continue it there as it was, or pass another --out")
        return
    out.mkdir(parents=True, exist_ok=True)
    write_json(f, {**ident, "started": time.strftime("%Y-%m-%d")})


def kept_shared(out: Path, current) -> None:
    """Rewrite the kept identity's method entries under their names now (``current``: entry -> entry): a method
    renamed since the table began is the same method."""
    f = out / RUN_FILE
    if not f.is_file():
        return
    data = read_json(f, TableError)
    now = [current(e) for e in data.get("shared") or []]
    if now != data.get("shared", []):
        write_json(f, {**data, "shared": now})


def started(out: Path) -> str:
    """The date the table in ``out`` started (``table_run.json``'s ``started``; for a table begun before it was
    recorded, the date of its oldest run's ``run.json``)."""
    day = read_json(out / RUN_FILE, TableError).get("started")
    if day:
        return day
    times = [f.stat().st_mtime for f in (out / "runs").glob("*/run.json")]
    return time.strftime("%Y-%m-%d", time.localtime(min(times) if times else None))


def redo(out: Path, names: list[str], zoo: dict[str, str], runs: dict[str, set[str]]) -> list[Path]:
    """Set the finished or partial runs ``names`` aside (``runs/superseded/<run>.<time>``, kept, not read again) so
    they run anew, and take ``zoo`` (artifact -> its manifest's sha256) for the table's: how a table continues after
    a zoo artifact was rebuilt. ``runs``: every run of the table with the zoo artifacts it decodes with. Refused in one line when a run kept would still hold a drafter that changed (it must be redone too), or a name
    is not one of the table's runs. Returns where the runs went."""
    bad = [n for n in names if n not in runs]
    if bad:
        raise TableError(f"--redo {bad[0]!r} is not one of the table's runs: {', '.join(runs)}")
    f = out / RUN_FILE
    data = read_json(f, TableError)
    before = data.get("zoo") or {}
    changed = {a for a in set(before) | set(zoo) if before.get(a) != zoo.get(a)}
    kept = [r for r in runs if r not in names and (out / "runs" / r / "run.json").is_file()]
    stale = [(r, sorted(runs[r] & changed)) for r in kept]
    stale = [(r, a) for r, a in stale if a]
    if stale:
        raise TableError(f"cannot keep the run {stale[0][0]}: it decoded with the zoo's {', '.join(stale[0][1])} as it "
                         f"was before; redo it too (--redo {','.join([*names, *(r for r, _ in stale)])})")
    moved = []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name in names:
        src = out / "runs" / name
        if src.exists():
            dst = out / "runs" / "superseded" / f"{name}.{stamp}"
            dst.parent.mkdir(parents=True, exist_ok=True)
            src.replace(dst)
            moved.append(dst)
        data.get("commits", {}).pop(name, None)
    write_json(f, {**data, "zoo": zoo})
    return moved


def record_commit(out: Path, run: str) -> str | None:
    """The commit a run starts (or continues) at, kept in ``<out>/table_run.json``'s ``commits`` (a list per run:
    a run continued at another commit lists both)."""
    f = out / RUN_FILE
    data = read_json(f, TableError)
    commit = git_state().get("commit")
    seen = data.setdefault("commits", {}).setdefault(run, [])
    if commit not in seen:
        seen.append(commit)
        write_json(f, data)
    return commit


