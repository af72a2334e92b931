"""Run untrusted, model-generated Python in an isolated child process and report how it ended.

Layers, outermost first (:func:`isolation` names the ones that ran; evaluate writes it to summary.json):

1. **Linux namespaces via bubblewrap** (``bwrap``, from the OS package ``bubblewrap``; ``make setup``
   installs it when it can). Fresh user, PID, network, mount, IPC, UTS and cgroup namespaces: the program
   sees only its own processes (the harness and every other process are invisible, so they cannot be
   signalled), has no network at all (only a loopback that is down), runs as the host's ``nobody`` with no
   capabilities and in its own session (no terminal injection). Its filesystem is a private root
   (:mod:`pardec.metrics.sandbox_root`): the OS's programs and libraries and the interpreter read-only, its
   own temporary working directory writable, an empty ``/tmp``, a fresh ``/dev`` and ``/proc``, and nothing else
   of the host (no ``/etc``, home directories, projects or checkouts). When bwrap's process dies the kernel
   kills every process in the PID namespace; ``--die-with-parent`` ties bwrap to the harness, so even a
   SIGKILLed harness leaves no process (its temporary directory, named after its pid, is swept by the next run).
2. **seccomp** (installed by the program's own prelude with ``prctl``, before any untrusted code; x86-64
   and arm64). No new processes at all (``fork``, ``vfork``, ``clone`` without ``CLONE_THREAD``: threads
   are fine) and no ``execve``: together with the PID namespace this is the process-count limit (as root
   ``RLIMIT_NPROC`` is not enforced, so it is not what protects us). Also denied: ``ptrace`` and
   ``process_vm_*``, namespace and mount calls, ``pidfd_*``, ``bpf``, ``perf_event_open``, ``io_uring``,
   ``userfaultfd``, keyrings, module/kexec/reboot/clock/swap calls. Denied calls fail with ``EPERM``.
3. **rlimits** (soft = hard, set before ``exec``): address space ``memory_mb`` (a memory bomb gets
   ``MemoryError``), file size ``fsize_mb`` (stdout and stderr included), no core files, CPU time
   ``int(timeout_s) + 1`` s.
4. **Wall clock**: at ``timeout_s`` the session and process group are SIGKILLed (with bwrap: the whole
   PID namespace goes with them). That kill also runs after every normal exit.
5. **The audit-hook guard** (:data:`pardec.metrics.sandbox_child.GUARD`, PEP 578) as an extra, in-process layer: it refuses process
   creation, writes outside the temporary directory, ``ctypes`` library loading, sockets, ``gc``
   introspection, with a ``PermissionError("sandbox: ...")`` that makes the program fail. On its own it
   is *not* a security boundary (tampering with the interpreter defeats it); with the layers above it only
   turns a denial into a readable error.

Without bubblewrap (not installed, or user namespaces disabled), layers 2-5 still run and a loud warning
says so once; :func:`isolation` then returns ``"seccomp+guard (no namespaces: <why>)"`` and the program
can read every file the harness can, and (the guard bypassed) write them and signal the harness.
``PARDEC_SANDBOX=guard`` forces that mode (tests use it); ``PARDEC_SANDBOX=bwrap`` makes a missing bwrap
an error instead of a warning.

**Canary** (:func:`canary`, :func:`check_programs`; :func:`pardec.metrics.sql.check_sandbox` for SQL): before a
scorer uses the sandbox, a known-good program must pass and a known-bad one must fail through the very path the
scorer uses, once per process and configuration. If not, :class:`SandboxError` says why in one line: a sandbox that
cannot run anything would otherwise score every completion 0, silently.

**Pass marker** (:func:`run_program` with ``then=``): the module code runs first; the harness sends a fresh
random secret on stdin only after the program has reported (on a private pipe) that the module code
finished with no other thread alive; the program then evaluates ``then`` (e.g. ``check(candidate)``) and
echoes the secret on that pipe only after it returned. ``passed`` requires that echo, so exiting early with
status 0 by any route (``sys.exit``, ``os._exit``, ``atexit``, a daemon thread, a tracer) is a failure.
What it cannot stop is code written against this protocol (reading the secret out of the runner's frame
during the check), or tests that a crafted object passes (an ``__eq__`` that is always true): HumanEval's
tests compare with ``==``, so such a completion passes. That is a limit of HumanEval, not special-cased. The
protocol's harness side, the limits, the kill and the sweep of stale directories are
:mod:`pardec.metrics.sandbox_process`.
"""

