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
5. **The audit-hook guard** (:data:`_GUARD`, PEP 578) as an extra, in-process layer: it refuses process
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
tests compare with ``==``, so such a completion passes. That is a limit of HumanEval, not special-cased.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import resource
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

from pardec.metrics.sandbox_root import NOBODY, root_args, user_namespace

TAIL_CHARS = 4000
_CTL_ENV = "PARDEC_SANDBOX_FD"
TEMP_PREFIX = "pardec_sandbox_"  # + "<pid>_<random>": a run's temporary directory, swept when its pid is gone
_swept = False

# --- seccomp ----------------------------------------------------------------------------------------
# (audit arch, {name: number}) per machine; numbers from the kernel's syscall tables.
_SYSCALLS = {
    "x86_64": (0xC000003E, {
        "clone": 56, "clone3": 435, "fork": 57, "vfork": 58, "execve": 59, "execveat": 322,
        "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312,
        "mount": 165, "umount2": 166, "pivot_root": 155, "chroot": 161, "unshare": 272, "setns": 308,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
        "bpf": 321, "perf_event_open": 298, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 250, "add_key": 248, "request_key": 249,
        "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313,
        "delete_module": 176, "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "syslog": 103,
        "settimeofday": 164, "clock_settime": 227, "personality": 135, "name_to_handle_at": 303,
        "open_by_handle_at": 304,
    }),
    "aarch64": (0xC00000B7, {
        "clone": 220, "clone3": 435, "execve": 221, "execveat": 281,
        "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "kcmp": 272,
        "mount": 40, "umount2": 39, "pivot_root": 41, "chroot": 51, "unshare": 97, "setns": 268,
        "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
        "mount_setattr": 442, "pidfd_send_signal": 424, "pidfd_open": 434, "pidfd_getfd": 438,
        "bpf": 280, "perf_event_open": 241, "userfaultfd": 282, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427, "keyctl": 219, "add_key": 217, "request_key": 218,
        "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273,
        "delete_module": 106, "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "syslog": 116,
        "settimeofday": 170, "clock_settime": 112, "personality": 92, "name_to_handle_at": 264,
        "open_by_handle_at": 265,
    }),
}
_CLONE_THREAD = 0x00010000
_X32_BIT = 0x40000000
_EPERM, _ENOSYS = 1, 38
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06


