"""Energy per generated token through Zeus: measured from counters or "not measured" with the reason, never
estimated; the meter falls back cleanly where no counter (or no Zeus) is there."""

from __future__ import annotations

import logging
import os
import sys
from types import SimpleNamespace

import pytest

from pardec.metrics.energy import EnergyMeter, joules_per_token


class FakeMonitor:
    """A ZeusMonitor stand-in: each window reads the next of ``readings`` ((gpu, cpu, dram) J, or an exception)."""

    def __init__(self, readings, gpus=(0,), cpus=(0,)):
        self.readings = list(readings)
        self.gpu_indices, self.cpu_indices = list(gpus), list(cpus)
        self.open: set[str] = set()
        self.cancelled: list[str] = []

    def begin_window(self, key):
        assert key not in self.open
        self.open.add(key)

    def end_window(self, key, cancel=False):
        from zeus.monitor.energy import Measurement

        self.open.remove(key)
        if cancel:
            self.cancelled.append(key)
            return Measurement(0.0, {})
        r = self.readings.pop(0)
        if isinstance(r, Exception):
            raise r
        gpu, cpu, dram = r
        return Measurement(time=1.0, gpu_energy={i: gpu for i in self.gpu_indices},
                           cpu_energy={i: cpu for i in self.cpu_indices} or None,
                           dram_energy={i: dram for i in self.cpu_indices} if dram is not None else None)


@pytest.fixture
def no_counters(monkeypatch):
    """Zeus as on a machine without NVML/AMD SMI and without RAPL, whatever this machine has."""
    import zeus.device
    import zeus.device.cpu.rapl as rapl
    from zeus.device.cpu.common import ZeusCPUInitError
    from zeus.device.gpu.common import ZeusGPUInitError

    def no_gpus(*_a, **_k):
        raise ZeusGPUInitError("NVML and AMDSMI unavailable.")

    def no_cpus(*_a, **_k):
        raise ZeusCPUInitError("RAPL unavailable")

    monkeypatch.setattr(zeus.device, "get_gpus", no_gpus)
    monkeypatch.setattr(zeus.device, "get_cpus", no_cpus)
    monkeypatch.setattr(rapl, "RAPL_DIR", "/nonexistent/powercap/intel-rapl")
    monkeypatch.setattr(rapl, "CONTAINER_RAPL_DIR", "/nonexistent/zeus_sys/intel-rapl")


def _says_why(reason: str | None) -> None:
    assert reason and "GPU" in reason and "RAPL" in reason, reason


def test_this_machine_without_counters_is_not_measured():
    if os.path.exists("/sys/class/powercap") or os.path.exists("/proc/driver/nvidia"):
        pytest.skip("this machine has energy counters")
    meter = EnergyMeter.create()
    assert meter.available is False and meter.devices == ""
    _says_why(meter.reason)
    assert "NVML" in meter.reason and "/sys/class/powercap" in meter.reason
    with meter.window("ar") as w:
        pass
    assert w.joules is None and w.by_device == {} and w.reason == meter.reason
    assert meter.status() == {"measured": False, "reason": meter.reason, "devices": ""}


def test_no_counters_falls_back_cleanly(no_counters, caplog):
    with caplog.at_level(logging.WARNING):
        meter = EnergyMeter.create()
    assert not meter.available
    _says_why(meter.reason)
    assert "no RAPL counters" in meter.reason and "missing" in meter.reason
    assert not [r for r in caplog.records if r.name.startswith("zeus")]  # Zeus's probing stays quiet
    with meter.window() as w:
        pass
    assert w.joules is None


def test_zeus_missing_is_not_measured(monkeypatch):
    monkeypatch.setitem(sys.modules, "zeus.monitor", None)  # `from zeus.monitor import ...` -> ImportError
    meter = EnergyMeter.create()
    assert not meter.available and "Zeus library is missing" in meter.reason
    with meter.window() as w:
        pass
    assert w.joules is None


def test_disabled():
    meter = EnergyMeter.create(enabled=False)
    assert not meter.available and "disabled" in meter.reason


def test_create_monitors_the_probed_counters(monkeypatch):
    import zeus.monitor

    import pardec.metrics.energy as energy

    made = {}

    class Monitor(FakeMonitor):
        def __init__(self, gpu_indices=None, cpu_indices=None, approx_instant_energy=False, **kw):
            made.update(gpu_indices=gpu_indices, cpu_indices=cpu_indices, approx=approx_instant_energy, **kw)
            super().__init__([(2.0, 1.0, 0.5)], gpus=gpu_indices, cpus=[0] if cpu_indices is None else cpu_indices)

    monkeypatch.setattr(zeus.monitor, "ZeusMonitor", Monitor)
    monkeypatch.setattr(energy, "_probe_gpus", lambda wanted: ([0], "gpu0 (NVML)", None))
    monkeypatch.setattr(energy, "_probe_cpus", lambda: (True, "cpu0 (RAPL package+dram)", None))
    meter = EnergyMeter.create(gpus=[0])
    assert meter.available and meter.reason is None and meter.devices == "gpu0 (NVML), cpu0 (RAPL package+dram)"
    assert made["approx"] is False and made["gpu_indices"] == [0]  # never Zeus's power x time approximation
    with meter.window() as w:
        pass
    assert w.joules == 3.5
    assert meter.status() == {"measured": True, "reason": None, "devices": meter.devices}
    # a GPU but no RAPL: measured, and the status says what is not counted
    monkeypatch.setattr(energy, "_probe_cpus", lambda: (False, "", "no RAPL counters (/sys/class/powercap missing)"))
    meter = EnergyMeter.create(gpus=[0])
    assert meter.available and meter.reason == "CPU not counted: no RAPL counters (/sys/class/powercap missing)"
    assert made["cpu_indices"] == []