from __future__ import annotations

import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

from pardec.metrics.sandbox_child import GUARD, RUN
from pardec.metrics.sandbox_process import (
    TEMP_PREFIX,
    kill_session,
    rlimits,
    sweep_stale,
    tail,
    wait_unreaped,
    wait_with_marker,
)
from pardec.metrics.sandbox_root import NOBODY, root_args, user_namespace
from pardec.metrics.sandbox_seccomp import seccomp_filter, seccomp_prelude

__all__ = ["seccomp_filter", "seccomp_prelude"]  # layer 2, re-exported: the sandbox's interface

_CTL_ENV = "PARDEC_SANDBOX_FD"

@dataclass
class SandboxResult:
    status: str  # passed | failed (non-zero exit, or no pass marker) | timeout | error (killed by a signal)
    returncode: int  # negative = killed by that signal (-9 after a timeout)
    stdout: str  # the last TAIL_CHARS characters
    stderr: str
    wall_s: float
    isolation: str = ""  # what isolated it: see isolation()
    files: dict[str, bytes] = field(default_factory=dict)  # run_command's read_back

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class SandboxError(RuntimeError):
    """The sandbox cannot tell a good program from a bad one here (the canary failed): scoring would be wrong, so the
    run stops. The message is one line naming the cause."""


#: the canary: ``check(answer)`` must pass and ``check(lambda: 0)`` must fail
CANARY_MODULE = "def answer():\n    return 42\n\n\ndef check(f):\n    assert f() == 42, 'canary: wrong answer'\n"
CANARY_TIMEOUT_S = 30.0  # generous: a loaded machine must not make a working sandbox look broken
_canaries: dict[tuple, str | None] = {}


def canary(name: str, probe: Callable[[], str | None], *key: Hashable) -> str:
    """Run ``probe`` (None: the sandbox behaved; else what went wrong, as text) once per process and configuration
    (``name``, the isolation, ``sys.executable``, ``key``), and raise :class:`SandboxError` while it says the
    sandbox is broken; returns the isolation. An exception out of ``probe`` counts as a failure."""
    try:
        mode = isolation()
    except RuntimeError as e:  # PARDEC_SANDBOX=bwrap without a working bwrap
        raise SandboxError(_one_line(f"sandbox canary failed: {e}")) from None
    k = (name, mode, sys.executable, *key)
    if k not in _canaries:
        try:
            _canaries[k] = probe()
        except Exception as e:  # whatever stops the canary would stop the scorer too
            _canaries[k] = f"the {name} canary could not run ({type(e).__name__}: {e})"
    problem = _canaries[k]
    if problem:
        hint = " or set PARDEC_SANDBOX=guard to run without namespaces" if mode.startswith("bwrap") else ""
        raise SandboxError(_one_line(
            f"sandbox canary failed: {problem}; scores would be wrong, so nothing is scored: fix the sandbox (see "
            f"pardec.metrics.sandbox; isolation here: {mode}){hint}"))
    return mode


def clear_canaries() -> None:
    """Forget every canary's result: the next scorer start runs its canary again."""
    _canaries.clear()


def check_programs(memory_mb: int = 1024) -> str:
    """The canary of :func:`run_program` (HumanEval's path) with an address-space limit of ``memory_mb``: raises
    :class:`SandboxError` unless a known-good program passes and a known-bad one fails, and without bubblewrap
    unless ``PARDEC_SANDBOX=guard`` allows the guard alone; returns the isolation."""
    mode = canary("program", functools.partial(_program_canary, memory_mb), memory_mb)
    if not mode.startswith("bwrap") and os.environ.get("PARDEC_SANDBOX") != "guard":
        raise SandboxError(f"generated code would run without OS isolation ({mode}): install bubblewrap "
                           "(apt-get install bubblewrap), or set PARDEC_SANDBOX=guard to score with the in-process "
                           "guard alone (the program can then read every file this user can)")
    return mode


def _program_canary(memory_mb: int) -> str | None:
    try:
        good = run_program(CANARY_MODULE, timeout_s=CANARY_TIMEOUT_S, memory_mb=memory_mb, then="check(answer)")
    except OSError as e:  # the interpreter (or bwrap) cannot be started at all
        return f"a known-good program could not start ({e})"
    if not good.passed:
        return f"a known-good program did not pass ({describe(good)})"
    bad = run_program(CANARY_MODULE, timeout_s=CANARY_TIMEOUT_S, memory_mb=memory_mb, then="check(lambda: 0)")
    if bad.passed:
        return f"a known-bad program passed ({describe(bad)})"
    return None


