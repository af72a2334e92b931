"""The private root and the canary: a virtualenv reached through a symlink still runs in the sandbox, a killed run's
temporary directory is swept, scoring programs without bubblewrap needs the guard allowed, and a sandbox that cannot run a known-good program stops scoring with one line naming the
cause (instead of every program "failing"). Fast: a few tiny child processes, no model."""

from __future__ import annotations

import os
import sys
import venv
import warnings
from pathlib import Path

import pytest

from pardec.metrics import sandbox, sandbox_root, sql
from pardec.metrics.sandbox import SandboxError, SandboxResult, isolation

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
ISOLATED = isolation().startswith("bwrap")
MISSING = "/nonexistent/pardec-venv/bin/python"


@pytest.fixture
def canaries():
    """No canary result from an earlier test, none left for a later one."""
    sandbox.clear_canaries()
    yield
    sandbox.clear_canaries()


@pytest.fixture(params=["default", "guard"])
def mode(request, monkeypatch, canaries):
    """The isolation this machine gives (bwrap where it works), then ``PARDEC_SANDBOX=guard`` (no namespaces)."""
    if request.param == "guard":
        monkeypatch.setenv("PARDEC_SANDBOX", "guard")
    sandbox.isolation.cache_clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback's loud warning
        current = isolation()
    yield current
    monkeypatch.undo()
    sandbox.isolation.cache_clear()


