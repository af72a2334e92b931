"""The results log (``results.jsonl``: one record per prompt per role per repeat, appended as produced), the part
files of several ranks and their merge, and the rule that nothing non-finite is ever written: NaN/inf become null,
JSON is written with ``allow_nan=False``."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pardec.jsonl import append_jsonl, read_jsonl

RESULTS = "results.jsonl"


def part_path(run_dir: Path, rank: int, world: int) -> Path:
    """Where rank ``rank`` of ``world`` appends its records: ``results.jsonl`` itself for one process, else
    ``results.rank{rank}-of-{world}.jsonl`` (merged into ``results.jsonl`` by rank 0 at the end)."""
    return run_dir / (RESULTS if world == 1 else f"results.rank{rank}-of-{world}.jsonl")


def results_files(run_dir: Path) -> list[Path]:
    """The files of ``run_dir`` that hold records (merged or a rank's part), non-empty ones only."""
    files = [run_dir / RESULTS, *sorted(run_dir.glob("results.rank*-of-*.jsonl"))]
    return [p for p in files if p.is_file() and p.stat().st_size]


def check_new(run_dir: Path) -> None:
    """A run without ``resume=true`` starts only in a run dir that holds no records (merged, or any rank's part):
    else every rank refuses before anything is written."""
    held = results_files(run_dir)
    if held:
        raise FileExistsError(f"{held[0]} already holds results; pass resume=true to continue that run, or use a new "
                              f"hydra.run.dir")


def record_key(rec: dict) -> tuple:
    return rec["id"], rec["role"], rec.get("repeat", 0)


def merge_parts(run_dir: Path, world: int, order: Callable[[dict], Any]) -> list[dict]:
    """Every part file of a ``world``-rank run into ``results.jsonl``, written atomically (a temporary file renamed
    over it): one record per (id, role, repeat), the first written, sorted by ``order``; returns them. Idempotent:
    it reads only the part files, so merging again (a resumed run) writes the same file."""
    by_key: dict[tuple, dict] = {}
    for rank in range(world):  # a rank without documents never made its file
        for rec in read_jsonl(part_path(run_dir, rank, world), missing_ok=True, torn_ok=True):
            by_key.setdefault(record_key(rec), rec)
    records = sorted(by_key.values(), key=order)
    tmp = run_dir / f"{RESULTS}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(finite(rec), separators=(",", ":"), allow_nan=False) + "\n")
    tmp.replace(run_dir / RESULTS)
    return records


class ResultsLog:
    """Append-only JSONL of per-prompt records; repairs a line truncated by a kill; knows what is done.

    A record is done by (id, role, repeat) whatever it holds: a skipped or errored prompt (``skipped`` /
    ``error``) is not retried on resume (a NaN model would fail again forever); start a new run dir to retry."""

    def __init__(self, path: Path, resume: bool):
        self.path = path
        self.records: list[dict] = []
        self._by_key: dict[tuple, dict] = {}  # (id, role, repeat) -> record
        if path.exists() and path.stat().st_size:
            if not resume:
                raise FileExistsError(
                    f"{path} already holds results; pass resume=true to continue that run, or use a new hydra.run.dir"
                )
            self._load()

    def _load(self) -> None:
        self.records = read_jsonl(self.path, repair=True, torn_ok=True)
        self._by_key = {record_key(r): r for r in self.records}

    def done(self, doc_id: str, role: str, repeat: int) -> dict | None:
        return self._by_key.get((doc_id, role, repeat))

    def append(self, rec: dict) -> None:
        rec = finite(rec)
        append_jsonl(self.path, [rec])
        self.records.append(rec)
        self._by_key[record_key(rec)] = rec


def is_failed(rec: dict) -> bool:
    """A record that holds no generation to measure: skipped (too long) or errored (non-finite)."""
    return "skipped" in rec or "error" in rec


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def finite(obj: Any) -> Any:
    """``obj`` with every NaN/inf float (in nested dicts, lists, tuples) replaced by None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def non_finite(obj: Any, where: str = "") -> str | None:
    """Path of the first NaN/inf float in ``obj`` (e.g. ``nll`` or ``extras.fast_forward``), or None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "value"
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        if (hit := non_finite(v, f"{where}.{k}" if where else str(k))) is not None:
            return hit
    return None


def write_json(path: Path, obj: Any) -> None:
    """Strict JSON (no NaN/Infinity tokens): non-finite floats become null. Written to a temporary file renamed
    over ``path``: a reader (another rank checking ``run.json``) never sees half of it."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(finite(obj), indent=2, allow_nan=False))
    tmp.replace(path)