def test_window_sums_gpu_cpu_and_dram_exactly():
    meter = EnergyMeter(FakeMonitor([(10.5, 3.25, 0.25), (1.0, 2.0, None)], gpus=[0, 1], cpus=[0]))
    with meter.window("sps") as w:
        pass
    assert w.by_device == {"gpu0": 10.5, "gpu1": 10.5, "cpu0": 3.25, "dram0": 0.25}
    assert w.joules == 24.5 and w.reason is None
    with meter.window("sps") as w:  # no DRAM zone: package and GPUs only
        pass
    assert w.joules == 4.0 and w.by_device == {"gpu0": 1.0, "gpu1": 1.0, "cpu0": 2.0}


def test_failed_or_stale_windows_are_not_measured_and_logged_once(caplog):
    mon = FakeMonitor([RuntimeError("NVML lost the GPU"), (0.0, 1.0, None), (5.0, -1.0, None), (2.0, 1.0, None)])
    meter = EnergyMeter(mon)
    with caplog.at_level(logging.WARNING, logger="pardec.energy"):
        readings = []
        for _ in range(4):
            with meter.window() as w:
                pass
            readings.append(w)
    assert [r.joules for r in readings] == [None, None, None, 3.0]
    assert "NVML lost the GPU" in readings[0].reason
    assert "did not advance" in readings[1].reason  # a GPU reading of 0 J is the counter's period, not 0 J
    assert "invalid" in readings[2].reason
    assert len([r for r in caplog.records if r.name == "pardec.energy"]) == 1
    assert meter.available and "NVML lost the GPU" in meter.status()["reason"]


def test_an_exception_in_the_window_cancels_it_and_goes_on():
    mon = FakeMonitor([])
    meter = EnergyMeter(mon)
    with pytest.raises(ValueError, match="boom"), meter.window() as w:
        raise ValueError("boom")
    assert w.joules is None and len(mon.cancelled) == 1 and not mon.open


def test_joules_per_token_is_total_over_total_or_none():
    recs = [{"n_tokens": 10, "energy_j": 2.0}, {"n_tokens": 30, "energy_j": 6.0}]
    assert joules_per_token(recs) == 8.0 / 40
    assert joules_per_token(recs + [{"n_tokens": 5, "energy_j": None}]) is None  # never a partial estimate
    assert joules_per_token(recs + [{"n_tokens": 5}]) is None  # a record made before energy was measured
    assert joules_per_token([]) is None
    assert joules_per_token([{"n_tokens": 0, "energy_j": 1.0}]) is None


def _one_doc(meter, readings_turns: int = 2):
    """`run_document` on a fake 2-turn task with a fake decoder."""
    from pardec.evaluation import run_document

    task = SimpleNamespace(n_turns=readings_turns, prompt_ids=lambda doc, tok, chat, hist: [1, 2, 3],
                           score=lambda doc, hist: {"pass": 1.0})
    res = SimpleNamespace(tokens=[5, 6], accepted=[1, 1], extras={}, target_forwards=2, draft_forwards=0,
                          total_s=0.1, prefill_s=0.01, draft_s=0.0, drafted=0, draft_accepted=0)
    dec = SimpleNamespace(name="ar", generate=lambda *a: res)
    stopper = SimpleNamespace(final_text=lambda toks: "x")
    return run_document(task, {"id": "0"}, dec, None, False, stopper, None, 2, 100, None, None, meter=meter)


def test_records_sum_turns_and_are_none_if_one_turn_is_not():
    rec = _one_doc(EnergyMeter(FakeMonitor([(1.0, 0.5, 0.25), (2.0, 0.5, 0.25)])))
    assert rec["energy_j"] == 4.5 and rec["energy_by_device"] == {"gpu0": 3.0, "cpu0": 1.0, "dram0": 0.5}
    rec = _one_doc(EnergyMeter(FakeMonitor([(1.0, 0.5, 0.25), RuntimeError("gone")])))
    assert rec["energy_j"] is None and rec["energy_by_device"] == {}
    rec = _one_doc(None)
    assert rec["energy_j"] is None and rec["energy_by_device"] == {}


def test_energy_config_is_validated():
    from pardec.config import ConfigError
    from pardec.evaluation import validate
    from tests.evaluation.helpers import cfg_of

    assert validate(cfg_of("+method=ar", "model=tiny_random")).energy == {"enabled": True}
    assert validate(cfg_of("+method=ar", "model=tiny_random", "energy.enabled=false")).energy == {"enabled": False}
    with pytest.raises(ConfigError, match="energy.enabled='maybe' must be bool"):
        validate(cfg_of("+method=ar", "model=tiny_random", "energy.enabled=maybe"))


def test_evaluate_without_counters_says_not_measured(no_counters, tmp_path, capsys):
    from pardec.evaluation import format_comparison, run
    from tests.evaluation.helpers import TINY, cfg_of, lines

    s = run(cfg_of("+method=pld", *TINY, "n_samples=1", "max_new_tokens=4", "perplexity.enabled=false"), tmp_path)
    printed = capsys.readouterr().out
    assert s["energy"]["measured"] is False
    _says_why(s["energy"]["reason"])
    assert s["energy_j_per_token"] is None and s["baseline_energy_j_per_token"] is None
    assert f"not measured: {s['energy']['reason']}" in printed
    assert "energy J/token" in format_comparison(s)
    assert all(r["energy_j"] is None and r["energy_by_device"] == {} for r in lines(tmp_path))