def _symlinked_venv(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """A virtualenv whose real directory is reached through a symlink, as this process's interpreter: (real venv,
    the venv's path as used)."""
    real = tmp_path / "hidden" / "venvs" / "abc"
    venv.create(real, with_pip=False, symlinks=True)
    used = tmp_path / "work" / ".venv"
    used.parent.mkdir()
    used.symlink_to(real)
    monkeypatch.setattr(sys, "executable", str(used / "bin" / "python"))
    monkeypatch.setattr(sys, "prefix", str(used))
    monkeypatch.setattr(sys, "exec_prefix", str(used))
    return real, used


# ------------------------------------------------------------------------------------------ the private root
def test_the_private_root_binds_the_real_venv_and_re_creates_the_links_to_it(tmp_path, monkeypatch):
    real, used = _symlinked_venv(tmp_path, monkeypatch)
    binds, links = sandbox_root.visible_paths(["/usr"])
    assert str(real) in binds  # the venv's real directory, not (only) the symlink's path
    assert not any(str(used) == b or b.startswith(str(used) + "/") for b in binds)
    assert (str(used), str(real)) in links
    args = sandbox_root.root_args(tmp_path / "w")
    j = next(k for k in range(len(args)) if args[k:k + 3] == ["--ro-bind", str(real), str(real)])
    # every directory on the way is made 0755 first (not the host's mode), the work dir is the one writable bind
    for parent in [p for p in real.parents if str(p) not in ("/", "/tmp")]:  # the root and /tmp: tmpfs
        k = next(k for k in range(len(args)) if args[k:k + 4] == ["--perms", "0755", "--dir", str(parent)])
        assert k < j
    assert [a for k, a in enumerate(args) if args[k - 1:k] == ["--bind"]] == [str(tmp_path / "w")]
    assert "/home" not in args and "/etc" not in [a for k, a in enumerate(args) if args[k - 1:k] == ["--ro-bind"]]


def test_symlinks_on_the_way_to_the_interpreter_are_re_created(tmp_path, monkeypatch):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    interpreter = os.path.realpath(sys.executable)
    (hidden / "python").symlink_to(interpreter)  # a link leading out
    (hidden / "shims").symlink_to("python")  # a relative one leading to it
    visible = tmp_path / "bin"
    visible.mkdir()
    (visible / "python").symlink_to(hidden / "shims")
    monkeypatch.setattr(sys, "executable", str(visible / "python"))
    real, chain = sandbox_root.resolve_links(sys.executable)
    assert real == interpreter == os.path.realpath(sys.executable)
    assert chain == [(str(visible / "python"), str(hidden / "shims")), (str(hidden / "shims"), "python"),
                     (str(hidden / "python"), interpreter)]
    binds, links = sandbox_root.visible_paths([str(visible)])
    assert (str(hidden / "shims"), "python") in links and (str(hidden / "python"), interpreter) in links
    assert (str(visible / "python"), str(hidden / "shims")) not in links  # under a shown path: there as it is
    assert not any(b == str(hidden) or b.startswith(str(hidden) + "/") for b in binds)
    args = sandbox_root.root_args(tmp_path / "w")
    assert any(args[k:k + 3] == ["--symlink", "python", str(hidden / "shims")] for k in range(len(args)))


@pytest.mark.skipif(not ISOLATED, reason=f"needs bubblewrap; the sandbox here is {isolation()}")
def test_venv_reached_through_a_symlink_runs_and_without_the_bind_the_canary_says_why(tmp_path, monkeypatch,
                                                                                      canaries):
    _, used = _symlinked_venv(tmp_path, monkeypatch)
    r = sandbox.run_program("import sys\nprint(sys.prefix)\n", timeout_s=20)
    assert r.passed, r.stderr
    assert sandbox.check_programs() == isolation()
    # the defect as found: the venv's real directory not bound -> bwrap cannot exec the venv's python
    monkeypatch.setattr(sandbox_root, "visible_paths", lambda shown, ro_paths=(): ([], []))
    sandbox.clear_canaries()
    with pytest.raises(SandboxError) as e:
        sandbox.check_programs()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("sandbox canary failed: a known-good program did not pass (")
    assert "No such file or directory" in msg and "pardec.metrics.sandbox" in msg


def test_without_bubblewrap_scoring_programs_needs_the_guard_allowed(monkeypatch, canaries):
    monkeypatch.setattr(sandbox, "isolation", lambda: "seccomp+guard (no namespaces: bwrap not found)")
    monkeypatch.delenv("PARDEC_SANDBOX", raising=False)
    with pytest.raises(SandboxError, match=r"^generated code would run without OS isolation \(seccomp\+guard \(no "
                                           r"namespaces: bwrap not found\)\): install bubblewrap .* set "
                                           r"PARDEC_SANDBOX=guard to score with the in-process guard alone"):
        sandbox.check_programs()
    monkeypatch.setenv("PARDEC_SANDBOX", "guard")
    assert sandbox.check_programs().startswith("seccomp+guard")


def test_a_killed_runs_temporary_directory_is_swept_by_the_next(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(sandbox.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(sandbox.tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{sandbox.TEMP_PREFIX}{dead.pid}_abc"
    live = tmp_path / f"{sandbox.TEMP_PREFIX}{os.getppid()}_def"  # a run of a process that is still there
    for d in (stale, live):
        (d / "work").mkdir(parents=True)
    from pardec.metrics import sandbox_process

    monkeypatch.setattr(sandbox_process, "_swept", False)
    assert sandbox.run_program("print(1)\n", timeout_s=20).passed
    assert not stale.exists() and live.exists() and [p.name for p in tmp_path.iterdir()] == [live.name]


# ------------------------------------------------------------------------------------------ the canary
def test_working_sandbox_passes_the_canary_once(mode, monkeypatch):
    assert sandbox.check_programs() == mode
    assert sandbox.check_programs(memory_mb=512) == mode
    assert sql.check_sandbox() == mode
    # once per process and configuration: a second scorer start runs nothing
    monkeypatch.setattr(sandbox, "run_program", lambda *a, **k: pytest.fail("the program canary ran again"))
    monkeypatch.setattr(sql, "run_command", lambda *a, **k: pytest.fail("the SQL canary ran again"))
    assert sandbox.check_programs() == sql.check_sandbox() == mode


def test_missing_interpreter_fails_the_canary_in_one_line(mode, monkeypatch):
    monkeypatch.setattr(sys, "executable", MISSING)  # after isolation() was probed with the real one
    for check, what in ((sandbox.check_programs, "a known-good program"), (sql.check_sandbox, "a known-good query")):
        for _ in range(2):  # and again from the cache
            with pytest.raises(SandboxError) as e:
                check()
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith(f"sandbox canary failed: {what}"), msg
            assert MISSING in msg and "No such file or directory" in msg and "pardec.metrics.sandbox" in msg


def test_a_sandbox_that_fails_or_passes_everything_is_caught(monkeypatch, canaries):
    def runner(status, rc, stderr):
        return lambda *a, **k: SandboxResult(status, rc, "", stderr, 0.01)

    monkeypatch.setattr(sandbox, "run_program",
                        runner("failed", 1, "bwrap: execvp /tmp/x/bin/python: No such file or directory\n"))
    with pytest.raises(SandboxError) as e:
        sandbox.check_programs()
    assert str(e.value).startswith("sandbox canary failed: a known-good program did not pass (bwrap: execvp "
                                   "/tmp/x/bin/python: No such file or directory; failed, exit 1); ")
    sandbox.clear_canaries()
    monkeypatch.setattr(sandbox, "run_program", runner("passed", 0, ""))
    with pytest.raises(SandboxError, match="a known-bad program passed"):
        sandbox.check_programs()


def test_bwrap_required_but_missing_is_a_sandbox_error(monkeypatch, canaries):
    monkeypatch.setenv("PARDEC_SANDBOX", "bwrap")
    monkeypatch.setenv("PATH", "/nonexistent")
    sandbox.isolation.cache_clear()
    try:
        with pytest.raises(SandboxError, match="^sandbox canary failed: PARDEC_SANDBOX=bwrap but bubblewrap cannot "
                                               "run here: bwrap not found$"):
            sandbox.check_programs()
    finally:
        monkeypatch.undo()
        sandbox.isolation.cache_clear()