def describe(r: SandboxResult) -> str:
    """One line on how a sandboxed run ended: the last line it wrote (stderr first), its status and exit code."""
    last = next((x for text in (r.stderr, r.stdout) for x in reversed(text.splitlines()) if x.strip()), "no output")
    return _one_line(f"{last.strip()[-300:]}; {r.status}, exit {r.returncode}")


def _one_line(text: str) -> str:
    return " ".join(text.split())


@functools.cache
def isolation() -> str:
    """Which layers run untrusted code here: ``"bwrap+seccomp+guard"`` when bubblewrap works, else
    ``"seccomp+guard (no namespaces: <why>)"``, with a loud warning; ``seccomp`` only on x86-64/arm64 where a
    probe child could install the filter (a warning says when it could not)."""
    seccomp = ""
    if seccomp_filter() is not None:
        why_not = _seccomp_problem()
        if why_not is None:
            seccomp = "+seccomp"
        else:
            warnings.warn(f"SANDBOX WITHOUT SECCOMP: {why_not}; generated code may start processes (the PID namespace "
                          "and the guard still apply)", RuntimeWarning, stacklevel=2)
    want = os.environ.get("PARDEC_SANDBOX", "")
    if want not in ("", "bwrap", "guard"):
        raise ValueError(f"PARDEC_SANDBOX={want!r}; valid: bwrap, guard (or unset: bwrap when it works)")
    if want == "guard":
        why = "PARDEC_SANDBOX=guard"
    else:
        why = _bwrap_problem()
        if why is None:
            return f"bwrap{seccomp}+guard"
        if want == "bwrap":
            raise RuntimeError(f"PARDEC_SANDBOX=bwrap but bubblewrap cannot run here: {why}")
    mode = f"{seccomp.lstrip('+') or 'rlimits'}+guard (no namespaces: {why})"
    warnings.warn(f"SANDBOX WITHOUT OS ISOLATION: generated code runs under {mode}; it can read every file this "
                  "user can and, by tampering with the interpreter, write them. Install bubblewrap "
                  "(apt-get install bubblewrap) to isolate it.", RuntimeWarning, stacklevel=2)
    return mode


