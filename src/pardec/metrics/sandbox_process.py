"""The sandbox's process control: the pass-marker protocol served while a program runs, resource limits set between
fork and exec, waiting for a child without reaping it, killing its whole session, the tail of its output, and the
sweep of temporary directories left by runs whose process is gone."""

from __future__ import annotations

import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

TAIL_CHARS = 4000
TEMP_PREFIX = "pardec_sandbox_"  # + "<pid>_<random>": a run's temporary directory, swept when its pid is gone
_swept = False


def sweep_stale() -> None:
    """Remove the temporary directories of sandbox runs whose process is gone (a harness killed mid-run), once per
    process."""
    global _swept
    if _swept:
        return
    _swept = True
    for d in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*_*"):
        pid = d.name[len(TEMP_PREFIX):].split("_", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def wait_with_marker(proc: subprocess.Popen, ctl: int, timeout_s: float) -> tuple[bool, bool]:
    """Serve the pass-marker protocol until the program exits: (exited in time, the secret came back)."""
    secret = secrets.token_hex(16).encode()
    deadline, buf, sent, returned = time.monotonic() + timeout_s, b"", False, False
    open_ctl = True
    while True:
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        left = deadline - time.monotonic()
        if not exited and left <= 0:
            return False, returned
        if not open_ctl:
            if exited:
                return True, returned
            time.sleep(min(0.01, left))
            continue
        # once it exited, read what it wrote before exiting (no wait: an open write end left elsewhere is ignored)
        ready, _, _ = select.select([ctl], [], [], 0 if exited else min(0.02, left))
        chunk = os.read(ctl, 4096) if ready else b""
        if not chunk:
            if exited:
                return True, returned
            if ready:  # every writer closed it: only the exit is left to see
                open_ctl = False
            continue
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line == b"ready" and not sent:
                sent = True
                try:
                    proc.stdin.write(secret + b"\n")
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
            elif sent and line == b"returned " + secret:
                returned = True


def rlimits(limits: tuple[tuple[int, int], ...]):
    """A preexec_fn setting each (resource, value), capped at the current hard limit (soft = hard)."""

    def apply() -> None:  # runs in the child between fork and exec: only async-safe-ish C calls
        for which, value in limits:
            hard = resource.getrlimit(which)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (value, value))

    return apply


def wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until child ``pid`` exits, without reaping it (its zombie keeps the pid); False on timeout."""
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)
    return True


def kill_session(sid: int) -> None:
    """SIGKILL process group ``sid`` and every other process of session ``sid`` (Linux: via /proc)."""
    os.killpg(sid, signal.SIGKILL)  # the unreaped leader keeps the group alive, so this cannot fail
    proc = Path("/proc")
    for d in proc.iterdir() if (proc / "self" / "stat").exists() else ():
        if not d.name.isdigit() or int(d.name) == sid:
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()  # state ppid pgrp session ...
            if int(fields[3]) == sid:
                os.kill(int(d.name), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):  # that process ended while we looked
            continue


def tail(path: Path) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 4 * TAIL_CHARS))
        return f.read().decode("utf-8", errors="replace")[-TAIL_CHARS:]