def seccomp_filter(machine: str | None = None) -> bytes | None:
    """The classic-BPF seccomp program (``struct sock_filter[]`` bytes) for ``machine``; None if unsupported.

    A foreign architecture (e.g. 32-bit calls on x86-64) kills the process; ``clone3`` answers ``ENOSYS``
    (glibc then falls back to ``clone``), ``clone`` is allowed only with ``CLONE_THREAD``, every call in
    the table except those two is refused with ``EPERM``, everything else is allowed.
    """
    machine = machine or platform.machine()
    if machine not in _SYSCALLS:
        return None
    arch, nr = _SYSCALLS[machine]

    def ins(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
        return struct.pack("=HBBI", code, jt, jf, k)

    prog = [ins(_LD_W_ABS, 4), ins(_JEQ, arch, 1, 0), ins(_RET, _RET_KILL_PROCESS), ins(_LD_W_ABS, 0)]
    if machine == "x86_64":  # the x32 ABI reuses the arch value with this bit set in the number
        prog += [ins(_JGE, _X32_BIT, 0, 1), ins(_RET, _RET_ERRNO | _EPERM)]
    prog += [ins(_JEQ, nr["clone3"], 0, 1), ins(_RET, _RET_ERRNO | _ENOSYS)]
    # clone: load the low word of args[0] (flags; little-endian), allow threads only
    prog += [ins(_JEQ, nr["clone"], 0, 4), ins(_LD_W_ABS, 16), ins(_JSET, _CLONE_THREAD, 0, 1),
             ins(_RET, _RET_ALLOW), ins(_RET, _RET_ERRNO | _EPERM)]
    for name, number in nr.items():
        if name not in ("clone", "clone3"):
            prog += [ins(_JEQ, number, 0, 1), ins(_RET, _RET_ERRNO | _EPERM)]
    prog.append(ins(_RET, _RET_ALLOW))
    return b"".join(prog)


def seccomp_prelude() -> str:
    """Python source that installs :func:`seccomp_filter` in the running interpreter (exit 97 if that fails);
    "" where there is no filter for this machine. :func:`run_program` runs it before anything else."""
    filt = seccomp_filter()
    return "" if filt is None else _SECCOMP.replace("__SECCOMP_HEX__", repr(filt.hex()))


# Runs first in the child (part of the ``python -c`` source): installs the seccomp filter or exits with 97.
_SECCOMP = r'''
def _pardec_seccomp(program):
    import ctypes, sys
    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(program, len(program))
    prog = Prog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    # PR_SET_NO_NEW_PRIVS = 38, PR_SET_SECCOMP = 22, SECCOMP_MODE_FILTER = 2
    if libc.prctl(38, 1, 0, 0, 0) != 0 or libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:
        sys.stderr.write(f"sandbox: installing the seccomp filter failed (errno {ctypes.get_errno()})\n")
        sys.stderr.flush()
        import os
        os._exit(97)


_pardec_seccomp(bytes.fromhex(__SECCOMP_HEX__))
del _pardec_seccomp
'''

# Runs in the child before the program (part of the ``python -c`` source); see the module docstring.
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
'''

# Runs the program as __main__; with a ``then`` expression, the pass-marker protocol of the module docstring.
_RUN = r'''
def _pardec_run(then):
    import os, sys
    with open("main.py", encoding="utf-8") as f:
        code = compile(f.read(), "main.py", "exec")
    ns = {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__}
    if then is None:
        exec(code, ns)
        return
    ctl = int(os.environ.pop("__CTL_ENV__"))
    exec(code, ns)
    sys.settrace(None)
    sys.setprofile(None)
    if len(os.listdir("/proc/self/task")) != 1:
        raise RuntimeError("sandbox: threads still running after the module code; not checked")
    os.write(ctl, b"ready\n")
    secret = sys.stdin.buffer.readline().strip()
    eval(then, ns)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(ctl, b"returned " + secret + b"\n")
    os._exit(0)


_pardec_run(__THEN__)
'''


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
            with user_namespace() as (user, prefix, fds):
                p = subprocess.run([*bwrap_args(Path(d), (), user), *prefix, "true"], capture_output=True,
                                   timeout=30, pass_fds=fds)
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
    source = (seccomp_prelude() if "seccomp" in isolation() else "") + _GUARD
    source += _RUN.replace("__CTL_ENV__", _CTL_ENV).replace("__THEN__", repr(then))
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
    namespaces = user_namespace() if mode.startswith("bwrap") else contextlib.nullcontext(([], [], ()))
    ctl_r = ctl_w = None
    if marker:
        ctl_r, ctl_w = os.pipe()
        env[_CTL_ENV] = str(ctl_w)
    try:
        with open(top / "stdout", "wb") as out, open(top / "stderr", "wb") as err, namespaces as (user, prefix, fds):
            if mode.startswith("bwrap"):
                argv = [*bwrap_args(work, ro_paths, user), *prefix, *argv]
            t0 = time.perf_counter()
            proc = subprocess.Popen(argv, cwd=work, env=env, stdout=out, stderr=err, close_fds=True,
                                    stdin=subprocess.PIPE if marker else subprocess.DEVNULL,
                                    pass_fds=((ctl_w,) if marker else ()) + fds, start_new_session=True,
                                    preexec_fn=_rlimits(limits))
        returned = False
        if marker:
            os.close(ctl_w)
            ctl_w = None
            done, returned = _wait_with_marker(proc, ctl_r, timeout_s)
        else:
            done = _wait_unreaped(proc.pid, timeout_s)
        _kill_session(proc.pid)
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
        return SandboxResult(status, rc, _tail(top / "stdout"), _tail(top / "stderr"), wall, mode, back)
    finally:
        for fd in (ctl_r, ctl_w):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(top, ignore_errors=True)
        if top.exists():  # e.g. the program made a directory unwritable (cannot happen as root)
            warnings.warn(f"sandbox: could not remove its temporary directory {top}", stacklevel=2)


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


def _wait_with_marker(proc: subprocess.Popen, ctl: int, timeout_s: float) -> tuple[bool, bool]:
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
