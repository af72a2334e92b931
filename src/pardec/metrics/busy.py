"""Whether another process competed for the CPU while a prompt was timed (the busy-host guard).

Two model jobs on two cores slow each other 4-11x, and nothing in a run's timing shows it. A :class:`CpuMeter`
window reads, before and after the timed body, the host's busy CPU time (``/proc/stat``'s first line: every state
but idle and iowait, summed over the cores) and this process's own CPU time (``os.times``: user + system of all its
threads). What the host spent beyond this process is the others' share; divided by the wall time it is the mean
number of cores other processes used (``others_cores``). The hypervisor's ``steal`` time (a virtual machine whose
cores ran someone else) is read the same way (``steal_cores``). A window is **busy** when either exceeds
``threshold`` cores (default :data:`BUSY_CORES`) and the others' CPU time exceeds two clock ticks. A window shorter
than :data:`MIN_WINDOW_TICKS` clock ticks is below the counters' resolution (a 20 ms window beside a busy core reads
0-2 ticks): its ``busy`` is None, as where ``/proc/stat`` cannot be read (not Linux): not measured.

:func:`free_cores` is the same reading over a short sample: the cores no other process is using (``threads: auto``).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

#: a timed window is busy when other processes (or the hypervisor's steal) used more than this many cores on average
BUSY_CORES = 0.25
_TICK = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
#: a window shorter than this many clock ticks (50 ms at the usual 100 Hz) cannot say whether the host was busy
MIN_WINDOW_TICKS = 5


@dataclass(frozen=True)
class CpuSample:
    """One reading: the clock (s), the host's busy and steal CPU seconds since boot (None off Linux), and this
    process's CPU seconds."""

    t: float
    busy: float | None
    steal: float | None
    own: float


def sample(stat: str = "/proc/stat") -> CpuSample:
    own = os.times()
    busy = steal = None
    try:
        with open(stat) as f:
            fields = f.readline().split()
        if fields and fields[0] == "cpu":
            v = [int(x) for x in fields[1:]]
            v += [0] * (8 - len(v))
            # user nice system idle iowait irq softirq steal [guest guest_nice: already inside user / nice]
            busy = (v[0] + v[1] + v[2] + v[5] + v[6]) * _TICK
            steal = v[7] * _TICK
    except (OSError, ValueError):
        pass
    return CpuSample(time.perf_counter(), busy, steal, own.user + own.system)


@dataclass
class Contention:
    """A window's reading: wall time, the cores other processes used on average, the hypervisor's steal and this
    process's own, and whether it was busy (None: not measured)."""

    wall_s: float = 0.0
    others_s: float | None = None
    steal_s: float | None = None
    own_s: float = 0.0

    @property
    def others_cores(self) -> float | None:
        return None if self.others_s is None or self.wall_s <= 0 else self.others_s / self.wall_s

    @property
    def steal_cores(self) -> float | None:
        return None if self.steal_s is None or self.wall_s <= 0 else self.steal_s / self.wall_s

    def busy(self, threshold: float = BUSY_CORES) -> bool | None:
        if self.others_s is None or self.wall_s < MIN_WINDOW_TICKS * _TICK:
            return None
        others = self.others_s > 2 * _TICK and self.others_s / self.wall_s > threshold
        return others or (self.steal_s or 0.0) / self.wall_s > threshold

    def __add__(self, other: Contention) -> Contention:
        def add(a, b):
            return None if a is None or b is None else a + b

        return Contention(self.wall_s + other.wall_s, add(self.others_s, other.others_s),
                          add(self.steal_s, other.steal_s), self.own_s + other.own_s)

    def record(self, threshold: float = BUSY_CORES) -> dict:
        """The fields a results record keeps."""
        r = {"others_cores": self.others_cores, "steal_cores": self.steal_cores}
        return {k: None if v is None else round(v, 3) for k, v in r.items()} | {"busy": self.busy(threshold)}


def between(a: CpuSample, b: CpuSample) -> Contention:
    own = max(0.0, b.own - a.own)
    if a.busy is None or b.busy is None:
        return Contention(b.t - a.t, None, None, own)
    return Contention(b.t - a.t, max(0.0, (b.busy - a.busy) - own), max(0.0, b.steal - a.steal), own)


class CpuMeter:
    """Measures windows (:meth:`window`); ``stat``: the file read (tests point it elsewhere)."""

    def __init__(self, stat: str = "/proc/stat"):
        self.stat = stat

    @contextlib.contextmanager
    def window(self) -> Iterator[Contention]:
        """The yielded :class:`Contention` is filled on exit."""
        out = Contention()
        a = sample(self.stat)
        try:
            yield out
        finally:
            got = between(a, sample(self.stat))
            out.wall_s, out.others_s, out.steal_s, out.own_s = got.wall_s, got.others_s, got.steal_s, got.own_s


def free_cores(seconds: float = 0.5, stat: str = "/proc/stat") -> int:
    """The cores of this process's CPU set that no other process used over a ``seconds`` sample (at least 1): the
    set's size less the others' mean use, rounded to the nearest core. The set's size where nothing can be read."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    with CpuMeter(stat).window() as c:
        time.sleep(seconds)
    used = (c.others_cores or 0.0) + (c.steal_cores or 0.0)
    return max(1, cores - math.floor(used + 0.5))
