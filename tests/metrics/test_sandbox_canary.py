"""The interpreter's paths and the canary: a virtualenv reached through a symlink into a hidden directory still
runs in the sandbox, and a sandbox that cannot run a known-good program stops scoring with one line naming the
cause (instead of every program "failing"). Fast: a few tiny child processes, no model."""

from __future__ import annotations

import os
import sys
import venv
import warnings
from pathlib import Path

import pytest

from pardec.metrics import sandbox, sql
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


def _symlinked_venv(tmp_path: Path, monkeypatch) -> tuple[Path, Path, Path]:
    """A virtualenv whose real directory lies in a hidden directory, used through a symlink outside it, as this
    process's interpreter: (hidden dir, real venv, the venv's path as used)."""
    hidden = tmp_path / "hidden"
    real = hidden / "venvs" / "abc"
    venv.create(real, with_pip=False, symlinks=True)
    used = tmp_path / "work" / ".venv"
    used.parent.mkdir()
    used.symlink_to(real)
    # /tmp (where tmp_path usually is) stays visible; the new directory is hidden instead
    monkeypatch.setattr(sandbox, "HIDDEN_DIRS", (*(d for d in sandbox.HIDDEN_DIRS if d != "/tmp"), str(hidden)))
    monkeypatch.setattr(sys, "executable", str(used / "bin" / "python"))
    monkeypatch.setattr(sys, "prefix", str(used))
    monkeypatch.setattr(sys, "exec_prefix", str(used))
    return hidden, real, used


# ------------------------------------------------------------------------------------------ interpreter paths
def test_bind_list_resolves_a_venv_symlinked_into_a_hidden_dir(tmp_path, monkeypatch):
    hidden, real, used = _symlinked_venv(tmp_path, monkeypatch)
    binds, links = sandbox.visible_paths([str(hidden)])
    assert str(real) in binds  # the venv's real directory, not (only) the symlink's path
    assert not any(str(used) == b or b.startswith(str(used) + "/") for b in binds)
    args = sandbox.bwrap_args(tmp_path / "w")
    i = args.index("--tmpfs", args.index(str(hidden)) - 1)
    assert args[i:i + 2] == ["--tmpfs", str(hidden)]
    j = next(k for k in range(len(args)) if args[k:k + 3] == ["--ro-bind", str(real), str(real)])
    assert j > i  # bound after the directory was hidden


def test_symlinks_inside_a_hidden_dir_are_re_created(tmp_path, monkeypatch):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    interpreter = os.path.realpath(sys.executable)
    (hidden / "python").symlink_to(interpreter)  # a link in the hidden dir, leading out
    (hidden / "shims").symlink_to("python")  # a relative one leading to it
    visible = tmp_path / "bin"
    visible.mkdir()
    (visible / "python").symlink_to(hidden / "shims")
    monkeypatch.setattr(sys, "executable", str(visible / "python"))
    real, chain = sandbox.resolve_links(sys.executable)
    assert real == interpreter == os.path.realpath(sys.executable)
    assert chain == [(str(visible / "python"), str(hidden / "shims")), (str(hidden / "shims"), "python"),
                     (str(hidden / "python"), interpreter)]
    binds, links = sandbox.visible_paths([str(hidden)])
    assert (str(hidden / "shims"), "python") in links and (str(hidden / "python"), interpreter) in links
    assert (str(visible / "python"), str(hidden / "shims")) not in links  # not in a hidden dir: visible as it is
    assert not any(b == str(hidden) or b.startswith(str(hidden) + "/") for b in binds)
    args = sandbox.bwrap_args(tmp_path / "w")
    assert any(args[k:k + 3] == ["--symlink", "python", str(hidden / "shims")] for k in range(len(args)))


@pytest.mark.skipif(not ISOLATED, reason=f"needs bubblewrap; the sandbox here is {isolation()}")
def test_venv_symlinked_into_a_hidden_dir_runs_and_without_the_bind_the_canary_says_why(tmp_path, monkeypatch,
                                                                                        canaries):
    _, _, used = _symlinked_venv(tmp_path, monkeypatch)
    r = sandbox.run_program("import sys\nprint(sys.prefix)\n", timeout_s=20)
    assert r.passed, r.stderr
    assert sandbox.check_programs() == isolation()
    # the defect as found: nothing of the hidden directory bound -> bwrap cannot exec the venv's python
    monkeypatch.setattr(sandbox, "visible_paths", lambda hidden, ro_paths=(): ([], []))
    sandbox.clear_canaries()
    with pytest.raises(SandboxError) as e:
        sandbox.check_programs()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("sandbox canary failed: a known-good program did not pass (bwrap: ")
    assert f"{used}/bin/python: No such file or directory" in msg and "pardec.metrics.sandbox" in msg


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
