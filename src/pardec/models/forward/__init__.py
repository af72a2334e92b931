"""Forward implementations of :meth:`~pardec.models.cached.CachedModel.forward` (``forward_impl=``), a registry:
each declares what it can run (the model, the KV cache, the device) and runs the forwards it handles; the seam
never compares their names.

* ``hf``: transformers' ``model(...)`` (every model, either cache; the seam runs it, hooks for hidden states);
* ``lean`` (:mod:`~pardec.models.forward.lean`): the same ops without transformers' module stack (Llama family);
* ``compiled`` (:mod:`~pardec.models.forward.compiled`): lean, with one-token steps and multi-row verifications as
  compiled functions over the preallocated cache's buffers;
* ``cudagraph``: compiled, each step and each verification (padded to a power of two rows) a replay of a captured
  CUDA graph (CUDA only).

``attn_implementation=invariant`` (:mod:`~pardec.models.forward.invariant`) is an attention kernel, not a forward:
any of these runs it where it runs SDPA's layers through transformers.

A forward's methods return None where they do not handle a call; the seam then runs the next one down: the
multi-row path (:meth:`Forward.rows`), then :meth:`Forward.logits`, then transformers' forward.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from pardec.config import FORWARD_IMPLS
from pardec.models.forward import compiled, lean
from pardec.registry import Registry


class Forward:
    """transformers' ``model(...)`` (``forward_impl=hf``): runs every model on either cache; the seam runs it."""

    name: ClassVar[str] = "hf"
    #: the KV caches it runs on (``cache=``)
    caches: ClassVar[tuple[str, ...]] = ("preallocated", "dynamic")
    #: the only device type it runs on (None: any)
    device_type: ClassVar[str | None] = None
    #: whether it runs forwards of its own (not transformers'): those take the causal mask after a cached prefix
    #: as an explicit additive mask (SDPA's causal flag aligns top-left)
    own: ClassVar[bool] = False
    #: the graphs its forwards replay (:class:`~pardec.models.forward.compiled.Graphs`; None: no graphs)
    graphs: compiled.Graphs | None = None

    def unsupported(self, model: nn.Module) -> str | None:
        """Why it cannot run ``model`` (None: it can)."""
        return None

    def prepare(self, model: nn.Module) -> None:
        """Once per model wrapped (the compiled forwards register the model's opaque linears)."""

    def pad_to(self, rows: int) -> int | None:
        """The row count a verification of ``rows`` new rows after a cached prefix runs as (None: as the machine's
        forward-cost table says, :mod:`pardec.models.cost`)."""
        return None

    def rows(self, model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache,
             capture: tuple[int, ...] | None, keep: torch.Tensor | None):
        """A verification: ``ids`` [B, W] (W > 1) after a cached prefix under the additive ``mask``; logits (and,
        with ``capture``, the hidden states entering those layers, concatenated, as ``(logits, hidden)``); None: not
        handled here."""
        return None

    def logits(self, model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               cache, keep, capture: tuple[int, ...] | None = None):
        """Any other forward: logits (with ``capture``, ``(logits, hidden)`` as :meth:`rows`), or None
        (transformers' forward runs it)."""
        return None


class Lean(Forward):
    name = "lean"
    own = True

    def unsupported(self, model: nn.Module) -> str | None:
        return lean.unsupported(model)

    def logits(self, model, ids, positions, mask, cache, keep, capture=None):
        return lean.lean_logits(model, ids, positions, mask, cache, keep, capture)


class Compiled(Lean):
    name = "compiled"
    caches = ("preallocated",)  # (it writes the preallocated buffers in place)

    def unsupported(self, model: nn.Module) -> str | None:
        return compiled.unsupported(model)

    def prepare(self, model: nn.Module) -> None:
        compiled.register_opaque(model)

    def rows(self, model, ids, positions, mask, cache, capture, keep):
        return compiled.rows_step(model, ids, positions, mask, cache, capture, graphs=self.graphs,
                                  keep=None if self.graphs else keep)

    def logits(self, model, ids, positions, mask, cache, keep, capture=None):
        one = not isinstance(keep, torch.Tensor) or keep.numel() == 1  # (the step returns the one row's logits)
        if ids.shape[1] == 1 and mask is None and one and capture is None:
            out = compiled.decode_step(model, ids, positions, cache, graphs=self.graphs)
            if out is not None:
                return out
        return super().logits(model, ids, positions, mask, cache, keep, capture)


