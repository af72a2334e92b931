"""The results log (``results.jsonl``: one record per prompt per role per repeat, appended as produced) and the
rule that nothing non-finite is ever written: NaN/inf become null, JSON is written with ``allow_nan=False``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pardec.jsonl import append_jsonl, read_jsonl


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
        self.records = read_jsonl(self.path, repair=True)
        self._by_key = {(r["id"], r["role"], r.get("repeat", 0)): r for r in self.records}

    def done(self, doc_id: str, role: str, repeat: int) -> dict | None:
        return self._by_key.get((doc_id, role, repeat))

    def append(self, rec: dict) -> None:
        rec = finite(rec)
        append_jsonl(self.path, [rec])
        self.records.append(rec)
        self._by_key[(rec["id"], rec["role"], rec.get("repeat", 0))] = rec


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
    """Strict JSON (no NaN/Infinity tokens): non-finite floats become null."""
    path.write_text(json.dumps(finite(obj), indent=2, allow_nan=False))
