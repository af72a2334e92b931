"""The resumable, shardable data-generation stage, written once and used by every kind (Jacobi trajectories, the
target's own completions, the SDSAT masked corpus): a directory with ``meta.json``, one append-only
``part-{rank}.jsonl`` per rank, and a merged file (plus ``stats.json``) written atomically by rank 0.

* :class:`Prompt` (index, id, ids): one unit of work; :func:`dataset_prompts`: a task's documents as prompts;
* :func:`part_path`, :func:`read_part`, :func:`done_ids`: the part files (a line cut by a kill is repaired);

* :func:`prepare_out_dir`: create the directory with ``meta.json``; a directory written with other settings is
  refused before anything is written (or, on rank 0 with ``overwrite``, wiped), so a resumed run never mixes
  records of two settings; :func:`check_settings` is that check alone (e.g. before a model loads).
* :func:`run_shard`: rank r of w takes the prompts with index % w == r that no part file holds yet, runs them in
  batches (or as a stream that refills its batch as prompts finish) and appends each record (fsynced) as soon as
  it exists: a kill loses only the prompts in flight.
* :func:`write_merged`: the merged JSONL, written to a temporary file and renamed;
* :func:`run_stage`: the three together under several ranks (prepare, barrier, this rank's share, barrier, merge,
  barrier): when it returns on any rank, the merged file is complete, so every rank may read it;
* :func:`merge`: every part file into the merged file (one record per id, sorted by index) and ``stats.json``.
"""

from __future__ import annotations

import itertools
import json
import logging
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from pardec.config import DatasetConfig, settings_diff
from pardec.jsonl import append_jsonl, read_json, read_jsonl, record_at, write_jsonl
from pardec.tasks.base import build_task, select_docs

log = logging.getLogger(__name__)


class StageError(ValueError):
    """A stage's file is missing, malformed or of another schema version; the message names the file."""


@dataclass
class Prompt:
    index: int  # position in the stage's work list: sharding key and sort key
    id: str
    ids: list[int]


def dataset_prompts(cfg: DatasetConfig, tokenizer, model_chat: bool, max_prompts: int | None,
                    prefix: str = "") -> list[tuple[str, list[int]]]:
    """The first ``max_prompts`` documents of a registered task as ``(prefix + doc id, prompt ids)``, built as the
    task builds them for evaluation (the chat template when ``cfg.use_chat(model_chat)``)."""
    task = build_task(cfg)
    chat = cfg.use_chat(model_chat)
    return [(f"{prefix}{d['id']}", list(task.prompt_ids(d, tokenizer, chat))) for d in select_docs(task, max_prompts)]


# ------------------------------------------------------------------------------------------- part files
def part_path(out_dir: Path, rank: int) -> Path:
    return out_dir / f"part-{rank}.jsonl"


def read_part(path: Path, repair: bool = False) -> list[dict]:
    """Records of a work log (none if it does not exist yet); a last line cut by a kill is ignored, and with
    ``repair`` (the file's own writer, before appending) cut off the file."""
    return read_jsonl(path, error=StageError, repair=repair, missing_ok=True, torn_ok=True)


def done_ids(out_dir: Path, rank: int) -> set[str]:
    """Ids already written by any rank (whatever the world size of earlier runs); repairs ``rank``'s own file
    (other ranks may be appending to theirs)."""
    mine = part_path(out_dir, rank)
    return {r["id"] for p in sorted(out_dir.glob("part-*.jsonl")) for r in read_part(p, repair=p == mine)}


