"""Kept corpora: the target's completions a zoo recipe trains on, kept in the repository beside its artifacts
(``zoo/<zoo>/corpora/<corpus>/<split>/``) for an entry with ``keep_corpus: true``, so that a corpus that takes longer
to write than one sitting on the machine allows is written over several builds instead of from nothing each time.

A kept corpus is the generation's ``meta.json`` (model identity and dtype, sources, token limit: what a resumed
generation must match; the repository's own path in it written :data:`HERE`), ``records.jsonl.gz`` (every complete
record so far, as the generation wrote them) and ``kept.json`` (the count and the sha256 of the records file).
:func:`keep` packs the run's ``completions.out_dir`` (after the generate stage, or mid-generation: ``python -m
pardec.zoo keep-corpus <name>``); :func:`restore`, before the generate stage, writes the kept records back as their
own work log (``part-zoo.jsonl``), which the generation counts as done and the merge reads like any other rank's: the
rest is generated, nothing twice.
"""

from __future__ import annotations

import gzip
import json
import shutil
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pardec import REPO_ROOT, zoo
from pardec.jsonl import read_json, read_jsonl, write_jsonl

KEPT_PART = "part-zoo.jsonl"  # the restored records' work log in the out_dir (matches the stage's part-*.jsonl)
RECORDS, META, KEPT = "records.jsonl.gz", "meta.json", "kept.json"
HERE = "<repository>"  # the repository's path in a kept meta.json (datasets under data/): any checkout restores it


def portable(meta_text: str) -> str:
    return meta_text.replace(str(REPO_ROOT), HERE)


def local(meta_text: str) -> str:
    return meta_text.replace(HERE, str(REPO_ROOT))


def out_dir_of(entry) -> Path:
    """The entry's ``completions.out_dir`` as its generate stage resolves it (paths under the repository)."""
    cfg = zoo.composed(entry)
    OmegaConf.update(cfg, "paths.root_dir", str(REPO_ROOT), force_add=True)
    OmegaConf.update(cfg, "experiment_name", entry.experiment, force_add=True)  # Hydra's runtime choice, outside it
    return Path(cfg.completions.out_dir)


def kept_dir(entry, out_dir: Path) -> Path:
    """Where ``out_dir``'s corpus is kept: ``zoo/<zoo>/corpora/<its parent's name>/<its name>``."""
    return zoo.ZOO_DIR / entry.zoo / "corpora" / out_dir.parent.name / out_dir.name


def records_of(out_dir: Path) -> list[dict]:
    """Every complete record of ``out_dir``'s work logs, once per id (the first written), by prompt index."""
    by_id: dict[str, dict] = {}
    for p in sorted(out_dir.glob("part-*.jsonl")):
        for r in read_jsonl(p, error=zoo.ZooError, missing_ok=True, torn_ok=True):  # a line cut by a kill: left out
            by_id.setdefault(r["id"], r)
    return sorted(by_id.values(), key=lambda r: r.get("index", 0))


def keep(out_dir: Path, dest: Path, log=print) -> dict[str, Any] | None:
    """Pack ``out_dir``'s records and meta into ``dest`` (replaced in one rename); None when it holds none."""
    meta = out_dir / META
    records = records_of(out_dir) if meta.is_file() else []
    if not records:
        log(f"[zoo] no completions in {out_dir} to keep")
        return None
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / META).write_text(portable(meta.read_text()))
    with gzip.open(tmp / RECORDS, "wt", encoding="utf-8", compresslevel=9) as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n")
    info = {"records": len(records), "sha256": zoo.sha256_file(tmp / RECORDS),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    (tmp / KEPT).write_text(json.dumps(info, indent=2) + "\n")
    old = dest.with_name(f".{dest.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
    log(f"[zoo] kept {len(records)} completions of {out_dir} in {dest} ({(dest / RECORDS).stat().st_size / 1e6:.1f} MB)")
    return info


def restore(src: Path, out_dir: Path, log=print) -> int:
    """Write the kept corpus at ``src`` into ``out_dir`` as the work log ``part-zoo.jsonl``; returns how many records
    it adds. Nothing is kept at ``src``: 0. An ``out_dir`` generated with other settings is left as it is (the
    generation then refuses or grows it, as it would anyway); a kept file that does not match ``kept.json`` is
    refused."""
    if not (src / KEPT).is_file():
        return 0
    info = read_json(src / KEPT)
    if zoo.sha256_file(src / RECORDS) != info["sha256"]:
        raise zoo.ZooError(f"the kept corpus {src} does not match its {KEPT} (sha256 of {RECORDS}); restore it "
                           f"with `git checkout -- {src}` or delete it to generate the corpus again")
    meta = local((src / META).read_text())
    if (out_dir / META).is_file() and read_json(out_dir / META) != json.loads(meta):
        log(f"[zoo] {out_dir} was generated with other settings than the corpus kept in {src}: not restored")
        return 0
    have = {r["id"] for r in records_of(out_dir)} if out_dir.is_dir() else set()
    with gzip.open(src / RECORDS, "rt", encoding="utf-8") as f:
        kept = [json.loads(line) for line in f]
    added = len({r["id"] for r in kept} - have)
    if not added:
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (out_dir / META).is_file():
        (out_dir / META).write_text(meta)
    write_jsonl(out_dir / KEPT_PART, kept)  # atomic: a kill leaves the old log or the new one
    log(f"[zoo] restored {added} completions into {out_dir} from {src}")
    return added
