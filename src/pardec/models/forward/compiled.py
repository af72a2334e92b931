"""``forward_impl=compiled``: the one-token decode step as one ``torch.compile`` graph over the preallocated KV
cache (gpt-fast's recipe); every other forward runs :mod:`pardec.models.forward.lean`.

Why: after :mod:`~pardec.models.forward.lean` removed transformers' module stack, what remains of a decode step outside the
linear layers is ~25 small ops per layer (RMSNorm, rotary, the cache write, the attention glue, residual adds),
each one kernel call reading and writing its operands (``scripts/profile_step.py``: ~14 of SmolLM2's 52 ms per fp32
step). Compiled as one graph, inductor fuses them into a few loops per layer and the step pays one guard check
instead of thousands of dispatches. Earlier attempts compiled per layer or per module (``dynamic=True`` over
growing cache views) and lost what they saved to guards and graph breaks (docs/cpu_speed.md, "Where a step's time goes").

How the graph stays one graph with fixed shapes: the step attends over each layer's *whole* key/value buffer
``[rows, heads, capacity, dim]`` with a mask that admits the cached slots (``begin .. begin + length``), and writes
the new key/value in place at slot ``begin + length`` (``index_copy_``): the cache length is data (a 2-element
tensor), not a shape, so the graph does not change from step to step. The buffer's capacity is marked dynamic, so
a prompt of another length or a grown cache does not recompile either (one compile per model, dtype and batch
size: each model has a compiled function of its own, see :func:`_step_fn`). Masked slots get exactly zero weight, so the step
computes what :func:`~pardec.models.forward.lean.lean_logits` computes up to float rounding (the softmax runs over more,
zero-weight, entries; tested: the tokens of every ``tokens`` method equal ``ar``'s).

Used for forwards of one new token per row with causal attention (``ar``'s steps, a draft model's steps) when
every layer's rows fill their buffer (one cache per buffer, the usual case). Forwards of several new rows after a
cached prefix (verification, Jacobi's blocks, trees, custom masks, hidden-state captures) run a second compiled
function, :func:`rows_step` (the same buffers, a mask over the whole buffer, the row count and capacity dynamic: one
compile); prefill and batch rows shared with other caches run the lean forward.
fbgemm's int8 linears (``dtype=int8``) and oneDNN-prepacked bf16 linears (:mod:`pardec.models.quant.packed`) run inside
the graph as an opaque custom op (:func:`_opaque_linear`): dynamo cannot trace their packed weights, so each such
linear is registered once and called by its index.

``forward_impl=cudagraph`` (CUDA only) goes one step further, as gpt-fast's ``reduce-overhead`` mode does: the
compiled step is captured once per model, batch size and cache buffer as a CUDA graph (:class:`_Graph`) and
replayed, so a step costs one launch instead of one per kernel. On a GPU a decode step of a 7B model in eager mode
is bound by the host's kernel launches, not by the weights' bytes (docs/gpu.md, "On a GPU"). Multi-row forwards after a
cached prefix (verifications, Jacobi blocks, trees) are padded to a power of two rows (:func:`graph_rows`) and
replayed the same way from a second compiled function (:func:`rows_step`), hidden-state captures included; prefill
and forwards whose cache shares its buffers with other caches run the lean forward. The graphs are keyed by the
cache's buffers, which a reset cache keeps when they fit the next prompt
(:meth:`~pardec.models.cache.preallocated.PreallocatedCache.reuse`).

The first step of each model compiles (tens of seconds on 2 CPU cores for SmolLM2; inductor caches its kernels on
disk, so later processes load them); evaluation's warm-up prompt absorbs it before timing starts. Needs a C++
compiler on CPU (inductor generates C++), checked when a model is wrapped.
"""

from __future__ import annotations

import itertools
import shutil
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from pardec.models.forward import lean
from pardec.models.quant.int8 import PerTokenLinear, _quantized_linear_type
from pardec.models.quant.packed import PackedLinear

#: linears with packed weights (fbgemm int8, oneDNN bf16), reachable from the compiled graph by index (dynamo
#: cannot trace their packed weights)
_OPAQUE_LINEARS: list[nn.Module] = []
#: the module each index was given to (what :func:`register_opaque` checks a module's tag against)
_OPAQUE_OWNERS: list[nn.Module] = []