def merge(out_dir: str | Path, merged: str, expected: int, stats: Callable[[list[dict], list[dict], int], dict],
          drop_key: str | None = None, index_of: dict[str, int] | None = None) -> dict:
    """Merge every part file of ``out_dir`` into ``merged`` (one record per id, the first written; sorted by index;
    with ``drop_key``, records where it is set are left out and the key is removed) and write ``stats.json`` =
    ``stats(all records, kept records, expected)``; returns the stats. ``expected``: the stage's work-list size;
    ``index_of``: the current index of each id (records written under an older, shorter work list are
    renumbered)."""
    out = Path(out_dir)
    by_id: dict[str, dict] = {}
    for p in sorted(out.glob("part-*.jsonl")):
        for r in read_part(p):
            if r["id"] not in by_id and index_of and r["id"] in index_of:
                r["index"] = index_of[r["id"]]
            by_id.setdefault(r["id"], r)
    records = sorted(by_id.values(), key=lambda r: r.get("index", 0))
    kept = records if drop_key is None else [{k: v for k, v in r.items() if k != drop_key} for r in records
                                             if not r.get(drop_key)]
    write_merged(out / merged, kept)
    result = stats(records, kept, expected)
    (out / "stats.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def check_settings(out_dir: str | Path, meta: dict, overwrite: bool, key: str, what: str,
                   ignore: tuple[str, ...] = (), grows: Callable[[dict, dict], bool] | None = None) -> list[str]:
    """How the settings in ``out_dir/meta.json`` differ from ``meta`` (top-level keys in ``ignore`` left out), as
    ``model.seed was 0, now 1`` items; raises (one line, writing nothing) when they differ and not ``overwrite``.
    ``grows(old, new)``: settings that only extend the old ones (a stage whose work list may grow) pass as equal.
    ``key`` names the config section in the error, ``what`` the data."""
    meta_file = Path(out_dir) / "meta.json"
    if not meta_file.is_file():
        return []
    old = {k: v for k, v in read_json(meta_file, StageError).items() if k not in ignore}
    new = {k: v for k, v in meta.items() if k not in ignore}
    if grows is not None and grows(old, new):
        return []
    diff = settings_diff(old, json.loads(json.dumps(new)))
    if diff and not overwrite:
        raise FileExistsError(f"{out_dir} holds {what} with other settings ({'; '.join(diff)}); pass "
                              f"{key}.overwrite=true to replace them, or use another {key}.out_dir")
    return diff


def prepare_out_dir(out_dir: str | Path, overwrite: bool, meta: dict, rank: int, key: str, what: str,
                    grows: Callable[[dict, dict], bool] | None = None, stale: tuple[str, ...] = ()) -> Path:
    """Create ``out_dir`` with ``meta.json``; an existing one from other settings raises before anything is
    written (rank 0 with ``overwrite``: the directory is wiped). Settings that only ``grows(old, new)`` the old
    ones are accepted: rank 0 rewrites ``meta.json`` and removes the ``stale`` files (merged output, stats) until
    the grown stage merges again; the part files are kept. ``key`` names the config section in the error,
    ``what`` the data."""
    out = Path(out_dir)
    meta_file = out / "meta.json"
    if rank == 0 and grows is not None and meta_file.is_file():
        old = read_json(meta_file, StageError)
        if grows(old, meta):
            log.info("%s in %s grow: %s", what, out, "; ".join(settings_diff(old, json.loads(json.dumps(meta)))))
            for name in stale:
                (out / name).unlink(missing_ok=True)
            tmp = out / "meta.json.tmp"
            tmp.write_text(json.dumps(meta, indent=2) + "\n")
            tmp.replace(meta_file)
    diff = check_settings(out, meta, overwrite and rank == 0, key, what)
    if diff:
        log.warning("%s.overwrite=true: removing %s (settings differ: %s)", key, out, "; ".join(diff))
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    if not meta_file.is_file():
        tmp = out / f"meta.json.tmp{rank}"
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.replace(meta_file)
    return out


