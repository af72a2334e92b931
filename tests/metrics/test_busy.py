"""The busy-host guard (pardec.metrics.busy): a window reads what other processes and the hypervisor took of the CPU
(from /proc/stat, faked here where the figure must be exact), a competing busy process makes the mark appear in a
real window and in an evaluate run's records, summary and printed table, and ``threads: auto`` leaves its core out.
By behaviour only: nothing here times anything."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pardec.config import ConfigError
from pardec.evaluation import run
from pardec.evaluation.tables import format_table
from pardec.metrics.busy import BUSY_CORES, MIN_WINDOW_TICKS, Contention, CpuMeter, free_cores
from tests.evaluation.helpers import TINY, cfg_of, lines

TICK = 1.0 / os.sysconf("SC_CLK_TCK")


def _stat(path: Path, busy_ticks: int, steal_ticks: int = 0) -> None:
    # user nice system idle iowait irq softirq steal
    path.write_text(f"cpu  {busy_ticks} 0 0 100000 7 0 0 {steal_ticks} 0 0\ncpu0 0 0 0 0 0 0 0 0 0 0\n")


def test_a_window_counts_what_others_used_beyond_this_process(tmp_path):
    stat = tmp_path / "stat"
    _stat(stat, 1000)
    with CpuMeter(str(stat)).window() as c:
        time.sleep(0.06)
        _stat(stat, 1000 + round(2.0 / TICK))  # the host was busy 2 CPU-seconds more; this process ~0 of them
    assert c.others_s == pytest.approx(2.0 - c.own_s, abs=2 * TICK) and c.others_cores > 10
    assert c.busy() is True and c.record()["busy"] is True
    _stat(stat, 1000)
    with CpuMeter(str(stat)).window() as c:
        time.sleep(0.06)
    assert c.others_s == 0.0 and c.busy() is False and c.record() == {"others_cores": 0.0, "steal_cores": 0.0,
                                                                      "busy": False}
    with CpuMeter(str(stat)).window() as c:
        _stat(stat, 1000 + round(2.0 / TICK))  # a window shorter than the counters' resolution says nothing
    assert c.wall_s < MIN_WINDOW_TICKS * TICK and c.busy() is None and c.record()["busy"] is None
    with CpuMeter(str(stat)).window() as c:
        time.sleep(0.06)
        _stat(stat, 1000, steal_ticks=round(1.0 / TICK))  # the hypervisor ran someone else on these cores
    assert c.others_s == 0.0 and c.steal_cores > 1 and c.busy() is True


def test_unreadable_counters_measure_nothing(tmp_path):
    with CpuMeter(str(tmp_path / "absent")).window() as c:
        pass
    assert c.others_s is None and c.busy() is None and c.record()["busy"] is None
    assert (Contention(1.0, 0.0, 0.0, 1.0) + c).busy() is None  # a record with one unmeasured turn is unmeasured
    assert Contention(2.0, 0.2 * 2, 0.0, 1.0).busy() is (0.2 > BUSY_CORES)


@pytest.fixture
def spinner():
    """Another process that keeps one core busy until the test ends."""
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.3)
    yield p
    p.kill()
    p.wait()


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_a_competing_process_marks_the_window_and_takes_a_core_from_auto(spinner):
    with CpuMeter().window() as c:
        time.sleep(0.5)
    assert c.others_cores > 0.5 and c.busy() is True
    cores = len(os.sched_getaffinity(0))
    assert 1 <= free_cores(0.3) <= max(1, cores - 1)


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_an_evaluate_run_beside_a_busy_process_says_so(tmp_path, spinner):
    # 160 tokens a prompt: every record's window spans many clock ticks (12 tokens of the tiny model, ~20 ms, are
    # below the counters' resolution and read as not measured)
    summary = run(cfg_of("+method=pld", *TINY, "max_new_tokens=160"), tmp_path)
    recs = lines(tmp_path)
    assert all(r["busy"] is True and r["others_cores"] > BUSY_CORES for r in recs)
    busy = summary["busy"]
    assert busy["measured"] and busy["records"] == busy["of"] == len(recs) == 6
    assert busy["by_role"] == {"baseline": 3, "method": 3} and busy["threshold_cores"] == BUSY_CORES
    assert re.search(r"\nBUSY host +6 of 6 timed records ran while other processes used > 0.25 cores: their timing is "
                     r"disturbed \(baseline 3, method 3\)\n", format_table(summary))


def test_threads_auto_or_an_integer(tmp_path):
    with pytest.raises(ConfigError, match=r"threads='many' is not valid: give an integer >= 1 or auto"):
        run(cfg_of("+method=pld", "threads=many", *TINY), tmp_path / "bad")
    summary = run(cfg_of("+method=pld", "threads=auto", "model=tiny_random", "n_samples=1", "max_new_tokens=4",
                         "bench.warmup=0"), tmp_path / "auto")
    assert summary["threads_setting"] == "auto" and 1 <= summary["threads"] <= len(os.sched_getaffinity(0))
    assert summary["busy"]["of"] == 2 and "busy" in lines(tmp_path / "auto")[0]
