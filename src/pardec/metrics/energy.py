"""Energy of each generation, read from hardware energy counters through Zeus (https://ml.energy/zeus).

One :class:`EnergyMeter` per evaluation run (:meth:`EnergyMeter.create`); ``with meter.window("name") as w:``
around one ``decoder.generate(...)`` call fills ``w.joules`` on exit. What a window sums (``w.by_device``):

* ``gpu<i>``: the increase of GPU ``i``'s cumulative energy counter (NVML ``nvmlDeviceGetTotalEnergyConsumption``,
  Volta or newer; AMD SMI's energy counter), for the GPUs the models run on. A GPU without such a counter
  (pre-Volta) is not counted: Zeus would integrate sampled power there, which is not a counter reading;
* ``cpu<i>``: the increase of RAPL package ``i``'s energy counter (cores, caches, uncore of the socket);
* ``dram<i>``: the increase of that package's RAPL DRAM sub-zone, where RAPL exposes one.

``w.joules`` is their sum. Nothing else is counted (SoC readings, PSU losses, fans, disks, other GPUs). RAPL
counters are socket-wide: they include whatever else runs on the machine meanwhile.

Nothing is ever estimated (no TDP x time, no instantaneous power x time, Zeus's ``approx_instant_energy`` stays
off): where no counter can be read (no GPU and no RAPL, as in most containers; the Zeus library missing; the
meter disabled) :attr:`EnergyMeter.reason` says why and every window gives ``joules=None``. A window whose
reading fails, or in which a GPU counter did not advance (a window shorter than the counter's update period),
gives ``joules=None`` too, and the first such reason is logged once and kept in :attr:`EnergyMeter.window_error`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("pardec.energy")


@dataclass
class EnergyReading:
    """One window's energy: ``joules`` (sum of ``by_device``, J) or None with ``reason``."""

    joules: float | None = None
    by_device: dict[str, float] = field(default_factory=dict)
    reason: str | None = None


@contextlib.contextmanager
def _quiet_zeus() -> Iterator[None]:
    """Zeus logs (and warns) about every library it probes and does not find; the meter reports that itself."""
    zlog = logging.getLogger("zeus")
    level = zlog.level
    zlog.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        zlog.setLevel(level)


def _nvml_why() -> str:
    """Why NVML gives no GPU, in NVML's own words."""
    try:
        import pynvml  # optional: pynvml
    except ImportError:
        return "NVML: nvidia-ml-py not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # pynvml.NVMLError, e.g. "NVML Shared Library Not Found"
        return f"NVML: {e}"
    try:
        n = pynvml.nvmlDeviceGetCount()
    except Exception as e:
        return f"NVML: {e}"
    return "NVML: no NVIDIA GPU" if n == 0 else f"NVML: {n} GPU(s) but Zeus could not open them"


def _probe_gpus(wanted: Iterable[int] | None) -> tuple[list[int], str, str | None]:
    """(GPU indices with an energy counter to monitor, what they are, why GPUs are not counted or None)."""
    from zeus.device import get_gpus  # heavy: zeus
    from zeus.device.gpu.common import ZeusGPUInitError  # heavy: zeus

    try:
        gpus = get_gpus()
    except ZeusGPUInitError:
        return [], "", f"no GPU energy counter ({_nvml_why()}; AMD SMI: unavailable)"
    except Exception as e:  # e.g. an unofficial pynvml package
        return [], "", f"no GPU energy counter (the GPU library failed: {type(e).__name__}: {e})"
    kind = "NVML" if type(gpus).__name__.startswith("NVIDIA") else "AMD SMI"
    visible = list(range(len(gpus)))
    if not visible:
        return [], "", f"no GPU energy counter ({kind} sees no GPU)"
    used = visible if wanted is None else sorted(set(wanted) & set(visible))
    if not used:
        return [], "", "no GPU in use (the models run on the CPU)"
    counted = [i for i in used if gpus.supports_get_total_energy_consumption(i)]
    lacking = [i for i in used if i not in counted]
    why = f"gpu{', gpu'.join(map(str, lacking))} without an energy counter (pre-Volta)" if lacking else None
    return counted, ", ".join(f"gpu{i} ({kind})" for i in counted), why


