"""The code sandbox: outcomes, the wall clock, limits, and what the guard denies. CPU only, no network."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from pardec.metrics.sandbox import isolation, run_command, run_program
from pardec.metrics.sandbox_process import TAIL_CHARS
from tests.metrics.adversarial import TOKEN, token_processes

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _gone_soon(within_s: float = 2.0) -> bool:
    """Whether every process running ``sleep TOKEN`` is gone within ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while token_processes():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


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
    r = run_command(["sh", "-c", f"sleep {TOKEN} & echo started"], timeout_s=5)
    assert r.status == "passed" and r.stdout.strip() == "started"
    assert r.wall_s < 2.0  # the finished leader is not kept waiting for the child
    assert _gone_soon()


def test_timeout_kills_every_process_of_the_group():
    r = run_command(["sh", "-c", f"sleep {TOKEN} & sleep 300"], timeout_s=1.0)
    assert r.status == "timeout" and r.wall_s < 3.0
    assert _gone_soon()


def test_child_in_another_process_group_is_killed():
    code = f"import os, subprocess\nsubprocess.Popen(['sleep', '{TOKEN}'], preexec_fn=os.setpgrp)\nprint('ok')"
    r = run_command([sys.executable, "-c", code], timeout_s=5)
    assert r.status == "passed" and r.stdout.strip() == "ok", r.stderr
    assert _gone_soon()


@pytest.mark.skipif(not isolation().startswith("bwrap"), reason="without a PID namespace a new session escapes")
def test_child_in_another_session_is_killed_with_the_namespace():
    code = f"import subprocess\nsubprocess.Popen(['sleep', '{TOKEN}'], start_new_session=True)\nprint('ok')"
    r = run_command([sys.executable, "-c", code], timeout_s=5)
    assert r.status == "passed" and r.stdout.strip() == "ok", r.stderr
    assert _gone_soon()


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_program("pass", timeout_s=0)
