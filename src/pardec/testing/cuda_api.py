"""The ``torch.cuda`` and ``torch.accelerator`` functions :class:`~pardec.testing.devices.VirtualCUDA` stands in for
while it is active (on a CPU build they would fail: no CUDA runtime), answered for its virtual devices as a GPU node
would answer them: availability and count, the current device, generators that say their device, RNG states per
device, host syncs (counted), events on the host clock, free memory as the mode says (allocation counters read 0:
nothing is allocated on a virtual device)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import torch


class DeviceMismatchError(RuntimeError):
    """Tensors of different (virtual) devices met in one call: a real GPU run would fail here."""


def as_device(d: Any) -> torch.device:
    if isinstance(d, int) and not isinstance(d, bool):  # device=1 means cuda:1 (no accelerator to ask on a CPU build)
        return torch.device("cuda", d)
    d = torch.device(d) if not isinstance(d, torch.device) else d
    return torch.device("cuda", 0) if d.type == "cuda" and d.index is None else d


#: the total memory a virtual device reports (an 80 GB GPU's), or its free memory where that is more
TOTAL_MEMORY = 80 << 30


def stand_ins(mode) -> list[tuple[Any, str, Any]]:
    """(owner, attribute, stand-in) for each function ``mode`` (a VirtualCUDA) replaces while it is active."""
    class VirtualGenerator(torch.Generator):
        """A CPU generator that says which device it was made for."""

        def __new__(cls, device: Any = "cpu"):
            g = super().__new__(cls)
            g.virtual_device = as_device(device)
            return g

        def __init__(self, device: Any = "cpu") -> None:
            super().__init__()

        @property
        def device(self) -> torch.device:
            return self.virtual_device

    def synchronize(device: Any = None) -> None:
        mode.syncs["cuda.synchronize"] += 1

    class VirtualEvent:
        """``torch.cuda.Event``: ``record`` reads the host clock (a CPU run has no queue), ``synchronize`` is a counted
        host sync, ``elapsed_time`` in milliseconds as CUDA's."""

        def __init__(self, enable_timing: bool = False, **_: Any) -> None:
            self.t: float | None = None

        def record(self, stream: Any = None) -> None:
            self.t = time.perf_counter()

        def synchronize(self) -> None:
            mode.syncs["cuda.Event.synchronize"] += 1

        def elapsed_time(self, end: VirtualEvent) -> float:
            if self.t is None or end.t is None:
                raise RuntimeError("elapsed_time of an event that was not recorded")
            return (end.t - self.t) * 1e3

    rng_states: dict[int, torch.Tensor] = {}  # each virtual device's default generator state

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return rng_states.setdefault(as_device(device).index, torch.get_rng_state()).clone()

    def set_rng_state(state: torch.Tensor, device: Any = "cuda") -> None:
        rng_states[as_device(device).index] = state.clone()

    def set_device(device: Any) -> None:
        d = as_device(device)
        if d.type == "cuda":
            if d.index >= mode.devices:
                raise DeviceMismatchError(f"set_device: {d} does not exist ({mode.devices} virtual CUDA devices)")
            mode.current = d.index

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        return mode.memory, max(mode.memory, TOTAL_MEMORY)  # (free, total)

    def get_device_properties(device: Any = None) -> Any:
        return SimpleNamespace(name="VirtualCUDA", total_memory=max(mode.memory, TOTAL_MEMORY), is_integrated=False,
                               major=9, minor=0, multi_processor_count=1)

    cuda = torch.cuda
    return [(torch, "Generator", VirtualGenerator),
            (cuda, "is_available", lambda: True), (cuda, "device_count", lambda: mode.devices),
            (cuda, "current_device", lambda: mode.current), (cuda, "set_device", set_device),
            (cuda, "get_rng_state", get_rng_state), (cuda, "set_rng_state", set_rng_state),
            (cuda, "mem_get_info", mem_get_info), (cuda, "get_device_properties", get_device_properties),
            (cuda, "max_memory_allocated", lambda device=None: 0), (cuda, "memory_allocated", lambda device=None: 0),
            (cuda, "memory_reserved", lambda device=None: 0), (cuda, "reset_peak_memory_stats", lambda device=None: None),
            (cuda, "synchronize", synchronize), (cuda, "Event", VirtualEvent),
            (cuda, "current_stream", lambda device=None: None),
            # torch.accelerator, the device-generic API libraries ask first (accelerate >= 1.16 sizes device_map="auto"
            # by it): the virtual devices are the machine's accelerator
            (torch.accelerator, "current_accelerator", lambda check_available=False: torch.device("cuda")),
            (torch.accelerator, "is_available", lambda: True),
            (torch.accelerator, "device_count", lambda: mode.devices),
            (torch.accelerator, "current_device_index", lambda: mode.current),
            (torch.accelerator, "get_memory_info", mem_get_info), (torch.accelerator, "synchronize", synchronize),
            # (an optimizer's step asks whether the stream is capturing a graph: never, on a virtual device)
            (torch.accelerator, "current_stream", lambda device=None: SimpleNamespace(is_capturing=lambda: False))]