def _probe_cpus() -> tuple[bool, str, str | None]:
    """(RAPL readable, what is counted, why the CPU is not counted or None)."""
    from zeus.device import get_cpus  # heavy: zeus
    from zeus.device.cpu.common import ZeusCPUInitError, ZeusCPUNoPermissionError  # heavy: zeus
    from zeus.device.cpu.rapl import CONTAINER_RAPL_DIR, RAPL_DIR  # heavy: zeus

    try:
        cpus = get_cpus()
    except ZeusCPUNoPermissionError as e:
        return False, "", f"RAPL counters not readable ({e}; reading them needs root or the Zeus daemon)"
    except ZeusCPUInitError as e:
        if not (os.path.exists(RAPL_DIR) or os.path.exists(CONTAINER_RAPL_DIR)):
            missing = "/sys/class/powercap missing" if not os.path.exists("/sys/class/powercap") else f"{RAPL_DIR} missing"
            return False, "", f"no RAPL counters ({missing})"
        return False, "", f"no RAPL counters ({e})"
    except Exception as e:
        return False, "", f"no RAPL counters ({type(e).__name__}: {e})"
    if not len(cpus):
        return False, "", "no RAPL counters (RAPL lists no CPU package)"
    parts = []
    for i in range(len(cpus)):
        dram = cpus.supports_get_dram_energy_consumption(i)
        parts.append(f"cpu{i} (RAPL package{'+dram' if dram else ''})")
    return True, ", ".join(parts), None


