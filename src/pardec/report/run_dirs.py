"""Evaluation run directories read for a report: the run dirs an argument names (a glob, a run dir, a dir of run
dirs, a summary.json), each run's ``summary.json`` with its ``results.jsonl`` counts and accepted-length histogram,
a results log read line by line (a torn or malformed line is skipped with a :class:`ReportWarning`), a training
run's logged steps, and the runs or ``bench.also`` roles of given methods under benchmark dirs."""

from __future__ import annotations

import glob
import json
import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

SUMMARY = "summary.json"
RESULTS = "results.jsonl"


class ReportWarning(UserWarning):
    """A run or a results line that was skipped while building the report."""


def _run_dirs(path_or_glob: str) -> list[Path]:
    """Run dirs named by one argument: a glob, a run dir, a dir of run dirs, or a summary.json."""
    if glob.has_magic(path_or_glob):
        matches = sorted(glob.glob(path_or_glob))
        if not matches:
            raise FileNotFoundError(f"no paths match {path_or_glob!r}")
        paths = [Path(m) for m in matches]
    else:
        paths = [Path(path_or_glob)]
    dirs: list[Path] = []
    for path in paths:
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist")
        if path.is_file():
            if path.name != SUMMARY:
                warnings.warn(f"ignoring {path}: not a run dir or {SUMMARY}", ReportWarning, stacklevel=3)
                continue
            dirs.append(path.parent)
        elif (path / SUMMARY).is_file():
            dirs.append(path)
        else:
            found = sorted(p.parent for p in path.rglob(SUMMARY))
            if not found:
                raise FileNotFoundError(f"{path} holds no {SUMMARY} (not a finished evaluation run dir)")
            dirs.extend(found)
    return dirs


def read_results(path: Path) -> list[dict[str, Any]]:
    """Lines of a results.jsonl; an unparsable line (e.g. a run killed mid-write) is skipped with a warning."""
    lines = path.read_text(encoding="utf-8").splitlines()
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            where = "truncated last line" if i == len(lines) else f"malformed line {i}"
            warnings.warn(f"{path}: skipping {where}", ReportWarning, stacklevel=2)
    return records


def _histogram_from_results(records: Iterable[dict[str, Any]]) -> dict[int, int]:
    """Tokens committed per target forward -> count, over the method role's lines."""
    counts: Counter[int] = Counter()
    for rec in records:
        if rec.get("role") == "method" and "skipped" not in rec and "error" not in rec:
            counts.update(int(a) for a in rec.get("accepted") or [])
    return dict(counts)


def _load_run(run_dir: Path) -> dict[str, Any] | None:
    """One run: the summary's fields plus ``run_dir``, ``n_results``, ``n_skipped``; None if corrupt."""
    try:
        summary = json.loads((run_dir / SUMMARY).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        warnings.warn(f"skipping {run_dir}: corrupt {SUMMARY} ({err})", ReportWarning, stacklevel=2)
        return None
    if not isinstance(summary, dict) or not {"method", "dataset"} <= summary.keys():
        warnings.warn(f"skipping {run_dir}: {SUMMARY} lacks 'method'/'dataset'", ReportWarning, stacklevel=2)
        return None
    results = read_results(run_dir / RESULTS) if (run_dir / RESULTS).is_file() else []
    run = dict(summary, run_dir=str(run_dir))
    run["n_results"] = sum("skipped" not in r and "error" not in r for r in results)
    run["n_skipped"] = sum("skipped" in r for r in results)
    run["n_errors"] = sum("error" in r for r in results)
    hist = summary.get("accepted_histogram") or _histogram_from_results(results)
    run["accepted_histogram"] = {int(k): int(v) for k, v in hist.items()}
    return run


def load_runs(paths_or_globs: Sequence[str]) -> list[dict[str, Any]]:
    """Load every run under the given dirs/globs (deduplicated, in order).

    Raises FileNotFoundError for a path or glob that names no run; a corrupt summary.json is skipped
    with a :class:`ReportWarning`.
    """
    seen: dict[Path, None] = {}
    for arg in paths_or_globs:
        for d in _run_dirs(str(arg)):
            seen.setdefault(d.resolve(), None)
    runs = [run for d in seen if (run := _load_run(d)) is not None]
    if not runs:
        raise ValueError("no valid runs to report on")
    return runs


def log_history(run_dir: Path) -> list[dict]:
    """A training run's logged steps: ``<run>/log_history.json``, else the newest checkpoint's trainer state."""
    f = Path(run_dir) / "log_history.json"
    if f.is_file():
        return json.loads(f.read_text())
    states = sorted(Path(run_dir).glob("checkpoint-*/trainer_state.json"),
                    key=lambda p: int(p.parent.name.split("-")[1]))
    return json.loads(states[-1].read_text())["log_history"] if states else []


def method_entries(bench_dirs: Sequence[Path], methods: Iterable[str]) -> list[tuple[dict, str, dict, dict]]:
    """Every run (``summary.json`` under ``bench_dirs``) or ``bench.also`` role of one of ``methods``, as
    (the run's summary, method, its parameters, its entry: the summary itself or the role's peer entry)."""
    wanted = set(methods)
    out = []
    for d in bench_dirs:
        for f in sorted(Path(d).glob("**/summary.json")):
            s = json.loads(f.read_text())
            s["_dir"] = str(f.parent)
            entries = [(s["method"], s.get("method_params") or {}, s)]
            entries += [(p["method"], p.get("params") or {}, p) for p in (s.get("peers") or {}).values()]
            out += [(s, m, params, e) for m, params, e in entries if m in wanted]
    return out
