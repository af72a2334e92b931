"""One writer per run dir (pardec.runlock.run_dir_lock) and ranks that die with their launcher (die_with_parent),
with real processes: a second writer stops in one line naming the dir and the owner, in evaluate and in training;
a lock left by a process killed with -9 is taken over with one warning; a child whose launcher is killed with -9
dies with it."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pardec.evaluation import run as evaluate
from pardec.runlock import RunDirBusy, lock_path, run_dir_lock
from pardec.train import run as train
from tests.evaluation.helpers import TINY, cfg_of

ROOT = Path(__file__).resolve().parents[1]


def _wait_for(cond, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


def _holder(run_dir: Path) -> subprocess.Popen:
    """Another process that takes the run dir's lock and keeps it until killed."""
    code = f"from pardec.runlock import run_dir_lock\nimport time\nwith run_dir_lock({str(run_dir)!r}):\n" \
           f"    print('held', flush=True)\n    time.sleep(600)\n"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "held"
    return p


def test_a_second_writer_stops_in_one_line_naming_the_dir_and_the_owner(tmp_path):
    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir) as path:
        assert path == lock_path(run_dir) and f"pid {os.getpid()}" in path.read_text()
        with pytest.raises(RunDirBusy) as e, run_dir_lock(run_dir):
            pass
        msg = str(e.value)
        assert "\n" not in msg and str(run_dir) in msg and f"pid {os.getpid()}" in msg
        with run_dir_lock(run_dir, rank=1) as other:  # each rank its own lock
            assert other.name == ".lock-rank1"
    assert not run_dir.exists()  # a clean exit leaves nothing where there was nothing


def test_a_lock_left_by_a_killed_process_is_taken_over_with_one_warning(tmp_path, caplog):
    run_dir = tmp_path / "run"
    p = _holder(run_dir)
    with pytest.raises(RunDirBusy, match=f"pid {p.pid} on "):
        with run_dir_lock(run_dir):
            pass
    p.kill()
    p.wait()
    assert f"pid {p.pid}" in lock_path(run_dir).read_text()  # left behind by the kill
    with caplog.at_level(logging.WARNING, logger="pardec.runlock"), run_dir_lock(run_dir) as path:
        assert f"pid {os.getpid()}" in path.read_text()
    warned = [r.getMessage() for r in caplog.records if "took over" in r.getMessage()]
    assert len(warned) == 1 and f"pid {p.pid}" in warned[0]


def test_evaluate_and_training_refuse_a_run_dir_another_process_writes(tmp_path):
    run_dir = tmp_path / "eval"
    evaluate(cfg_of("+method=pld", *TINY[:2], "max_new_tokens=4", "bench.warmup=0"), run_dir)
    p = _holder(run_dir)
    try:
        with pytest.raises(RunDirBusy, match="is being written by another run"):
            evaluate(cfg_of("+method=pld", *TINY[:2], "max_new_tokens=4", "bench.warmup=0", "resume=true"), run_dir)
        from tests.training.test_train_app import _compose

        with pytest.raises(RunDirBusy, match="is being written by another run"):
            train(_compose(["+experiment=heads_medusa_tiny", f"paths.data_dir={tmp_path}/data",
                            f"paths.output_dir={tmp_path}/out"]), run_dir)
        assert not (tmp_path / "data").exists()  # refused before the generate stage wrote anything
    finally:
        p.kill()
        p.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_rank_dies_with_its_launcher(tmp_path):
    """A launcher starts a child that asks to die with it (as every rank under torchrun does); kill -9 of the
    launcher ends the child, which therefore never writes its file."""
    marker = tmp_path / "written"
    child = textwrap.dedent(f"""
        import os, time
        from pardec.runlock import die_with_parent
        assert die_with_parent()
        print(os.getpid(), flush=True)
        time.sleep(3)
        open({str(marker)!r}, "w").write("the launcher was killed, yet this rank wrote")
    """)
    launcher = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {child!r}])\n"
    p = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    rank = int(p.stdout.readline())
    os.kill(p.pid, signal.SIGKILL)
    p.wait()

    def gone() -> bool:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            return True
        # a zombie (reaped by init soon) counts as gone
        return Path(f"/proc/{rank}/stat").read_text().split(")")[-1].split()[0] == "Z"

    _wait_for(gone, timeout=10)
    time.sleep(3.5)
    assert not marker.exists()