class EnergyMeter:
    """Energy counters for a run: ``available`` (some counter is read), ``reason`` (why nothing, or what is not
    counted; None when everything is), ``devices`` (what a window sums, e.g. ``gpu0 (NVML), cpu0 (RAPL
    package+dram)``). ``monitor`` is a ``zeus.monitor.ZeusMonitor`` or anything with its ``begin_window`` /
    ``end_window``; None means not measured."""

    def __init__(self, monitor: Any = None, reason: str | None = None, devices: str | None = None):
        self.monitor = monitor
        self.reason = reason if monitor is not None or reason else "no energy meter"
        gpus, cpus = list(getattr(monitor, "gpu_indices", [])), list(getattr(monitor, "cpu_indices", []))
        self._expected = {f"gpu{i}" for i in gpus} | {f"cpu{i}" for i in cpus}
        if devices is None:
            devices = ", ".join([f"gpu{i}" for i in gpus] + [f"cpu{i}" for i in cpus]) if monitor is not None else ""
        self.devices = devices
        self.window_error: str | None = None  # the first window that could not be measured, and why
        self._ids = itertools.count()

    @property
    def available(self) -> bool:
        return self.monitor is not None

    @classmethod
    def create(cls, enabled: bool = True, gpus: Iterable[int] | None = None) -> EnergyMeter:
        """A meter over the GPUs ``gpus`` (CUDA indices the models run on; None = every visible GPU) and every RAPL
        CPU package; never raises: where Zeus is missing or no counter can be read, ``available`` is False and
        ``reason`` says why."""
        if not enabled:
            return cls(None, "disabled (energy.enabled=false)")
        try:
            with _quiet_zeus():
                from zeus.monitor import ZeusMonitor  # optional: zeus
        except ImportError as e:
            return cls(None, f"the Zeus library is missing ({type(e).__name__}: {e}); install it: pip install zeus")
        try:
            with _quiet_zeus():
                gpu_idx, gpu_devs, gpu_why = _probe_gpus(gpus)
                cpu_ok, cpu_devs, cpu_why = _probe_cpus()
                if not gpu_idx and not cpu_ok:
                    return cls(None, f"{gpu_why} and {cpu_why}")
                monitor = ZeusMonitor(gpu_indices=gpu_idx, cpu_indices=None if cpu_ok else [],
                                      approx_instant_energy=False, sync_execution_with="torch")
        except Exception as e:
            return cls(None, f"Zeus could not start ({type(e).__name__}: {e})")
        not_counted = [f"GPU not counted: {gpu_why}"] if gpu_why else []
        not_counted += [f"CPU not counted: {cpu_why}"] if cpu_why else []
        return cls(monitor, "; ".join(not_counted) or None, ", ".join(d for d in (gpu_devs, cpu_devs) if d))

    def status(self) -> dict[str, Any]:
        """``{"measured", "reason", "devices"}`` for the summary."""
        reason = "; ".join(x for x in (self.reason, self.window_error) if x) or None
        return {"measured": self.available, "reason": reason, "devices": self.devices}

    @contextlib.contextmanager
    def window(self, name: str = "generate") -> Iterator[EnergyReading]:
        """Measure the body; the yielded reading is filled on exit (``joules`` None where not measured). Never
        raises on a measurement failure; an exception of the body cancels the window and goes on."""
        reading = EnergyReading(reason=self.reason if self.monitor is None else None)
        if self.monitor is None:
            yield reading
            return
        key = f"pardec:{name}:{next(self._ids)}"
        try:
            with _quiet_zeus():
                self.monitor.begin_window(key)
            began = True
        except Exception as e:
            self._fail(reading, f"begin_window failed ({type(e).__name__}: {e})")
            began = False
        if not began:
            yield reading
            return
        done = False
        try:
            yield reading
            done = True
        finally:
            if done:
                self._end(key, reading)
            else:
                reading.reason = "the measured code raised"
                with contextlib.suppress(Exception), _quiet_zeus():
                    self.monitor.end_window(key, cancel=True)

    def _end(self, key: str, reading: EnergyReading) -> None:
        try:
            with _quiet_zeus():  # Zeus warns of a GPU reading of zero: refused below
                m = self.monitor.end_window(key)
        except Exception as e:
            self._fail(reading, f"end_window failed ({type(e).__name__}: {e})")
            return
        by: dict[str, float] = {}
        for prefix, values in (("gpu", m.gpu_energy), ("cpu", m.cpu_energy), ("dram", m.dram_energy)):
            by.update({f"{prefix}{i}": float(j) for i, j in (values or {}).items()})
        reading.by_device = by
        invalid = [k for k, v in by.items() if not math.isfinite(v) or v < 0]
        stale = [k for k, v in by.items() if k.startswith("gpu") and v == 0.0]
        missing = sorted(self._expected - by.keys())
        if not by:
            self._fail(reading, "no counter reading came back")
        elif missing:
            self._fail(reading, f"no reading of {', '.join(missing)}")
        elif invalid:
            self._fail(reading, f"invalid counter reading of {', '.join(invalid)}: {[by[k] for k in invalid]}")
        elif stale:
            self._fail(reading, f"the energy counter of {', '.join(stale)} did not advance (a window shorter than "
                                "its update period)")
        else:
            reading.joules = sum(by.values())

    def _fail(self, reading: EnergyReading, why: str) -> None:
        reading.joules, reading.reason = None, why
        if self.window_error is None:
            self.window_error = f"some generations not measured: {why}"
            log.warning("energy not measured for a generation: %s (further failures are not logged)", why)


def joules_per_token(records: list[dict]) -> float | None:
    """Total ``energy_j`` over total ``n_tokens`` of ``records``; None when there are none, no tokens, or any
    record was not measured (never a partial sum)."""
    if not records or any(r.get("energy_j") is None for r in records):
        return None
    tokens = sum(r.get("n_tokens") or 0 for r in records)
    return sum(r["energy_j"] for r in records) / tokens if tokens else None
