"""The Jacobi trajectory files: schema, resumable writer, merge across ranks, reader.

Layout of a collection directory (``collect.out_dir``)::

    meta.json           schema_version, the collection settings (block size, model, seed, ...)
    part-{rank}.jsonl   the work log of each rank, one record per prompt, appended and fsynced as produced
    trajectories.jsonl  the merged records of every rank, sorted by prompt index, dropped records left out
    stats.json          prompts, kept, dropped, blocks, mean iterations per block, tokens, complete

One record (``schema_version`` 2)::

    {"schema_version": 2, "id": "<doc id>", "index": 12,           # index: position in the prompt list
     "prompt_ids": [...], "answer_ids": [...],                      # answer: greedy answer up to EOS / limit
     "stop_reason": "eos" | "length",
     "blocks": [{"states": [[n ids], ...],                          # initial guess ... fixed point (augment:
                                                                    # in_place: all but the last two corrected)
                 "fixed_point": [n ids],                            # == states[-1]
                 "augmented": [[n ids], ...]}, ...],                # corrected copies (augment: copies only)
     "drop_reason": null | "repetition"}                            # part files only

Concatenated fixed points = greedy AR output (``answer_ids`` is its prefix up to the first EOS). The last
block may be shorter than the block size (the ``max_new_tokens`` limit), and may extend past the EOS.
"""

from __future__ import annotations

import logging
from pathlib import Path

from pardec.jsonl import read_json, read_jsonl, record_at
from pardec.training import stages
from pardec.training.stages import StageError

log = logging.getLogger(__name__)

#: 2: ``augmented`` holds the ``copies`` scheme's extra states; the ``in_place`` scheme (CLLM's, the default) corrects
#: ``states`` themselves, as version 1 did; meta.json's ``augment`` says which
SCHEMA_VERSION = 2
REQUIRED = ("schema_version", "id", "prompt_ids", "blocks", "answer_ids")
MERGED = "trajectories.jsonl"


class TrajectoryError(StageError):
    """A trajectory file is missing, malformed or of another schema version; the message names the file."""


def merge(out_dir: Path, expected: int) -> dict:
    """Merge every part file into ``trajectories.jsonl`` (sorted by index, dropped records left out) and
    write ``stats.json``; returns the stats. ``expected``: the number of prompts of the whole collection."""
    return stages.merge(out_dir, MERGED, expected, trajectory_stats, drop_key="drop_reason")


def trajectory_stats(records: list[dict], kept: list[dict], expected: int) -> dict:
    blocks = [b for r in kept for b in r["blocks"]]
    iters = [len(b["states"]) for b in blocks]  # forwards per block: one per state (the last confirms it)
    dropped: dict[str, int] = {}
    for r in records:
        if r.get("drop_reason"):
            dropped[r["drop_reason"]] = dropped.get(r["drop_reason"], 0) + 1
    return {
        "schema_version": SCHEMA_VERSION,
        "prompts": len(records),
        "expected_prompts": expected,
        "complete": len(records) >= expected,
        "kept": len(kept),
        "dropped": dropped,
        "blocks": len(blocks),
        "mean_iterations_per_block": sum(iters) / max(1, len(iters)),
        "tokens": sum(len(r["answer_ids"]) for r in kept),
        "eos_stops": sum(r.get("stop_reason") == "eos" for r in kept),
    }


def validate_record(rec: dict, where: str) -> None:
    """Raise :class:`TrajectoryError` naming ``where`` if ``rec`` does not follow schema 1."""
    missing = [k for k in REQUIRED if k not in rec]
    if missing:
        raise TrajectoryError(f"{where}: missing field(s) {missing}; a record needs {list(REQUIRED)}")
    if rec["schema_version"] != SCHEMA_VERSION:
        raise TrajectoryError(
            f"{where}: schema_version {rec['schema_version']!r}, but this pardec reads version {SCHEMA_VERSION}; "
            f"collect the trajectories again (stage=collect)"
        )
    for j, b in enumerate(rec["blocks"]):
        bad = [k for k in ("states", "fixed_point") if k not in b]
        if bad:
            raise TrajectoryError(f"{where}: block {j} is missing field(s) {bad}")
        if not b["states"] or b["states"][-1] != b["fixed_point"]:
            raise TrajectoryError(f"{where}: block {j}: the last state is not the fixed point")


def load_trajectories(path: str | Path) -> list[dict]:
    """Records of a merged trajectory file (or of ``<dir>/trajectories.jsonl``), validated."""
    p = Path(path)
    if p.is_dir():
        p = p / MERGED
    if not p.is_file():
        raise TrajectoryError(f"trajectory file {p} does not exist; run the collection first (stage=collect)")
    meta = p.parent / "meta.json"
    if meta.is_file():
        version = read_json(meta, TrajectoryError).get("schema_version")
        if version != SCHEMA_VERSION:
            raise TrajectoryError(f"{meta}: schema_version {version!r}, but this pardec reads {SCHEMA_VERSION}")
    records = read_jsonl(p, error=TrajectoryError, torn_ok=True)
    for i, r in enumerate(records):
        validate_record(r, record_at(records, i, p))
    return records