class CudaGraph(Compiled):
    """``forward_impl=cudagraph``. ``graphs``, ``device_type`` and ``max_rows`` are the registry's (CUDA graphs of the
    compiled functions, on CUDA, up to :data:`~pardec.models.forward.compiled.MAX_GRAPHED_ROWS` rows); a test passes
    its own instance as ``CachedModel(..., forward_impl=CudaGraph(...))`` to run the graph bookkeeping on the CPU."""

    name = "cudagraph"

    def __init__(self, graphs: compiled.Graphs | None = None, device_type: str | None = "cuda",
                 max_rows: int = compiled.MAX_GRAPHED_ROWS):
        self.graphs = graphs or compiled.CUDA_GRAPHS
        self.device_type = device_type
        self.max_rows = max_rows

    def pad_to(self, rows: int) -> int | None:
        return compiled.graph_rows(rows, self.max_rows)

    def rows(self, model, ids, positions, mask, cache, capture, keep):
        if ids.shape[1] > self.max_rows:  # (a graph per width past the limit would pile up)
            return None
        out = super().rows(model, ids, positions, mask, cache, capture, keep)
        if out is None or keep is None:
            return out
        if capture is not None:
            return out[0][:, keep], out[1]
        return out[:, keep]  # (a graph computes every row's logits: its shapes are fixed)


FORWARDS: Registry[Forward] = Registry("forward_impl")
for _impl in (Forward(), Lean(), Compiled(), CudaGraph()):
    FORWARDS.add(_impl.name, _impl)
if tuple(FORWARDS.names()) != tuple(sorted(FORWARD_IMPLS)):  # one list of names: the config's
    raise ImportError(f"forward registry {FORWARDS.names()} differs from pardec.config.FORWARD_IMPLS")


def auto(model: nn.Module, cache: str = "preallocated") -> str:
    """``forward_impl=auto``: the fastest exact forward that runs ``model`` where its weights are. On CUDA
    ``cudagraph`` (7B on an H200: 10.7x ``generate()``, docs/gpu.md "On a GPU"; it needs the preallocated cache), else
    ``lean``; on the CPU ``lean`` (fp32 and int8 ``ar`` 1.10x ``hf``'s on a 2-core EPYC, docs/cpu_speed.md "forward_impl=lean";
    ``compiled``'s fp32 step was no faster than lean's there, 58.3 vs 57.7 ms, and it compiles first). ``hf`` where
    the others cannot run the model (split over several devices, another architecture or attention kernel)."""
    if cache != "preallocated":  # (the lean and compiled forwards are measured and tested on pardec's own cache)
        return "hf"
    if next(model.parameters()).device.type == "cuda" and compiled.unsupported(model) is None:
        return "cudagraph"
    return "lean" if lean.unsupported(model) is None else "hf"


def resolve(name: str | Forward, model: nn.Module, cache: str, model_name: str) -> Forward:
    """The forward ``name`` (``auto``: :func:`auto`; or a :class:`Forward` given as it is) for ``model`` on
    ``cache``; a clear error where it cannot run the model, the cache or the device."""
    if name == "auto":
        name = auto(model, cache)
    if isinstance(name, Forward):
        impl, name = name, name.name
    elif name not in FORWARDS:
        raise ValueError(f"forward_impl={name!r} is not valid; choose one of: auto, {', '.join(FORWARD_IMPLS)}")
    else:
        impl = FORWARDS.get(name)
    if (why := impl.unsupported(model)) is not None:
        raise ValueError(f"forward_impl={name} cannot run model {model_name!r}: {why}; use forward_impl=hf")
    if impl.device_type is not None and (dev := next(model.parameters()).device).type != impl.device_type:
        raise ValueError(f"forward_impl={name} replays CUDA graphs and needs a model on a CUDA device; model "
                         f"{model_name!r} is on {dev}: use forward_impl=compiled there")
    if cache not in impl.caches:
        raise ValueError(f"forward_impl={name} needs cache='preallocated' (it writes the preallocated buffers in "
                         f"place); got cache={cache!r}")
    impl.prepare(model)
    return impl
