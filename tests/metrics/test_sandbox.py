"""The code sandbox: outcomes, the wall clock, limits, and what the guard denies. CPU only, no network."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pardec.metrics.sandbox import TAIL_CHARS, run_command, run_program

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _dead_soon(pid: int, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _procs_with(token: str) -> list[int]:
    """Live processes whose command line contains ``token``."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (FileNotFoundError, ProcessLookupError):
                continue
            if token in cmdline and _alive(int(d.name)):
                pids.append(int(d.name))
    return pids


def test_passing_program_and_its_output():
    r = run_program("import math\nprint('hello', math.factorial(5))\n", timeout_s=5)
    assert (r.status, r.returncode, r.passed) == ("passed", 0, True)
    assert r.stdout.strip() == "hello 120" and r.wall_s < 5


@pytest.mark.parametrize("code, expect", [
    ("assert 1 + 1 == 3, 'wrong'", "AssertionError: wrong"),
    ("def f(:\n    pass", "SyntaxError"),
    ("raise SystemExit(3)", ""),
])
def test_failing_programs(code, expect):
    r = run_program(code, timeout_s=5)
    assert r.status == "failed" and not r.passed and r.returncode != 0
    assert expect in r.stderr


def test_infinite_loop_times_out_and_is_killed():
    t0 = time.monotonic()
    r = run_program("while True:\n    pass\n", timeout_s=1.0)
    assert r.status == "timeout" and r.returncode == -9
    assert 1.0 <= r.wall_s < 3.0 and time.monotonic() - t0 < 3.0


def test_sleeping_program_times_out():
    r = run_program("import time\ntime.sleep(300)", timeout_s=0.5)
    assert r.status == "timeout" and r.wall_s < 2.5


def test_crash_by_signal_is_an_error():
    r = run_program("import faulthandler\nfaulthandler._sigsegv()", timeout_s=5)
    assert (r.status, r.returncode) == ("error", -11)


def test_concurrent_runs_from_threads():
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: run_program(f"print({i} * 2)", timeout_s=10), range(16)))
    assert [r.stdout.strip() for r in results] == [str(2 * i) for i in range(16)]


@pytest.mark.parametrize("code", [
    "x = bytearray(64 << 30)",  # one huge allocation
    "a = []\nwhile True:\n    a.append(bytearray(32 << 20))",  # a growing one
])
def test_memory_bomb_is_contained(code):
    r = run_program(code, timeout_s=10, memory_mb=256)
    assert r.status == "failed" and "MemoryError" in r.stderr
    assert run_program("print(sum(range(10)))", timeout_s=5).stdout.strip() == "45"  # the host carries on


@pytest.mark.parametrize("code", [
    "import os\nos.fork()",
    "import posix\nposix.fork()",
    "import os\nos.system('sleep 97531')",
    "import subprocess\nsubprocess.Popen(['sleep', '97531'])",
    "import os\nos.popen('sleep 97531')",
    "import os\nos.posix_spawn('/bin/sleep', ['sleep', '97531'], {})",
    "import os\nos.spawnv(os.P_NOWAIT, '/bin/sleep', ['sleep', '97531'])",
    "import os\nos.execv('/bin/sleep', ['sleep', '97531'])",
    "import multiprocessing as mp, time\nmp.Process(target=time.sleep, args=(97531,)).start()",
    "import multiprocessing as mp, time\nctx = mp.get_context('spawn')\nif __name__ == '__main__':\n"
    "    ctx.Process(target=time.sleep, args=(97531,)).start()",
    "import multiprocessing.util as u\nu.spawnv_passfds(b'/bin/sleep', [b'sleep', b'97531'], ())",
    "import sys\ndel sys.modules['_posixsubprocess']\nimport _posixsubprocess",
    "import pty\npty.fork()",
    "import ctypes\nctypes.CDLL(None).fork()",
    "import ctypes\nctypes.CDLL('libc.so.6')",
])
def test_process_creation_is_denied(code):
    r = run_program(code, timeout_s=5)
    assert r.status == "failed" and "PermissionError: sandbox:" in r.stderr, r.stderr
    assert _procs_with("97531") == []


