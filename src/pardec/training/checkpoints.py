"""Checkpoints that a kill cannot leave looking complete, and the one ``trainer.resume_from_checkpoint`` resumes.

transformers (5.24) writes ``checkpoint-N`` in place (weights, optimizer, scheduler, RNG states, then
``trainer_state.json``; no temporary directory, no rename) and ``resume_from_checkpoint=true`` takes the
highest-numbered ``checkpoint-*`` whatever it holds, so a kill during a save left a resume that ends in a traceback
(``SafetensorError: ... invalid header length``). Here:

* :func:`begin_save` / :func:`end_save` (around ``Trainer._save_checkpoint``, see
  :class:`~pardec.training.base.BaseTrainer`): once every rank has finished its part of the save, rank 0 writes
  :data:`MARKER` (step, and every file's size) into the checkpoint atomically (a temporary file, fsync, rename);
  a save over an existing checkpoint first removes its marker;
* :func:`resume_checkpoint`: ``true`` -> the newest complete checkpoint of the run dir (newer incomplete ones are
  skipped with one warning naming them); ``<dir>`` -> that one if complete; else one line naming what is missing.
  Complete = the marker and its files at their sizes, or, for a checkpoint written without markers, a readable
  ``trainer_state.json``, every ``*.safetensors`` whole (its header parsed, the file as long as its tensors' data)
  and every torch pickle (``*.pt``, ``*.pth``) a whole zip archive.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import zipfile
from pathlib import Path

from pardec.config import ConfigError

log = logging.getLogger("pardec.train")

MARKER = "pardec-complete.json"
STATE = "trainer_state.json"  # transformers' TRAINER_STATE_NAME, written last by a save
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_MAX_HEADER = 100 * 2**20  # safetensors refuses headers above 100 MB


# ------------------------------------------------------------------------------------------- writing
def _checkpoint_dir(trainer, trial) -> Path:
    """Where ``Trainer._save_checkpoint`` writes this step's checkpoint."""
    return Path(trainer._get_output_dir(trial=trial)) / f"checkpoint-{trainer.state.global_step}"


def begin_save(trainer, trial=None) -> None:
    """Before a save: rank 0 removes the marker of a checkpoint about to be written over (a resumed run saving a
    step again), then every rank waits, so none writes a file while a stale marker still vouches for the dir."""
    if trainer.args.should_save:
        (_checkpoint_dir(trainer, trial) / MARKER).unlink(missing_ok=True)
    trainer.accelerator.wait_for_everyone()


def end_save(trainer, trial=None) -> None:
    """After every rank's part of the save: rank 0 marks the checkpoint complete (:func:`write_marker`)."""
    trainer.accelerator.wait_for_everyone()
    path = _checkpoint_dir(trainer, trial)
    if trainer.args.should_save and path.is_dir():  # a rotated-away checkpoint (save_total_limit) is not marked
        write_marker(path, trainer.state.global_step)


def _files(ckpt: Path) -> dict[str, int]:
    return {p.relative_to(ckpt).as_posix(): p.stat().st_size for p in sorted(ckpt.rglob("*"))
            if p.is_file() and p.name != MARKER and not p.name.startswith(f"{MARKER}.")}


