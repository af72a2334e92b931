"""Adversarial programs and early-exit completions for the code sandbox (fixtures, not tests).

``ATTACKS``: name -> (program, needs_isolation). A program tries to escape: start a process that outlives
it (``sleep __TOKEN__``), write or change files in ``__OUT__`` (a host directory outside the sandbox),
signal the bystander ``__VICTIM__`` or the harness ``__HARNESS__``, exhaust a resource. Each is run as a
HumanEval-style completion that must fail its check; contained = scored as failed, ``__OUT__`` unchanged,
no ``sleep __TOKEN__`` alive, bystander and harness alive. ``needs_isolation``: the in-process guard alone
does not contain it (it disables the guard first, or uses a route the guard does not see); only the OS
layers (namespaces, read-only filesystem, seccomp) do.

``EARLY_EXITS``: name -> (completion module code, passes_anyway). Each never lets ``check`` return; the
pass marker must fail all of them except the always-equal object, a limit of HumanEval's ``==`` tests.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

#: the argument of the attacks' ``sleep``: one per test process (pytest-xdist workers run the sandbox modules at
#: once; a shared token let one worker's clean-up kill, and its survivor check see, the other's sleeps)
TOKEN = str(4_000_000 + os.getpid())

# Disables the audit-hook guard: provoke a denial, walk the traceback to the hook's frame, and replace the
# code of its ``deny`` closure with a no-op (function code is writable; the guard does not audit that).
BYPASS = '''
def _pardec_bypass():
    try:
        open("/pardec-no-such-dir/x", "w")
    except PermissionError as e:
        tb = e.__traceback__
        while tb is not None:
            deny = tb.tb_frame.f_locals.get("deny")
            if callable(deny):
                deny.__code__ = (lambda what: None).__code__
                return
            tb = tb.tb_next
    raise AssertionError("guard not found")


_pardec_bypass()
'''

_SLEEP = f"['sleep', '{TOKEN}']"
_FORK_SLEEP = f"import os\nif os.fork() == 0:\n    os.execv('/bin/sleep', {_SLEEP})\n"

# name -> (program, needs_isolation)
ATTACKS: dict[str, tuple[str, bool]] = {
    # process creation, guard intact
    "fork": ("import os\nos.fork()", False),
    "posix.fork": ("import posix\nposix.fork()", False),
    "os.system": (f"import os\nos.system('sleep {TOKEN} &')", False),
    "subprocess.Popen": (f"import subprocess\nsubprocess.Popen({_SLEEP})", False),
    "os.popen": (f"import os\nos.popen('sleep {TOKEN}')", False),
    "posix_spawn": (f"import os\nos.posix_spawn('/bin/sleep', {_SLEEP}, {{}})", False),
    "spawnv": (f"import os\nos.spawnv(os.P_NOWAIT, '/bin/sleep', {_SLEEP})", False),
    "execv": (f"import os\nos.execv('/bin/sleep', {_SLEEP})", False),
    "multiprocessing": (f"import multiprocessing as mp, time\nmp.Process(target=time.sleep, args=({TOKEN},)).start()",
                        False),
    "multiprocessing.spawn": (f"import multiprocessing.util as u\nu.spawnv_passfds(b'/bin/sleep', [b'sleep', "
                              f"b'{TOKEN}'], ())", False),
    "reimport _posixsubprocess": ("import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess", False),
    "pty.fork": ("import pty\npty.fork()", False),
    "ctypes fork": ("import ctypes\nctypes.CDLL(None).fork()", False),
    "ctypes libc": ("import ctypes\nctypes.CDLL('libc.so.6')", False),
    # process creation with the guard disabled: seccomp and the PID namespace must hold
    "bypass: fork+exec": (BYPASS + _FORK_SLEEP, True),
    "bypass: os.system": (BYPASS + f"import os\nos.system('sleep {TOKEN} &')\nassert False", True),
    "bypass: Popen new session": (BYPASS + f"import subprocess\nsubprocess.Popen({_SLEEP}, start_new_session=True)",
                                  True),
    "bypass: posix_spawn": (BYPASS + f"import os\nos.posix_spawn('/bin/sleep', {_SLEEP}, {{}})", True),
    "bypass: execv": (BYPASS + f"import os\nos.execv('/bin/sleep', {_SLEEP})", True),
    "bypass: ctypes system": (BYPASS + f"import ctypes\nassert ctypes.CDLL(None).system(b'sleep {TOKEN} &') == 0",
                              True),
    "bypass: ctypes function pointer": (BYPASS + (
        "import ctypes\naddr = ctypes.cast(ctypes.CDLL(None).system, ctypes.c_void_p).value\n"
        f"f = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_char_p)(addr)\nassert f(b'sleep {TOKEN} &') == 0"), True),
    "bypass: double fork daemon": (BYPASS + (
        f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        os.execv('/bin/sleep', "
        f"{_SLEEP})\n    os._exit(0)"), True),
    "bypass: fork bomb": (BYPASS + "import os\nfor _ in range(64):\n    os.fork()", True),
    "subinterpreter without the hook": (
        f"import _xxsubinterpreters as s\ns.run_string(s.create(), \"import os; os.system('sleep {TOKEN} &')\")",
        True),
    "subinterpreter write": (
        "import _xxsubinterpreters as s\ns.run_string(s.create(), \"open('__OUT__/sub.txt', 'w').write('x')\")", True),
    # writes outside the temporary directory, guard intact
    "open w": ("open('__OUT__/new.txt', 'w').write('pwned')", False),
    "open a": ("open('__OUT__/keep.txt', 'a').write('pwned')", False),
    "os.open O_CREAT": ("import os\nos.close(os.open('__OUT__/new.txt', os.O_CREAT | os.O_WRONLY))", False),
    "pathlib write": ("import pathlib\npathlib.Path('__OUT__/new.txt').write_text('pwned')", False),
    "shutil.copy": ("import shutil\nopen('mine', 'w').write('x')\nshutil.copy('mine', '__OUT__/new.txt')", False),
    "os.replace": ("import os\nopen('mine', 'w').write('x')\nos.replace('mine', '__OUT__/keep.txt')", False),
    "chdir then write": ("import os\nos.chdir('__OUT__')\nopen('new.txt', 'w')", False),
    "symlink out": ("import os\nos.symlink('__OUT__', 'out')\nopen('out/new.txt', 'w')", False),
    "sqlite connect": ("import sqlite3\nsqlite3.connect('__OUT__/new.db').execute('create table t(x)')", False),
    "os.remove": ("import os\nos.remove('__OUT__/keep.txt')", False),
    "unlink dir_fd": ("import os\nfd = os.open('__OUT__', os.O_RDONLY)\nos.unlink('keep.txt', dir_fd=fd)", False),
    "os.rename": ("import os\nos.rename('__OUT__/keep.txt', 'stolen')", False),
    "rmtree": ("import shutil\nshutil.rmtree('__OUT__')", False),
    "truncate": ("import os\nos.truncate('__OUT__/keep.txt', 0)", False),
    "open r+": ("open('__OUT__/keep.txt', 'r+').write('XXXX')", False),
    "chmod": ("import os\nos.chmod('__OUT__/keep.txt', 0)", False),
    # writes by routes the guard does not see (or with it disabled): the read-only filesystem must hold
    "os.open dir_fd": ("import os\nfd = os.open('__OUT__', os.O_RDONLY)\n"
                       "os.close(os.open('new.txt', os.O_CREAT | os.O_WRONLY, dir_fd=fd))", True),
    "sqlite URI": ("import sqlite3\nsqlite3.connect('file:__OUT__/uri.db?mode=rwc', uri=True)"
                   ".execute('create table t(x)')", True),
    "sqlite ATTACH": ("import sqlite3\nc = sqlite3.connect(':memory:')\nc.execute(\"attach '__OUT__/att.db' as a\")\n"
                      "c.execute('create table a.t(x)')", True),
    "patched realpath": ("import os, os.path\nos.path.realpath = lambda p, **k: os.getcwd()\n"
                         "open('__OUT__/new.txt', 'w').write('pwned')", True),
    "bypass: open w": (BYPASS + "open('__OUT__/new.txt', 'w').write('pwned')", True),
    "bypass: rmtree": (BYPASS + "import shutil\nshutil.rmtree('__OUT__')", True),
    "bypass: chmod": (BYPASS + "import os\nos.chmod('__OUT__/keep.txt', 0)", True),
    # signals to processes outside
    "pidfd_send_signal": ("import os, signal\nsignal.pidfd_send_signal(os.pidfd_open(__VICTIM__), 9)", True),
    "bypass: kill harness": (BYPASS + "import os\nos.kill(__HARNESS__, 9)", True),
    "bypass: kill parent": (BYPASS + "import os\nos.kill(os.getppid(), 9)\nassert False", True),
    "bypass: kill every visible pid": (BYPASS + (
        "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit() and int(p) != os.getpid():\n"
        "        try:\n            os.kill(int(p), 9)\n        except OSError:\n            pass\n"
        "os.kill(__VICTIM__, 9)"), True),
    "bypass: ptrace victim": (BYPASS + (
        "import ctypes\nassert ctypes.CDLL(None).ptrace(16, __VICTIM__, 0, 0) == 0"), True),
    # namespaces, mounts, network
    "bypass: unshare user ns": (BYPASS + "import ctypes\nassert ctypes.CDLL(None).unshare(0x10000000) == 0", True),
    "bypass: mount tmpfs": (BYPASS + (
        "import ctypes\nassert ctypes.CDLL(None).mount(b'none', b'__OUT__', b'tmpfs', 0, None) == 0"), True),
    "bypass: network": (BYPASS + "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", True),
    # resources
    "memory bomb": ("a = []\nwhile True:\n    a.append(bytearray(32 << 20))", False),
    "disk fill": ("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * (1 << 20))", False),
    "thread bomb": ("import threading, time\nfor _ in range(100000):\n"
                    "    threading.Thread(target=time.sleep, args=(60,), daemon=True).start()", False),
    "ignore SIGTERM and spin": ("import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass",
                                False),
}

# name -> (completion module code, passes_anyway). The check after it asserts the function returns 42.
EARLY_EXITS: dict[str, tuple[str, bool]] = {
    "module sys.exit(0)": ("import sys\nsys.exit(0)\n", False),
    "module os._exit(0)": ("import os\nos._exit(0)\n", False),
    "SystemExit(0) in the function": ("def f():\n    raise SystemExit(0)\n", False),
    "atexit os._exit(0)": ("import atexit, os\natexit.register(os._exit, 0)\n", False),
    "daemon thread os._exit(0)": ("import os, threading, time\n"
                                  "threading.Thread(target=lambda: (time.sleep(0.3), os._exit(0)), daemon=True).start()\n"
                                  "def f():\n    time.sleep(2)\n", False),
    "settrace exits at check": ("import os, sys\n"
                                "def tr(frame, event, arg):\n"
                                "    if event == 'call' and frame.f_code.co_name == 'check':\n        os._exit(0)\n"
                                "    return None\nsys.settrace(tr)\n", False),
    "excepthook exits 0": ("import os, sys\nsys.excepthook = lambda *a: os._exit(0)\n", False),
    "SIGALRM handler exits 0": ("import os, signal\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
                                "signal.setitimer(signal.ITIMER_REAL, 0.05)\ndef f():\n    import time\n"
                                "    time.sleep(2)\n", False),
    "exit inside check via builtins": ("import builtins, sys\n_abs = builtins.abs\n"
                                       "builtins.abs = lambda x: sys.exit(0)\ndef f():\n    return abs(-1)\n", False),
    "always-equal object": ("class Eq:\n    def __eq__(self, other):\n        return True\n"
                            "def f():\n    return Eq()\n", True),
}

EARLY_EXIT_TEST = "def check(candidate):\n    assert candidate() == 42\n"
EARLY_EXIT_DEFAULT_F = "def f():\n    return 0\n"


def early_exit_module(code: str) -> str:
    """The module of an early-exit completion: a wrong ``f`` (unless the code defines one), the code, the test."""
    return EARLY_EXIT_DEFAULT_F + code + "\n" + EARLY_EXIT_TEST


def attack_module(code: str, out: str, victim: int, harness: int) -> str:
    """An attack program made concrete, followed by a wrong ``f`` and a test that it fails."""
    for key, value in (("__OUT__", out), ("__VICTIM__", str(victim)), ("__HARNESS__", str(harness))):
        code = code.replace(key, value)
    return code + "\n" + EARLY_EXIT_DEFAULT_F + EARLY_EXIT_TEST


def _snapshot(d: Path) -> dict:
    """Names, contents and modes of everything under ``d`` (``d`` itself included)."""
    if not d.exists():
        return {}
    snap = {".": d.stat().st_mode}
    for p in sorted(d.rglob("*")):
        snap[p.relative_to(d).as_posix()] = (p.read_bytes() if p.is_file() else None, p.stat().st_mode)
    return snap


def token_processes() -> list[int]:
    """Live (not zombie) processes whose command line contains TOKEN."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if TOKEN in cmd and state != "Z":
            pids.append(int(d.name))
    return pids


def alive(pid: int) -> bool:
    """Running or sleeping (not a zombie, not stopped by a tracer)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "T", "t", "X")
    except FileNotFoundError:
        return False


def run_attack(name: str, out: Path, victim: int, timeout_s: float = 3.0) -> tuple[bool, str]:
    """Run attack ``name`` as a HumanEval-style program against a fresh ``out`` directory; (contained, why not)."""
    from pardec.metrics.sandbox import run_program

    out.mkdir(parents=True, exist_ok=True)
    (out / "keep.txt").write_text("precious")
    before = _snapshot(out)
    code, _ = ATTACKS[name]
    r = run_program(attack_module(code, str(out), victim, os.getpid()), timeout_s=timeout_s, memory_mb=256,
                    fsize_mb=8, then="check(f)")
    time.sleep(0.05)  # let a killed namespace's processes go
    problems = []
    if r.passed:
        problems.append("scored as passed")
    if _snapshot(out) != before:
        problems.append(f"{out} changed")
    if (left := token_processes()):
        problems.append(f"processes survive: {left}")
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    if not alive(victim):
        problems.append("the bystander was killed or stopped")
    return not problems, "; ".join(problems) or r.status
