"""``forward_impl=cudagraph`` without a GPU: the graph capture replaced by an eager stand-in that keeps a CUDA graph's
contract, so the graph bookkeeping (one capture per model, kind, shapes and cache buffers; inputs copied into buffers
fixed at capture; multi-row forwards padded to a power of two rows) runs on the CPU. What it cannot check: the
capture itself (allocations, host syncs or data-dependent control flow inside a captured function), which needs a
GPU (``python -m pardec.bench gpu-smoke --forward-impls cudagraph``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pardec.models.forward import CudaGraph, compiled


class EagerGraph:
    """:class:`pardec.models.forward.compiled._Graph`'s contract without CUDA: static inputs cloned at capture; a call
    copies the new inputs into them and runs the captured function over the static ones (so the function may read
    nothing else that changes). ``captures`` counts the graphs captured since it was last reset."""

    captures = 0

    def __init__(self, fn, inputs, pool):
        type(self).captures += 1
        self.fn, self.inputs = fn, tuple(t.clone() for t in inputs)

    def __call__(self, *inputs):
        for static, new in zip(self.inputs, inputs):
            static.copy_(new)
        out = self.fn(*self.inputs)
        return tuple(o.clone() for o in out) if isinstance(out, tuple) else out.clone()


def cpu_graphs(max_rows: int = compiled.MAX_GRAPHED_ROWS) -> CudaGraph:
    """``forward_impl=cudagraph`` on the CPU, to inject as ``CachedModel(..., forward_impl=...)``: graphs of its own
    whose capture is :class:`EagerGraph`, over the uncompiled one-token step and rows, on any device."""
    return CudaGraph(compiled.Graphs(capture=EagerGraph, pool=lambda: None, compile=False), device_type=None,
                     max_rows=max_rows)


@contextmanager
def eager_cuda_graphs() -> Iterator[compiled.Graphs]:
    """Within: the graphs every ``forward_impl=cudagraph`` model replays (``compiled.CUDA_GRAPHS``) are captured by
    :class:`EagerGraph` over the uncompiled functions (inductor is not run: its compiled functions are checked on
    the CPU by ``forward_impl=compiled``), so a whole run under :class:`~pardec.testing.VirtualCUDA` takes the CUDA
    forward that ``forward_impl=auto`` picks there."""
    graphs = compiled.CUDA_GRAPHS
    saved = graphs.capture, graphs.pool, graphs.compile, graphs.by_model
    graphs.capture, graphs.pool, graphs.compile = EagerGraph, (lambda: None), False
    graphs.by_model = type(saved[3])()
    try:
        yield graphs
    finally:
        graphs.capture, graphs.pool, graphs.compile, graphs.by_model = saved
