"""The sandbox's OS layers: namespaces (bubblewrap), seccomp, the pass marker, the fallback, and every
adversarial program of tests/metrics/adversarial.py contained. CPU only, no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pardec.metrics import sandbox
from pardec.metrics.sandbox import isolation, run_command, run_program, seccomp_filter, seccomp_prelude
from tests.metrics.adversarial import ATTACKS, EARLY_EXITS, early_exit_module, run_attack

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
ISOLATED = isolation().startswith("bwrap")
needs_bwrap = pytest.mark.skipif(not ISOLATED, reason=f"needs bubblewrap; the sandbox here is {isolation()}")
needs_seccomp = pytest.mark.skipif("seccomp" not in isolation(), reason=f"no seccomp here: {isolation()}")


@pytest.fixture(scope="module")
def victim():
    """A bystander process the attacks try to kill or trace."""
    p = subprocess.Popen(["sleep", "3600"])
    yield p.pid
    p.kill()
    p.wait()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ATTACKS))
def test_adversarial_program_is_contained_and_fails(name, victim, tmp_path):
    if ATTACKS[name][1] and not ISOLATED:
        pytest.skip(f"the guard alone does not contain it; needs bubblewrap (sandbox here: {isolation()})")
    contained, why = run_attack(name, tmp_path / "out", victim)
    assert contained, why


@pytest.mark.parametrize("name", list(EARLY_EXITS))
def test_early_exit_never_passes(name):
    code, passes_anyway = EARLY_EXITS[name]
    r = run_program(early_exit_module(code), timeout_s=5, then="check(f)")
    assert r.passed == passes_anyway, (r.status, r.returncode, r.stderr[-500:])


def test_marker_passes_only_when_the_check_returns():
    module = "def f():\n    return 42\ndef check(c):\n    assert c() == 42\n"
    assert run_program(module, timeout_s=5, then="check(f)").passed
    r = run_program(module, timeout_s=5, then="check(lambda: 0)")
    assert r.status == "failed" and "AssertionError" in r.stderr
    # output after the check does not matter; exit status 0 without the marker does
    assert run_program(module + "import atexit, os\natexit.register(os._exit, 3)\n", timeout_s=5, then="check(f)").passed
    assert not run_program(module + "print('returned deadbeef')\n", timeout_s=5, then="None and check(f) or exit(0)").passed


def test_module_threads_left_running_are_not_checked():
    module = ("import threading, time\nthreading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
              "def check(c):\n    pass\n")
    r = run_program(module, timeout_s=5, then="check(1)")
    assert r.status == "failed" and "threads still running" in r.stderr


@needs_bwrap
def test_namespaces_hide_the_host(tmp_path):
    (tmp_path / "secret.txt").write_text("s3cret")
    checkout = Path(__file__).resolve().parents[2]
    probes = ["/etc/shadow", "/etc/passwd", str(checkout / ".git" / "config"), str(checkout / "README.md"),
              os.path.expanduser("~/.bashrc"), "/home", str(tmp_path / "secret.txt")]
    code = (
        "import json, os, socket\n"
        "def probe(p):\n"
        "    try:\n"
        "        return 'read' if (open(p).read(1) if os.path.isfile(p) else os.listdir(p)) is not None else 'read'\n"
        "    except OSError as e:\n"
        "        return e.strerror\n"
        f"print(json.dumps({{p: probe(p) for p in {probes!r}}}))\n"
        f"print(json.dumps(os.listdir({os.path.expanduser('~')!r}) if os.path.isdir({os.path.expanduser('~')!r}) else []))\n"
        "print(os.getuid(), socket.gethostname(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        "print(open('/proc/self/uid_map').read().split())\n"
        "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1)\nexcept OSError as e:\n    print('net', e.errno)\n"
    )
    r = run_command([sys.executable, "-I", "-c", code], timeout_s=10)
    assert r.status == "passed", r.stderr
    first, home, second, third, fourth = r.stdout.splitlines()
    # a private root: nothing of the host's /etc, homes, checkout or temporary files; of the home directory at most
    # the way to an interpreter installed under it (pyenv)
    assert json.loads(first) == {p: "No such file or directory" for p in probes}
    home_dir = os.path.expanduser("~")
    assert set(json.loads(home)) <= {p[len(home_dir) + 1:].split("/")[0] for p in {sys.base_prefix, sys.prefix}
                                     if p.startswith(home_dir + "/")}
    uid, host, pids = second.split(" ", 2)
    assert (uid, host) == ("65534", "sandbox") and max(json.loads(pids)) < 10  # only its own few processes
    inside, outside, count = json.loads(third.replace("'", '"'))[-3:]
    assert (inside, outside, count) == ("65534", "65534", "1") or os.geteuid() != 0  # root: the host's nobody
    assert fourth.startswith("net")
    assert r.isolation.startswith("bwrap")


@needs_bwrap
def test_filesystem_is_read_only_outside_the_work_dir():
    r = run_command(["sh", "-c", "echo x > /usr/pardec_x; echo x > /etc/pardec_x; echo x > mine; cat mine"], timeout_s=5)
    assert "Read-only file system" in r.stderr and r.stdout.strip() == "x"
    assert not Path("/usr/pardec_x").exists() and not Path("/etc/pardec_x").exists()


@needs_bwrap
def test_read_back_and_ro_paths(tmp_path):
    db = tmp_path / "data.txt"  # under /tmp, hidden unless passed as ro_paths
    db.write_text("rows")
    r = run_command(["sh", "-c", f"cat {db} > copy; echo done > note"], timeout_s=5, ro_paths=(str(db),),
                    read_back=("copy", "note", "absent"))
    assert r.status == "passed" and r.files == {"copy": b"rows", "note": b"done\n"}
    r = run_command(["sh", "-c", f"cat {db}"], timeout_s=5)
    assert r.status == "failed" and "No such file" in r.stderr


@needs_seccomp
def test_seccomp_denies_processes_exec_and_pidfd_but_not_threads():
    code = seccomp_prelude() + (
        "import os, threading\n"
        "for name, call in [('fork', os.fork), ('exec', lambda: os.execv('/bin/true', ['true'])),\n"
        "                   ('pidfd', lambda: os.pidfd_open(os.getpid()))]:\n"
        "    try:\n        call()\n        print(name, 'allowed')\n"
        "    except PermissionError:\n        print(name, 'denied')\n"
        "t = threading.Thread(target=print, args=('thread ok',))\nt.start()\nt.join()\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('Seccomp:')][0])\n"
    )
    r = run_command([sys.executable, "-I", "-c", code], timeout_s=10)
    assert r.status == "passed", r.stderr
    assert r.stdout.split("\n")[:5] == ["fork denied", "exec denied", "pidfd denied", "thread ok", "2"]


def test_seccomp_filter_program():
    for machine in ("x86_64", "aarch64"):
        prog = seccomp_filter(machine)
        assert prog and len(prog) % 8 == 0 and len(prog) // 8 < 4096
    assert seccomp_filter("sparc64") is None


def test_fallback_warns_and_says_so(monkeypatch):
    monkeypatch.setenv("PARDEC_SANDBOX", "guard")
    sandbox.isolation.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="SANDBOX WITHOUT OS ISOLATION"):
            mode = isolation()
        assert "no namespaces: PARDEC_SANDBOX=guard" in mode and not mode.startswith("bwrap")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = run_program("print(6 * 7)", timeout_s=5)
        assert r.stdout.strip() == "42" and r.isolation == mode
        monkeypatch.setenv("PARDEC_SANDBOX", "chroot")
        sandbox.isolation.cache_clear()
        with pytest.raises(ValueError, match="PARDEC_SANDBOX='chroot'; valid: bwrap, guard"):
            isolation()
    finally:
        monkeypatch.undo()
        sandbox.isolation.cache_clear()
        assert isolation().startswith("bwrap") == ISOLATED


def test_missing_bwrap_when_required_is_an_error(monkeypatch):
    monkeypatch.setenv("PARDEC_SANDBOX", "bwrap")
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox.isolation.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="PARDEC_SANDBOX=bwrap but bubblewrap cannot run here: bwrap not found"):
            isolation()
    finally:
        monkeypatch.undo()
        sandbox.isolation.cache_clear()