def write_marker(ckpt: Path, step: int) -> None:
    """:data:`MARKER` in ``ckpt``: the step and the size of every file, written to a temporary file, flushed to
    disk and renamed into place (the directory synced too), so it exists only whole and only after the files."""
    tmp = ckpt / f"{MARKER}.tmp"
    with tmp.open("w", encoding="utf-8") as f:
        json.dump({"step": step, "files": _files(ckpt)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(ckpt / MARKER)
    fd = os.open(ckpt, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:  # a filesystem that cannot sync a directory
        pass
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- checking
def safetensors_problem(path: Path) -> str | None:
    """Why ``path`` is not a whole safetensors file (None when it is): the 8-byte header length, the JSON header and
    the file's length against the end of its tensors' data."""
    size = path.stat().st_size
    if size < 8:
        return f"{path.name} is truncated ({size} bytes)"
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > _MAX_HEADER or size < 8 + n:
            return f"{path.name} is truncated (header of {n} bytes, file of {size})"
        try:
            header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return f"{path.name} has an unreadable header"
    if size < 8 + n + end:
        return f"{path.name} is truncated ({size} of {8 + n + end} bytes)"
    return None


def problems(ckpt: Path) -> list[str]:
    """What ``ckpt`` lacks to be resumed from (empty: complete); see the module's docstring."""
    if not ckpt.is_dir():
        return [f"{ckpt} is not a directory"]
    marker = ckpt / MARKER
    if marker.is_file():
        try:
            files = json.loads(marker.read_text())["files"]
        except (ValueError, KeyError, TypeError):
            return [f"{MARKER} is unreadable"]
        out = []
        for name, size in files.items():
            p = ckpt / name
            if not p.is_file():
                out.append(f"{name} is missing")
            elif p.stat().st_size != size:
                out.append(f"{name} has {p.stat().st_size} of its {size} bytes")
        return out
    # no marker: a checkpoint saved before markers, or one whose save (or marking) was cut short
    out = []
    state = ckpt / STATE
    if not state.is_file():
        out.append(f"{STATE} is missing")
    else:
        try:
            json.loads(state.read_text())
        except ValueError:
            out.append(f"{STATE} is truncated")
    for p in sorted(ckpt.rglob("*.safetensors")):
        why = safetensors_problem(p)
        if why:
            out.append(why.replace(p.name, p.relative_to(ckpt).as_posix(), 1))
    for p in sorted([*ckpt.rglob("*.pt"), *ckpt.rglob("*.pth")]):
        if not zipfile.is_zipfile(p):
            out.append(f"{p.relative_to(ckpt).as_posix()} is truncated")
    return out


def checkpoints(run_dir: Path) -> list[Path]:
    """The ``checkpoint-<step>`` dirs of ``run_dir``, newest (highest step) first."""
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _CHECKPOINT.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def resume_checkpoint(resume: bool | str | None, run_dir: Path, warn: bool = True) -> str | None:
    """The checkpoint ``trainer.resume_from_checkpoint=<resume>`` resumes (None: train from the start), checked
    before anything loads: ``true`` -> the newest complete ``checkpoint-*`` of ``run_dir`` (newer incomplete ones
    are skipped, with one warning naming them when ``warn``); a path -> that checkpoint, if complete. Raises
    ConfigError (one line) when there is none, or the named one is incomplete."""
    key = "trainer.resume_from_checkpoint"
    if resume is None or resume is False:
        return None
    if resume is not True:
        ckpt = Path(str(resume))
        if not ckpt.is_dir():
            raise ConfigError(f"{key}={resume} is not a directory; pass a checkpoint-* dir of the run, or true for "
                              f"the newest complete one")
        missing = problems(ckpt)
        if missing:
            raise ConfigError(f"{key}={resume} is incomplete (its save was cut short?): {'; '.join(missing)}; pass "
                              f"an earlier checkpoint-* dir, or true for the newest complete one")
        return str(ckpt)
    skipped = []
    for ckpt in checkpoints(run_dir):
        missing = problems(ckpt)
        if not missing:
            if skipped and warn:
                log.warning("%s=true: skipping incomplete %s (a save cut short); resuming from %s", key,
                            "; ".join(skipped), ckpt.name)
            return str(ckpt)
        skipped.append(f"{ckpt.name} ({missing[0]})")
    what = f"only incomplete ones ({'; '.join(skipped)})" if skipped else "no checkpoint-* dir"
    raise ConfigError(f"{key}=true but the run dir {run_dir} holds {what}: rerun with the run_name of the run to "
                      f"resume (its dir: <paths.output_dir>/train/runs/<experiment>/<run_name>), or without "
                      f"{key} to train from the start (data generation resumes by itself)")
