"""Run untrusted, model-generated Python in a child process and report how it ended.

:func:`run_program` writes the program into a fresh temporary directory and runs it with
``python -I -B`` in a child process that leads its own session and process group. Layers:

- **Wall clock.** At ``timeout_s`` the whole process group is SIGKILLed, and so is any process still in
  the child's session (one that moved to another group with ``setpgid``). This kill also runs after
  *every* normal exit, so a background process left behind by a finished program dies too. The leader
  is reaped only after the kill: its zombie holds the pid, so the group/session id cannot be reused.
- **Resources** (``setrlimit`` in the child before ``exec``, soft = hard): address space ``memory_mb``
  (a memory bomb gets ``MemoryError``; the host keeps its memory), file size ``fsize_mb`` (stdout and
  stderr included), no core files, CPU time ``int(timeout_s) + 1`` s (a backstop should we die mid-run).
- **Files and environment.** The working directory, ``HOME`` and ``TMPDIR`` are the temporary directory,
  removed afterwards; stdout/stderr go to files beside it (a chatty program cannot fill our memory);
  the environment is a minimal fresh one (no tokens or proxies; one BLAS/OpenMP thread).
- **A Python-level guard** (:data:`_GUARD`), installed before the program runs, as an audit hook (PEP
  578: CPython raises the events from C, whichever alias is called -- ``os``, ``posix``, ``io``,
  ``pathlib``, ``shutil`` -- and an audit hook cannot be removed). A denied call raises
  ``PermissionError("sandbox: ...")``, so the program fails. Denied:

  - process creation and signals: ``os.fork/forkpty/system/exec*/spawn*/posix_spawn/kill/killpg``,
    ``subprocess`` (``Popen``, ``run``, ``os.popen``), hence ``multiprocessing`` and ``pty``;
    ``_posixsubprocess.fork_exec`` raises no audit event, so it is replaced and re-importing it refused;
  - every write outside the temporary directory (``/dev/null`` excepted): ``open``/``os.open`` with a
    write mode or flag, ``remove/unlink/rmdir/rename/replace/mkdir/truncate/utime/chmod/chown/*xattr``,
    ``shutil.rmtree``, ``sqlite3.connect``; paths are resolved through ``..``, symlinks and ``dir_fd``;
    creating hard or symbolic links (anywhere);
  - ``ctypes`` beyond ``import ctypes`` (numpy imports it): loading a library, looking up a symbol,
    ``from_address``; raising rlimits; ``socket.connect/bind/sendto/sendmsg``; ``gc.get_objects/
    get_referrers/get_referents`` (the easy way to reach the hook's state).

We run as root in CI, so ``RLIMIT_NPROC`` and file permissions protect nothing: the guard and the
group/session kill are what stop a program from spawning processes or touching the host's files.

NOT protected -- this is a reliability guard against careless or buggy generated code, not a security
boundary against code written to escape. For untrusted models, run the harness in a throwaway
container or VM that holds no credentials. In particular:

- Reads: the program can read every file this user can (the repository, ``~/.netrc``, and, as root,
  other processes' ``/proc/<pid>/environ``) and print it into its result.
- The network: only ``connect/bind/sendto/sendmsg`` are refused; there is no network namespace.
- C code that makes system calls itself (a compiled extension of an installed package) is not audited,
  nor are ``os.mkfifo``/``os.mknod``, nor ``ctypes.memmove``/``memset`` on raw addresses.
- Deliberate tampering with the interpreter (tracing the hook's frame, crafted bytecode, memory
  corruption) can disable the guard; a child it then creates with ``setsid`` escapes the kill.
- A race between the hook's path check and the system call, played from a second thread.
- If this process is SIGKILLed mid-run, a sleeping child survives (a spinning one dies at the CPU limit).
"""

from __future__ import annotations

import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

TAIL_CHARS = 4000

