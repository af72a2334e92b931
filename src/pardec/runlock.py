"""One writer per run dir, and ranks that die with their launcher.

:func:`run_dir_lock` is held by every process that writes a run dir (evaluate, every training stage; each rank
its own lock file: ``.lock`` for rank 0, ``.lock-rank<r>`` for the others, so the ranks of a second launch meet the
first launch's ranks). It is an advisory ``flock`` on that file, taken before the run writes its records: a second
writer stops in one line naming the dir and the owner (pid, host, start time, command) that the file holds. The
kernel releases the lock when its owner dies, however it dies, so a lock left by a killed run is taken over, with
one warning naming the dead owner. Hydra's own ``.hydra/`` files and job log are written before the app runs, and so
before the lock.

:func:`die_with_parent` asks the kernel to kill this process when its parent dies (Linux ``PR_SET_PDEATHSIG``):
a rank whose ``torchrun`` was killed with ``-9`` writes nothing more.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import os
import signal
import socket
import sys
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

from pardec.config import ConfigError

log = logging.getLogger(__name__)


class RunDirBusy(ConfigError):
    """Another live process holds the run dir's lock."""


def lock_path(run_dir: Path, rank: int = 0) -> Path:
    return Path(run_dir) / (".lock" if rank == 0 else f".lock-rank{rank}")


def _owner() -> str:
    cmd = " ".join(Path(sys.argv[0]).name if i == 0 else a for i, a in enumerate(sys.argv))
    when = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return f"pid {os.getpid()} on {socket.gethostname()} since {when}: {cmd[:200]}"


@contextlib.contextmanager
def run_dir_lock(run_dir: Path, rank: int = 0) -> Iterator[Path]:
    """Hold ``run_dir``'s lock for ``rank`` while the body runs (module docstring); :class:`RunDirBusy` in one line
    when another live process holds it. Yields the lock file's path. A clean exit removes the lock file (and the
    directories it made for it, where nothing else was written)."""
    run_dir = Path(run_dir)
    path = lock_path(run_dir, rank)
    made = [d for d in (run_dir, *run_dir.parents) if not d.exists()]  # the dirs the lock creates, deepest first
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot create the run dir {run_dir}: {e.strerror or e}") from None
    fd = _acquire(run_dir, path)
    try:
        left = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        if left:
            log.warning("run dir %s: took over the lock left by a run that no longer runs (%s)", run_dir, left)
        os.ftruncate(fd, 0)
        os.pwrite(fd, (_owner() + "\n").encode(), 0)
        yield path
    finally:
        with contextlib.suppress(OSError):
            path.unlink()  # before the unlock: a later locker checks that the file it holds is still the path's
        os.close(fd)
        for d in made:  # what the lock made and nothing else wrote into goes again
            try:
                d.rmdir()
            except OSError:
                break


def _acquire(run_dir: Path, path: Path) -> int:
    """An open, exclusively locked descriptor of ``path``, the file at ``path`` now (a holder that released it
    removed it: retried on the new one)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise ConfigError(f"cannot write the run dir {run_dir}: {e.strerror or e} (creating its lock file "
                              f"{path.name})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "owner unknown"
            os.close(fd)
            raise RunDirBusy(f"run dir {run_dir} is being written by another run ({owner}); two writers would "
                             f"duplicate its records: wait for that run to end, or stop it, and resume") from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent (the launcher) dies; True where it could be
    asked (Linux). Exits at once when the parent is already gone (re-parented to init)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(sig), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), sig)
    return True