def _seccomp_problem() -> str | None:
    """None if a Python child can install :func:`seccomp_filter` here (a container may forbid it), else why not."""
    try:
        p = subprocess.run([sys.executable, "-I", "-B", "-c", seccomp_prelude() + "print('ok')"], capture_output=True,
                           timeout=30, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the seccomp probe failed to run ({e})"
    if p.returncode != 0 or p.stdout.strip() != b"ok":
        return p.stderr.decode(errors="replace").strip()[-200:] or f"the seccomp probe exited {p.returncode}"
    return None


def _bwrap_problem() -> str | None:
    """None if bwrap runs a command in fresh namespaces here, else why not."""
    if shutil.which("bwrap") is None:
        return "bwrap not found"
    with tempfile.TemporaryDirectory(prefix="pardec_sandbox_probe_") as d:
        try:
            user, prefix, fds = user_namespace()
            p = subprocess.run([*bwrap_args(Path(d), (), user), *prefix, "true"], capture_output=True, timeout=30,
                               pass_fds=fds)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"bwrap failed to start ({e})"
    if p.returncode != 0:
        return f"bwrap failed: {p.stderr.decode(errors='replace').strip()[:200]}"
    return None


def bwrap_args(work: Path, ro_paths: tuple[str, ...], user: list[str]) -> list[str]:
    """The ``bwrap`` command line of layer 1 (the program's argv goes after it): the private root
    (:func:`pardec.metrics.sandbox_root.root_args`), ``user``'s namespace arguments
    (:func:`~pardec.metrics.sandbox_root.user_namespace`), a new session, a parent-death kill, no hostname."""
    return ["bwrap", *user, *root_args(work, ro_paths), "--die-with-parent", "--new-session", "--hostname", "sandbox"]


def run_program(code: str, timeout_s: float = 10.0, memory_mb: int = 1024, fsize_mb: int = 32,
                then: str | None = None) -> SandboxResult:
    """Run ``code`` as ``__main__`` in the sandbox; never in this process.

    Without ``then``: "passed" if it exits with 0 within ``timeout_s`` seconds. With ``then`` (a Python
    expression evaluated in the program's namespace after its module code, e.g. ``"check(f)"``): "passed"
    only if ``then`` returned normally, proved by the pass marker of the module docstring. Otherwise
    "failed" (non-zero exit: an exception, SyntaxError, MemoryError, a denial; or no marker), "timeout",
    or "error" (killed by a signal: a crash, the CPU limit, a seccomp kill).
    """
    source = (seccomp_prelude() if "seccomp" in isolation() else "") + GUARD
    source += RUN.replace("__CTL_ENV__", _CTL_ENV).replace("__THEN__", repr(then))
    argv = [sys.executable, "-I", "-B", "-c", source]
    return _run(argv, timeout_s, memory_mb, fsize_mb, {"main.py": code}, (), marker=then is not None)


def run_command(argv: list[str], timeout_s: float = 10.0, memory_mb: int = 1024, fsize_mb: int = 32,
                files: dict[str, str] | None = None, ro_paths: tuple[str, ...] = (),
                read_back: tuple[str, ...] = ()) -> SandboxResult:
    """Run ``argv`` in the namespaces with the rlimits and the wall-clock kill of :func:`run_program`, but
    without seccomp and the guard (it may start processes): for trusted programs fed untrusted input.

    ``files`` (name -> text) are written into the fresh working directory first; ``ro_paths`` are host
    paths that must stay visible read-only (they are otherwise if not under a hidden directory);
    ``read_back`` names files in the working directory returned in ``SandboxResult.files`` (bytes; a
    missing one is absent), read before the directory is removed.
    """
    return _run(argv, timeout_s, memory_mb, fsize_mb, files or {}, tuple(ro_paths), read_back=read_back)


def _run(argv: list[str], timeout_s: float, memory_mb: int, fsize_mb: int, files: dict[str, str],
         ro_paths: tuple[str, ...], marker: bool = False, read_back: tuple[str, ...] = ()) -> SandboxResult:
    if timeout_s <= 0 or memory_mb <= 0 or fsize_mb <= 0:
        raise ValueError(f"timeout_s={timeout_s}, memory_mb={memory_mb}, fsize_mb={fsize_mb} must all be > 0")
    mode = isolation()
    sweep_stale()
    top = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}_"))
    work = top / "work"
    work.mkdir()
    for name, text in files.items():
        (work / name).write_text(text, encoding="utf-8")
    if os.geteuid() == 0 and mode.startswith("bwrap"):  # the program runs as the host's nobody: its directory
        for p in (work, *work.iterdir()):
            os.chown(p, NOBODY, NOBODY)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    limits = ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_FSIZE, fsize_mb << 20),
              (resource.RLIMIT_CORE, 0), (resource.RLIMIT_CPU, int(timeout_s) + 1))
    user, prefix, fds = user_namespace() if mode.startswith("bwrap") else ([], [], ())
    ctl_r = ctl_w = None
    if marker:
        ctl_r, ctl_w = os.pipe()
        env[_CTL_ENV] = str(ctl_w)
    try:
        with open(top / "stdout", "wb") as out, open(top / "stderr", "wb") as err:
            if mode.startswith("bwrap"):
                argv = [*bwrap_args(work, ro_paths, user), *prefix, *argv]
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=err, close_fds=True,
                                    stdin=subprocess.PIPE if marker else subprocess.DEVNULL,
                                    pass_fds=((ctl_w,) if marker else ()) + fds, start_new_session=True,
                                    preexec_fn=rlimits(limits))
        returned = False
        if marker:
            os.close(ctl_w)
            ctl_w = None
            done, returned = wait_with_marker(proc, ctl_r, timeout_s)
        else:
            done = wait_unreaped(proc.pid, timeout_s)
        kill_session(proc.pid)
        proc.wait()
        wall = time.perf_counter() - t0
        rc = proc.returncode
        if mode.startswith("bwrap") and 128 < rc < 128 + signal.NSIG:  # bwrap reports a signal death so
            rc = 128 - rc
        if not done:
            status = "timeout"
        elif rc < 0:
            status = "error"
        else:
            status = "passed" if rc == 0 and (returned or not marker) else "failed"
        back = {n: (work / n).read_bytes() for n in read_back if (work / n).is_file()}
        return SandboxResult(status, rc, tail(top / "stdout"), tail(top / "stderr"), wall, mode, back)
    finally:
        for fd in (ctl_r, ctl_w):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(top, ignore_errors=True)
        if top.exists():  # e.g. the program made a directory unwritable (cannot happen as root)
            warnings.warn(f"sandbox: could not remove its temporary directory {top}", stacklevel=2)
