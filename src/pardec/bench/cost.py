"""Measuring a forward-cost table (:class:`pardec.models.cost.CostTable`): the bench times, the library only reads."""

from __future__ import annotations

import statistics
import time

import torch

from pardec.models.cached import CachedModel
from pardec.models.cost import CostTable
from pardec.models.host import machine


def measure(model: torch.nn.Module, context: list[int], sizes: list[int], name: str, dtype: str,
            repeats: int = 15, warmup: int = 3, forward_impl: str | None = None) -> CostTable:
    """Median time of a cached forward of T rows after ``len(context) - max(sizes)`` cached tokens, per T in
    ``sizes`` (interleaved over T, so a drift of the machine's speed spreads over all of them), through
    ``CachedModel.forward`` on ``forward_impl`` (default: CachedModel's)."""
    cm = CachedModel(model, forward_impl=forward_impl)
    top = max(sizes)
    ids = torch.tensor([context], device=cm.device)
    cm.prefill(ids[:, :-top])
    base = cm.length
    times: dict[int, list[float]] = {t: [] for t in sizes}
    cuda = cm.device.type == "cuda"
    for i in range(warmup + repeats):
        for t in sizes:
            if cuda:
                torch.cuda.synchronize(cm.device)
            t0 = time.perf_counter()
            cm.forward(ids[:, base : base + t])
            if cuda:
                torch.cuda.synchronize(cm.device)
            if i >= warmup:
                times[t].append((time.perf_counter() - t0) * 1e3)
            cm.truncate(base)
    return CostTable(name, dtype, base, {t: statistics.median(v) for t, v in times.items()}, machine(cm.device))
