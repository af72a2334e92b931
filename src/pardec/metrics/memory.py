"""The peak host memory of a piece of torch code on the CPU, as the allocator sees it: what :mod:`pardec.plan`'s
factors are measured with.

:class:`PeakMemory` is a dispatch mode: after every aten op (forward and backward, both run on the calling thread on
the CPU) it reads glibc's ``mallinfo2`` (bytes in use: the heap's allocated chunks plus the mmapped ones, where
tensors of more than a few hundred kB live) and keeps the highest reading above the one at entry. An op's own
temporaries freed before it returns are not seen; its outputs beside its still-live inputs are.
``peak_bytes(fn)`` runs ``fn`` under it. Linux with glibc >= 2.33 only (:func:`available`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                 "uordblks", "fordblks", "keepcost")]


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return None
    return libc


def available() -> bool:
    """Whether the allocator can be read here (glibc's mallinfo2)."""
    return _libc() is not None


def in_use() -> int:
    """Bytes the C allocator holds for this process now: allocated heap chunks plus mmapped blocks."""
    libc = _libc()
    if libc is None:
        raise RuntimeError("pardec.metrics.memory needs glibc >= 2.33 (mallinfo2); not available here")
    m = libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)


class PeakMemory(TorchDispatchMode):
    """``with PeakMemory() as p: ...``; ``p.peak``: the highest bytes in use above the reading at entry."""

    def __enter__(self):
        self.base, self.peak = in_use(), 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.peak = max(self.peak, in_use() - self.base)
        return out


def peak_bytes(fn: Callable[[], Any]) -> int:
    """The peak bytes ``fn()`` held above what was in use when it started (its result is dropped)."""
    with PeakMemory() as p:
        fn()
    return p.peak


class StagePeak:
    """``with StagePeak(cuda, host) as p: ...``; ``p.record()``: the peak memory of the block, or None when nothing was
    measured. ``cuda``: the CUDA allocator's peak of the current device (``torch.cuda.max_memory_allocated``, reset at
    entry: every tensor this process holds there, the ones from before the block included). ``host`` (and no CUDA):
    the C allocator's peak above its use at entry (:class:`PeakMemory`: a Python call after every aten op, so it is
    asked for, ``measure_memory=true``, not always on)."""

    def __init__(self, cuda: bool, host: bool) -> None:
        self.cuda, self.host = cuda, host and not cuda and available()
        self._mode: PeakMemory | None = None
        self.bytes: int | None = None

    def __enter__(self) -> StagePeak:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        elif self.host:
            self._mode = PeakMemory().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.bytes = int(torch.cuda.max_memory_allocated())
        elif self._mode is not None:
            self._mode.__exit__(*exc)
            self.bytes = int(self._mode.peak)

    def record(self) -> dict[str, Any] | None:
        if self.bytes is None:
            return None
        how = ("torch.cuda.max_memory_allocated" if self.cuda
               else "host allocator (glibc mallinfo2) after every aten op, above its use when the stage began")
        return {"bytes": self.bytes, "gb": round(self.bytes / 1e9, 4), "how": how}