def run_shard(prompts: Sequence[Any], out: Path, rank: int, world: int, batch_size: int,
              work: Callable[[list[Any]], list[dict]] | None, desc: str, stop_after: int | None = None,
              order: Callable[[Any], Any] | None = None,
              stream: Callable[[Iterator[Any]], Iterator[dict]] | None = None) -> bool:
    """Run this rank's prompts (objects with ``index`` and ``id``) not yet in any part file, appending each record to
    ``part-{rank}.jsonl`` (fsynced) as soon as it exists: ``work(batch) -> records`` over batches of
    ``batch_size``, or ``stream(prompts) -> records``, which pulls prompts when it has room (continuous
    batching) and yields each record when its prompt is done, in any order. ``order``: sort key of the todo list
    (e.g. prompt length, so batches pad little). ``stop_after``: write at most that many records and return
    False (a simulated kill in tests); True when this rank's share is done."""
    seen = done_ids(out, rank)
    todo = [p for p in prompts if p.index % world == rank and p.id not in seen]
    if order is not None:
        todo.sort(key=order)
    if stream is None:
        def stream(items: Iterator[Any]) -> Iterator[dict]:
            while batch := list(itertools.islice(items, batch_size)):
                yield from work(batch)
    written = 0
    records = stream(iter(todo))
    bar = tqdm(total=len(todo), desc=desc, position=rank, dynamic_ncols=True)
    try:
        for record in records:
            if stop_after is not None and written >= stop_after:
                return False
            append_jsonl(part_path(out, rank), [record])
            written += 1
            bar.update(1)
        return True
    finally:
        getattr(records, "close", lambda: None)()
        bar.close()


def run_stage(items: Sequence[Any], out_dir: str | Path, prepare: Callable[[int], Path], rank: int, world: int,
              barrier: Callable[[], None] | None, batch_size: int, work: Callable[[list[Any]], list[dict]] | None,
              desc: str, stop_after: int | None, merge: Callable[[Path, int], dict],
              order: Callable[[Any], Any] | None = None,
              stream: Callable[[Iterator[Any]], Iterator[dict]] | None = None) -> dict | None:
    """One data-generation stage over ranks: rank 0 runs ``prepare(rank)`` (create or wipe ``out_dir``, write
    meta.json) before the others check it, every rank runs its share (:func:`run_shard`), and once all are done
    rank 0 returns ``merge(out_dir, len(items))``; other ranks, and a run stopped by ``stop_after``, return None.
    Every rank returns only after rank 0's merge, so each may read the merged file at once (the one barrier for
    this, for every kind)."""
    if rank == 0:
        prepare(rank)
    if barrier:
        barrier()  # rank 0 created (or wiped) the directory and wrote meta.json
    out = prepare(rank) if rank else Path(out_dir)  # other ranks: check meta.json
    if not run_shard(items, out, rank, world, batch_size, work, desc, stop_after, order, stream):
        return None
    if barrier:
        barrier()  # every rank's share is in its part file
    try:
        return merge(out, len(items)) if rank == 0 else None
    finally:
        if barrier:
            barrier()  # rank 0 has merged (or failed to: the others then find no merged file and say so)


def check_records(records: list[dict], path: Path, required: tuple[str, ...], version: int, hint: str) -> None:
    """Every record of the merged file ``path`` has the ``required`` fields and schema ``version``; else one line
    naming the file and line (``hint``: how to make the file again)."""
    for i, r in enumerate(records):
        missing = [k for k in required if k not in r]
        if missing:
            raise ValueError(f"{record_at(records, i, path)}: missing field(s) {missing}; a record needs {list(required)}")
        if r["schema_version"] != version:
            raise ValueError(version_error(record_at(records, i, path), r["schema_version"], version, hint))


def version_error(where: str, found: Any, version: int, hint: str) -> str:
    return f"{where}: schema_version {found!r}, this pardec reads {version}; {hint}"


def write_merged(path: Path, records: list[dict]) -> None:
    """``records`` as JSONL at ``path``, atomically (:func:`pardec.jsonl.write_jsonl`)."""
    write_jsonl(path, records)