@torch.library.custom_op("pardec::opaque_linear", mutates_args=())
def _opaque_linear(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    return _OPAQUE_LINEARS[index](x)


@_opaque_linear.register_fake
def _(x: torch.Tensor, index: int, out_features: int) -> torch.Tensor:
    # the width is an argument, not read from the registry: inductor caches compiled graphs on disk by their text,
    # and another process may have registered another linear at this index (a graph made there with its width
    # baked in would load here)
    return x.new_empty((*x.shape[:-1], out_features))


class _Gemm(nn.Module):
    """A per-token int8 linear's integer GEMM alone (:meth:`~pardec.models.quant.int8.PerTokenLinear.gemm`), as an
    opaque linear: the compiled graph traces the per-token scaling around it."""

    def __init__(self, lin: nn.Module):
        super().__init__()
        self.out_features, self.gemm = lin.out_features, lin.gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemm(x)


def graph_linear(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mod`` applied to ``x`` inside a compiled graph: a plain linear traced, a registered packed one
    (:func:`register_opaque`) through :func:`_opaque_linear`. What it reads is the module's own ``_opaque`` tag,
    never the registry: dynamo would guard a graph on the registry's size, so that every linear registered later
    (another role's drafter) would compile the graph again."""
    if type(mod) is nn.Linear:
        return F.linear(x, mod.weight, mod.bias)
    tag = getattr(mod, "_opaque", None)
    if tag is None:
        return mod(x)  # (weight-only int8 linears trace as they are)
    index, width, gemm_only = tag
    if gemm_only:
        return mod(x, gemm=lambda unit: _opaque_linear(unit, index, width))
    return _opaque_linear(x, index, width)


def register_opaque(model: nn.Module) -> None:
    """Give every fbgemm int8 linear and every prepacked bf16 linear of ``model`` an index for
    :func:`_opaque_linear` (per-token int8 linears: their GEMM only), kept on the module as its ``_opaque`` tag
    (index, output width, whether the GEMM alone is opaque)."""
    kinds = (_quantized_linear_type(), PackedLinear, PerTokenLinear)
    for mod in model.modules():
        tag = getattr(mod, "_opaque", None)
        # (a copy of a registered module carries its original's tag: it gets an index of its own)
        if isinstance(mod, kinds) and (tag is None or _OPAQUE_OWNERS[tag[0]] is not mod):
            gemm_only = isinstance(mod, PerTokenLinear)
            mod._opaque = (len(_OPAQUE_LINEARS), int(mod.out_features), gemm_only)
            _OPAQUE_LINEARS.append(_Gemm(mod) if gemm_only else mod)
            _OPAQUE_OWNERS.append(mod)


def unsupported(model: nn.Module) -> str | None:
    """Why the compiled step cannot run ``model`` (None: it can)."""
    why = lean.unsupported(model)
    if why is not None:
        return why
    return compiler_missing(next(model.parameters()).device)


def compiler_missing(device: torch.device) -> str | None:
    """Why ``torch.compile`` cannot run on ``device`` here (None: it can): on a CPU, inductor needs a C++ compiler."""
    if device.type == "cpu" and not (shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")):
        return "torch.compile on CPU needs a C++ compiler (c++, g++ or clang++) on PATH"
    return None


def _buffer_attend(keys: list[torch.Tensor], values: list[torch.Tensor], at: torch.Tensor, mask: torch.Tensor):
    """``lean.decoder_layers``' ``attend`` over whole preallocated buffers: writes the new keys/values at slots
    ``at`` of each layer's buffer in place and attends over the buffer through the additive ``mask``."""

    def attend(a, q, k, v):
        kb, vb = keys[a.layer_idx], values[a.layer_idx]
        kb.index_copy_(2, at, k)
        vb.index_copy_(2, at, v)
        groups = q.shape[1] // kb.shape[1]
        return F.scaled_dot_product_attention(q, lean._repeat_kv(kb, groups), lean._repeat_kv(vb, groups),
                                              attn_mask=mask, scale=a.scaling)

    return attend


def _decode(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
            values: list[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """Logits [B, 1, V] of ``ids`` [B, 1]; writes their keys/values at slot ``slots[1]`` of every layer's buffer
    and attends over slots ``slots[0] .. slots[1]``."""
    h, cos, sin = lean.embed(model, ids, positions)
    j = torch.arange(keys[0].shape[2], device=ids.device)
    mask = torch.where((j >= slots[0]) & (j <= slots[1]), 0.0, float("-inf")).to(h.dtype)[None, None, None]
    at = slots[1:]

    attend = _buffer_attend(keys, values, at, mask)
    return lean.head(model, lean.decoder_layers(model, h, cos, sin, attend, graph_linear), graph_linear)


#: each model's compiled step (weakly keyed: a model that is gone takes its graph with it)
_compiled: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def own_compiled(fn, store: weakref.WeakKeyDictionary, model: nn.Module):
    """``fn`` compiled for ``model`` alone (:func:`_step_fn` says why a code object of its own)."""
    compiled_fn = store.get(model)
    if compiled_fn is None:
        code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_serial)}")
        own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
        compiled_fn = store[model] = torch.compile(
            own, fullgraph=True, options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})
    return compiled_fn


def _step_fn(model: nn.Module):
    """``model``'s compiled :func:`_decode`. Dynamo guards a graph on every module and parameter it reads; checking
    those guards cost ~8% of an fp32 SmolLM2 step (32.8 -> 30.1 ms without them, Xeon with AMX), so they are
    skipped (``skip_guard_on_all_nn_modules_unsafe``). That is safe because every model gets a code object of its
    own (dynamo keeps its graphs per code object): no model can run another's graph, even one of the same shape.
    What the skipped guards would have caught, and the caller must not do: replace a model's modules or change its
    dtype after its first compiled step (pardec quantizes and packs at load, before any step)."""
    return own_compiled(_decode, _compiled, model)


#: each model's compiled :func:`_rows`
_compiled_rows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rows_fn(model: nn.Module):
    """``model``'s compiled :func:`_rows` (one compile for every row count and buffer capacity: both are marked
    dynamic; a new ``capture`` layer compiles again)."""
    return own_compiled(_rows, _compiled_rows, model)


_serial = itertools.count()


class _Graph:
    """One captured CUDA graph of ``fn(*inputs)``: the inputs live in static buffers, :meth:`__call__` copies the new
    ones in and replays the graph (one launch instead of one per kernel: on a GPU a decode step is otherwise bound
    by the host's kernel launches). ``fn`` closes over the model and the cache buffers it writes in place.

    Capture runs ``fn`` for real (warm-up on a side stream, as CUDA graphs require) with the first call's inputs:
    those writes put the first call's keys/values at its own slots, which the replay then writes again,
    identically."""

    def __init__(self, fn, inputs: tuple[torch.Tensor, ...], pool):
        self.inputs = tuple(t.clone() for t in inputs)  # (outside the capture: never in the graphs' pool)
        dev = inputs[0].device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles (a compiled step's first call) and settles the allocator
                fn(*self.inputs)
        torch.cuda.current_stream(dev).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = fn(*self.inputs)

    def __call__(self, *inputs: torch.Tensor):
        for static, new in zip(self.inputs, inputs):
            static.copy_(new)
        self.graph.replay()
        # the next replay overwrites ``out`` (and, through the shared pool, may overwrite another graph's): callers
        # keep logits across steps (drafts)
        if isinstance(self.out, tuple):
            return tuple(o.clone() for o in self.out)
        return self.out.clone()


#: cache buffer sets kept per model: a cache that grows gets new buffers (new graphs); the graphs of older ones are
#: dropped with the references they hold to those buffers. Two: a target and a draft copy of the same model, or the
#: collection's two caches, alternate without recapturing.
MAX_BUFFER_SETS = 2


class Graphs:
    """The captured graphs of ``forward_impl=cudagraph``: per model, a memory pool and its graphs by cache buffers
    (newest last), then by kind and shape. ``capture``: what captures one graph of ``fn(*inputs)`` and replays it
    (:class:`_Graph`; a stand-in with its contract runs the bookkeeping on the CPU in tests); ``pool``: makes a
    model's memory pool; ``compile``: whether the captured functions are the compiled ones."""

    def __init__(self, capture=None, pool=None, compile: bool = True):
        self.capture = capture or _Graph
        self.pool = pool or torch.cuda.graph_pool_handle
        self.compile = compile
        self.by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def step_fn(self, model: nn.Module):
        return _step_fn(model) if self.compile else _decode

    def rows_fn(self, model: nn.Module):
        return _rows_fn(model) if self.compile else _rows

    def ragged_fn(self, model: nn.Module):
        """What a ragged batch's graph runs: :func:`ragged_step` (compiled per kind), or :func:`_ragged` uncompiled."""
        return ragged_step if self.compile else _ragged

    def __call__(self, model: nn.Module, what: tuple, keys: list[torch.Tensor], values: list[torch.Tensor], make_fn,
                 inputs: tuple[torch.Tensor, ...]):
        """Replay (capturing it first if new) ``model``'s graph ``what`` (a kind and the inputs' shapes) over the
        cache buffers ``keys``/``values``; ``make_fn()`` gives the function to capture."""
        entry = self.by_model.get(model)
        if entry is None:
            entry = self.by_model[model] = (self.pool(), {})
        pool, by_buffers = entry
        buffers = (tuple(t.data_ptr() for t in (*keys, *values)), keys[0].dtype, tuple(keys[0].shape),
                   keys[0].stride(), tuple(t.shape[2] for t in keys))
        graphs = by_buffers.pop(buffers, None)
        if graphs is None:
            graphs = {}
            while len(by_buffers) >= MAX_BUFFER_SETS:
                by_buffers.pop(next(iter(by_buffers)))
        by_buffers[buffers] = graphs  # (newest last)
        key = (what, *((tuple(t.shape), t.dtype) for t in inputs))
        g = graphs.get(key)
        if g is None:
            g = graphs[key] = self.capture(make_fn(), inputs, pool)
        return g(*inputs)


#: the graphs every ``forward_impl=cudagraph`` model replays
CUDA_GRAPHS = Graphs()


def decode_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, cache,
                graphs: Graphs | None = None) -> torch.Tensor | None:
    """The compiled step for ``ids`` [B, 1] after what ``cache`` (a :class:`PreallocatedCache`) holds, appending
    their keys/values; None (nothing done) when the cache's layout does not allow it (the caller runs the lean
    forward instead)."""
    got = cache.buffers_for(ids.shape[0], 1)
    if got is None:
        return None
    keys, values, begin, length = got
    for buf in (*keys, *values):
        torch._dynamo.maybe_mark_dynamic(buf, 2)
    # filled on the device from host ints (no host-to-device copy, so no sync on a GPU)
    slots = torch.full((2,), begin, dtype=torch.long, device=ids.device)
    slots[1:] += length
    step = _step_fn(model) if graphs is None else graphs.step_fn(model)
    if graphs is not None:
        logits = graphs(model, ("step",), keys, values,
                        lambda: lambda i, p, s: step(model, i, p, keys, values, s), (ids, positions, slots))
    else:
        logits = step(model, ids, positions, keys, values, slots)
    cache.advance(1)
    return logits


def _rows(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
          values: list[torch.Tensor], at: torch.Tensor, mask: torch.Tensor, capture: tuple[int, ...] | None,
          keep: torch.Tensor | None = None):
    """Logits [B, W, V] of ``ids`` [B, W] (and, with ``capture``, the hidden states entering those decoder layers
    (``num_layers`` = after the final norm), concatenated in that order: :func:`lean.captured`); writes their
    keys/values at slots ``at`` [W] of every layer's buffer and attends over the whole buffer through the additive
    ``mask`` [B, 1, W, capacity]; ``keep``: the positions whose logits are wanted (None: all)."""
    h, cos, sin = lean.embed(model, ids, positions)
    seen: dict[int, torch.Tensor] = {}
    attend = _buffer_attend(keys, values, at, mask)
    h = lean.decoder_layers(model, h, cos, sin, attend, graph_linear,
                            on_layer=seen.__setitem__ if capture is not None else None)
    normed, logits = lean.norm_head(model, h, graph_linear, keep)
    if capture is None:
        return logits
    return logits, lean.captured(seen, normed, capture, len(model.model.layers))


#: the most new rows a graphed multi-row forward takes (:func:`graph_rows`); wider forwards run the lean forward
MAX_GRAPHED_ROWS = 128


def graph_rows(t: int, limit: int = MAX_GRAPHED_ROWS) -> int:
    """The row count a forward of ``t`` new rows is padded to under ``forward_impl=cudagraph``: the next power of
    two (one captured graph per count; on a GPU a verification of up to 64 rows costs about one row: docs/gpu.md "On a
    GPU"), or ``t`` itself past :data:`MAX_GRAPHED_ROWS`."""
    return t if t > limit else 1 << (t - 1).bit_length()


def rows_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache,
              capture: tuple[int, ...] | None = None, graphs: Graphs | None = None, keep: torch.Tensor | None = None):
    """A forward of ``ids`` [B, W] (W > 1 new rows, padding included) after what ``cache`` (a
    :class:`PreallocatedCache`) holds, as a replay of a CUDA graph of the compiled :func:`_rows`, captured once per
    model, row count and cache buffers (one compile serves every row count. On the H200 a graph of the eager ops
    cost 1.5x a graphed compiled one-token step at every row count from 2 to 64: the gap was the fusion, not the
    rows). Without ``graphs`` (``forward_impl=compiled``) the compiled function runs as it is: on a 2-core Zen 4 it
    cut a fp32 SmolLM2 forward of 4 or 8 new rows by 8-40% against the lean forward (docs/cpu_speed.md). ``mask``: the
    forward's additive [B, 1, W, length+W] mask. Appends the W positions to the cache and returns the logits
    [B, W, V] (with ``capture``, also the hidden states asked for, [B, W, H]); None (nothing done) when the cache's
    layout does not allow it. ``keep`` (without ``graphs`` only: a graph's shapes are fixed, so it computes every
    row's logits and the caller picks): the positions whose logits are returned, the LM head run on those only."""
    bsz, width = ids.shape
    got = cache.buffers_for(bsz, width)
    if got is None:
        return None
    keys, values, begin, length = got
    capacity = keys[0].shape[2]
    # the mask over the whole buffer: the cached and new slots as the forward's mask says, every other slot masked
    full = torch.full((bsz, 1, width, capacity), torch.finfo(mask.dtype).min, dtype=mask.dtype, device=ids.device)
    full[..., begin : begin + length + width] = mask
    at = torch.arange(begin + length, begin + length + width, device=ids.device)
    fn = _rows_fn(model) if graphs is None else graphs.rows_fn(model)

    def run(i, p, a, m, k=None):  # (a graph's static inputs: their row count and the capacity are not baked in)
        for t, dims in ((i, (1,)), (p, (1,)), (a, (0,)), (m, (2, 3)), (k, (0,)),
                        *((b, (2,)) for b in (*keys, *values))):
            for d in dims if t is not None else ():
                torch._dynamo.maybe_mark_dynamic(t, d)
        return fn(model, i, p, keys, values, a, m, capture, k)

    if graphs is not None and keep is not None:
        raise ValueError("rows_step: keep is for the compiled function without graphs (a graph's shapes are fixed)")
    if graphs is not None:
        out = graphs(model, ("rows", capture), keys, values, lambda: run, (ids, positions, at, full))
    else:
        out = run(ids, positions, at, full, keep)
    cache.advance(width)
    return out


def _ragged(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
            values: list[torch.Tensor], slots: torch.Tensor, mask: torch.Tensor, capture: tuple[int, ...] | None):
    """Logits [n, T, V] of ``ids`` [n, T] for rows ``0 .. n-1`` of a ragged batch cache (each layer's buffer
    ``[rows, kv_heads, capacity, head_dim]``, :mod:`pardec.models.ragged`): writes row ``b``'s keys/values at its
    slots ``slots[b]`` in place and attends over its row's whole buffer through the additive ``mask`` [n, 1, T,
    capacity]; with ``capture``, also the hidden states entering those layers, as :func:`_rows`."""
    n = ids.shape[0]
    h, cos, sin = lean.embed(model, ids, positions)
    rows = torch.arange(n, device=ids.device)[:, None].expand_as(slots)
    seen: dict[int, torch.Tensor] = {}

    def attend(a, q, k, v):
        kb, vb = keys[a.layer_idx], values[a.layer_idx]
        kb[rows, :, slots] = k.transpose(1, 2).to(kb.dtype)
        vb[rows, :, slots] = v.transpose(1, 2).to(vb.dtype)
        return F.scaled_dot_product_attention(q, kb[:n].to(q.dtype), vb[:n].to(q.dtype), attn_mask=mask,
                                              scale=a.scaling, enable_gqa=q.shape[1] != kb.shape[1])

    h = lean.decoder_layers(model, h, cos, sin, attend, graph_linear,
                            on_layer=seen.__setitem__ if capture is not None else None)
    normed, logits = lean.norm_head(model, h, graph_linear)
    if capture is None:
        return logits
    return logits, lean.captured(seen, normed, capture, len(model.model.layers))


#: each model's compiled :func:`_ragged`, one per kind of forward (:func:`ragged_step`)
_compiled_ragged: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def ragged_step(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], slots: torch.Tensor, mask: torch.Tensor,
                capture: tuple[int, ...] | None = None):
    """:func:`_ragged` compiled for ``model``. Row counts, new-token counts and capacities are dynamic dimensions,
    but dynamo specializes a dimension of size 1 and compiles each ``capture`` apart, and a batch meets every such
    kind (one row left at a batch's end, one new token per row for ``ar``, a drafter's capture): each kind gets a
    function of its own (so its own recompile budget), one compile each."""
    kinds = _compiled_ragged.setdefault(model, {})
    kind = (ids.shape[0] == 1, ids.shape[1] == 1, capture)
    if kind not in kinds:
        kinds[kind] = own_compiled(_ragged, weakref.WeakKeyDictionary(), model)  # (a code object of its own)
    fn = kinds[kind]
    for t, dims in ((ids, (0, 1)), (positions, (0, 1)), (slots, (0, 1)), (mask, (0, 2, 3)),
                    *((b, (2,)) for b in (*keys, *values))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    return fn(model, ids, positions, keys, values, slots, mask, capture)