# Runs in the child before the program (as ``python -c``); see the module docstring for what it denies.
_GUARD = r'''
def _pardec_guard():
    import os, sys, types, _posixsubprocess
    # all state is immutable: a traceback of a denial exposes it through the hook's frame
    root = os.path.realpath(os.getcwd())
    denied = frozenset((
        "os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "subprocess.Popen",
        "os.kill", "os.killpg", "signal.pthread_kill", "os.link", "os.symlink",
        "ctypes.dlsym", "ctypes.dlsym/handle", "ctypes.cdata", "resource.setrlimit", "resource.prlimit",
        "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents",
    ))
    denied_imports = frozenset(("_posixsubprocess",))
    # event -> ((index of a path argument, index of its dir_fd argument or None), ...)
    path_args = types.MappingProxyType({
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
        "os.truncate": ((0, None),), "os.utime": ((0, 3),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
        "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "shutil.rmtree": ((0, 1),),
        "sqlite3.connect": ((0, None),),
    })
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def deny(what):
        raise PermissionError(f"sandbox: {what} is not allowed")

    def check_path(event, path, dir_fd):
        if isinstance(path, int):  # an already-open file descriptor: its opening was checked
            return
        path = os.fsdecode(os.fspath(path))
        base = os.readlink(f"/proc/self/fd/{dir_fd}") if isinstance(dir_fd, int) and dir_fd >= 0 else os.getcwd()
        real = os.path.realpath(os.path.join(base, path))
        if real != root and not real.startswith(root + os.sep) and real != os.devnull:
            deny(f"{event} {path!r} (outside the sandbox directory)")

    def hook(event, args):
        if event in denied:
            deny(event)
        elif event == "import" and args[0] in denied_imports:
            deny(f"import {args[0]}")
        elif event == "ctypes.dlopen" and args[0] is not None:  # CDLL(None), done by `import ctypes`, is fine
            deny(f"ctypes.dlopen({args[0]!r})")
        elif event == "open" and (set(args[1] or "") & set("wax+") or (args[2] or 0) & write_flags):
            check_path("writing to", args[0], None)
        elif event in path_args:
            for i, j in path_args[event]:
                check_path(event, args[i], None if j is None else args[j])

    def fork_exec(*args, **kwargs):
        deny("_posixsubprocess.fork_exec (process creation)")

    _posixsubprocess.fork_exec = fork_exec
    sys.addaudithook(hook)


_pardec_guard()
del _pardec_guard
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
exec(_code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
'''


@dataclass
class SandboxResult:
    status: str  # passed (exit 0) | failed (non-zero exit: exception, assert, sandbox denial) | timeout | error
    returncode: int  # negative = killed by that signal (-9 after a timeout)
    stdout: str  # the last TAIL_CHARS characters
    stderr: str
    wall_s: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(code: str, timeout_s: float = 10.0, memory_mb: int = 1024, fsize_mb: int = 32) -> SandboxResult:
    """Run ``code`` as ``__main__`` under the guard in a child process; never in this process.

    ``status`` is "passed" if it exits with 0 within ``timeout_s`` seconds, "failed" on a non-zero exit
    (an uncaught exception, including SyntaxError, MemoryError and the guard's PermissionError),
    "timeout" if the wall clock ran out, "error" if it was killed by a signal (crash, CPU limit).
    """
    argv = [sys.executable, "-I", "-B", "-c", _GUARD]
    return run_command(argv, timeout_s, memory_mb, fsize_mb, files={"main.py": code})


def run_command(argv: list[str], timeout_s: float = 10.0, memory_mb: int = 1024, fsize_mb: int = 32,
                files: dict[str, str] | None = None) -> SandboxResult:
    """Run ``argv`` with every protection of :func:`run_program` except the Python guard.

    ``files`` (name -> text) are written into the fresh working directory first. Only for commands that
    are trusted not to spawn or write elsewhere on purpose (the process-group kill still applies).
    """
    if timeout_s <= 0 or memory_mb <= 0 or fsize_mb <= 0:
        raise ValueError(f"timeout_s={timeout_s}, memory_mb={memory_mb}, fsize_mb={fsize_mb} must all be > 0")
    top = Path(tempfile.mkdtemp(prefix="pardec_sandbox_"))
    work = top / "work"
    work.mkdir()
    for name, text in (files or {}).items():
        (work / name).write_text(text, encoding="utf-8")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    limits = ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, fsize_mb << 20),
              (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, int(timeout_s) + 1))
    try:
        with open(top / "stdout", "wb") as out, open(top / "stderr", "wb") as err:
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    close_fds=True, start_new_session=True, preexec_fn=_rlimits(limits))
        timed_out = not _wait_unreaped(proc.pid, timeout_s)
        _kill_session(proc.pid)
        proc.wait()
        wall = time.perf_counter() - t0
        rc = proc.returncode
        status = "timeout" if timed_out else "passed" if rc == 0 else "failed" if rc > 0 else "error"
        return SandboxResult(status, rc, _tail(top / "stdout"), _tail(top / "stderr"), wall)
    finally:
        shutil.rmtree(top, ignore_errors=True)
        if top.exists():  # e.g. the program made a directory unwritable (cannot happen as root)
            warnings.warn(f"sandbox: could not remove its temporary directory {top}", stacklevel=2)


def _rlimits(limits: tuple[tuple[int, int], ...]):
    """A preexec_fn setting each (resource, value), capped at the current hard limit (soft = hard)."""

    def apply() -> None:  # runs in the child between fork and exec: only async-safe-ish C calls
        for which, value in limits:
            hard = resource.getrlimit(which)[1]
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (value, value))

    return apply


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Wait until child ``pid`` exits, without reaping it (its zombie keeps the pid); False on timeout."""
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)
    return True


def _kill_session(sid: int) -> None:
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


def _tail(path: Path) -> str:
    with path.open("rb") as f:
        f.seek(max(0, path.stat().st_size - 4 * TAIL_CHARS))
        return f.read().decode("utf-8", errors="replace")[-TAIL_CHARS:]