@pytest.mark.parametrize("write", [
    "open({p!r}, 'w').write('pwned')",
    "open({p!r}, 'a').write('pwned')",
    "import os\nos.close(os.open({p!r}, os.O_CREAT | os.O_WRONLY))",
    "import pathlib\npathlib.Path({p!r}).write_text('pwned')",
    "import shutil\nopen('mine', 'w').write('pwned')\nshutil.copy('mine', {p!r})",
    "import os\nopen('mine', 'w').write('pwned')\nos.replace('mine', {p!r})",
    "import os\nos.chdir(os.path.dirname({p!r}))\nopen(os.path.basename({p!r}), 'w')",
    "import os\nos.symlink(os.path.dirname({p!r}), 'out')\nopen('out/' + os.path.basename({p!r}), 'w')",
    "import sqlite3\nsqlite3.connect({p!r}).execute('create table t(x)')",
])
def test_writing_outside_is_denied(tmp_path, write):
    target = tmp_path / "created_by_sandbox.txt"
    r = run_program(write.format(p=str(target)), timeout_s=5)
    assert r.status == "failed" and "PermissionError: sandbox:" in r.stderr, r.stderr
    assert not target.exists()


@pytest.mark.parametrize("delete", [
    "import os\nos.remove({p!r})",
    "import os\nos.unlink({p!r})",
    "import os\nfd = os.open(os.path.dirname({p!r}), os.O_RDONLY)\nos.unlink(os.path.basename({p!r}), dir_fd=fd)",
    "import os\nos.rename({p!r}, 'stolen')",
    "import shutil\nshutil.rmtree(os.path.dirname({p!r}))",
    "import shutil, os\nshutil.move({p!r}, 'stolen')",
    "import os\nos.truncate({p!r}, 0)",
    "open({p!r}, 'r+').write('XXXX')",
    "import os\nos.chmod({p!r}, 0)",
])
def test_deleting_or_changing_outside_is_denied(tmp_path, delete):
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    mode = keep.stat().st_mode
    r = run_program("import os\n" + delete.format(p=str(keep)), timeout_s=5)
    assert r.status == "failed" and "PermissionError: sandbox:" in r.stderr, r.stderr
    assert keep.read_text() == "precious" and keep.stat().st_mode == mode


def test_work_inside_the_temp_dir_is_allowed_and_removed_afterwards():
    code = (
        "import os, shutil, tempfile, sqlite3\n"
        "os.makedirs('a/b')\nopen('a/b/f.txt', 'w').write('x')\nshutil.copy('a/b/f.txt', 'g.txt')\n"
        "os.rename('g.txt', 'h.txt')\nos.remove('h.txt')\nshutil.rmtree('a')\n"
        "fd, name = tempfile.mkstemp()\nos.close(fd)\nsqlite3.connect('db.sqlite').execute('create table t(x)')\n"
        "open('/dev/null', 'w').write('x')\nprint(os.getcwd())\n"
    )
    r = run_program(code, timeout_s=5)
    assert r.status == "passed", r.stderr
    assert not Path(r.stdout.strip()).exists()


def test_reads_numpy_and_threads_still_work():
    code = (
        "import numpy as np, threading, collections, hashlib\n"
        "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
        "print(int(np.arange(4).sum()), collections.namedtuple('P', 'x')(1), open(np.__file__).read(0) == '')\n"
    )
    r = run_program(code, timeout_s=10)
    assert r.status == "passed", r.stderr
    assert r.stdout.split() == ["thread", "6", "P(x=1)", "True"]


def test_environment_is_stripped(monkeypatch):
    monkeypatch.setenv("PARDEC_FAKE_SECRET", "hunter2")
    r = run_program("import os\nprint(sorted(os.environ))", timeout_s=5)
    assert r.status == "passed" and "PARDEC_FAKE_SECRET" not in r.stdout


def test_output_is_tailed_and_file_size_limited():
    r = run_program("print('x' * 200_000)\nprint('END')", timeout_s=5)
    assert r.status == "passed" and len(r.stdout) == TAIL_CHARS and r.stdout.endswith("END\n")
    r = run_program("import sys\nsys.stdout.write('y' * (3 << 20))", timeout_s=5, fsize_mb=1)
    assert r.status == "failed" and "File too large" in r.stderr


def test_background_child_is_killed_with_the_group():
    r = run_command(["sh", "-c", "sleep 300 & echo $!"], timeout_s=5)
    assert r.status == "passed" and r.wall_s < 2.0  # the finished leader is not kept waiting for the child
    assert _dead_soon(int(r.stdout.strip()))


def test_timeout_kills_every_process_of_the_group():
    r = run_command(["sh", "-c", "sleep 300 & echo $!; sleep 300"], timeout_s=1.0)
    assert r.status == "timeout" and r.wall_s < 3.0
    assert _dead_soon(int(r.stdout.strip()))


def test_child_in_another_process_group_is_killed_with_the_session():
    code = "import os, subprocess\nprint(subprocess.Popen(['sleep', '300'], preexec_fn=os.setpgrp).pid)"
    r = run_command([sys.executable, "-c", code], timeout_s=5)
    assert r.status == "passed", r.stderr
    assert _dead_soon(int(r.stdout.strip()))


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_program("pass", timeout_s=0)
