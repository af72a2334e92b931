"""A DFlash drafter's decoding round as one ``torch.compile`` graph (``method.compile=true``; beyond the paper: the
reference drafts in eager PyTorch, the serving engines replay CUDA graphs).

Eager, a round makes two drafter passes: the context keys/values of the tokens the last verification committed
(:meth:`~pardec.models.dflash.DFlashDraft.context_kv`) and the block's forward over the context
(:meth:`~pardec.models.dflash.DFlashDraft.forward` and the head), five layers of small linears with ~25 small ops
around them per layer, each one kernel call. :func:`draft_round` runs both as one graph whose shapes do not change
from round to round (the recipe of :mod:`pardec.models.forward.compiled`, the target's compiled step):

* the context lives in whole-capacity buffers ``[1, kv, capacity + W, d]`` (:class:`~pardec.decoding.dflash.
  ContextCache` with ``W`` spare slots, ``W`` the block width); the committed tokens' features come padded to ``W``
  rows and are written at slots ``length .. length + W - 1`` in place (``index_copy_``); the padding rows' entries lie
  past the context's new length, masked, and the next round overwrites them;
* the block attends over the whole buffer through an additive mask made in the graph from the new length (a tensor:
  data, not a shape); the capacity is marked dynamic, so a longer prompt does not recompile (one compile per
  drafter, head and width: each such triple has a code object of its own, :func:`~pardec.models.forward.compiled.
  own_compiled`);
* fbgemm int8 linears (``method.int8_weights``) run as that module's opaque op.

The prompt's context (prefill) is written by the eager ``context_kv``. Masked slots get exactly zero weight, so a
round computes what the eager passes compute up to float rounding; the drafts only propose (the target verifies), so
the output of every ``tokens`` / ``distribution`` guarantee is unchanged (tested: greedy equals ``ar``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from pardec.models.dflash import DFlashDraft
from pardec.models.forward.compiled import graph_linear, own_compiled, register_opaque

#: per drafter: {(id(head), width): the store own_compiled keeps that triple's function in}
_stores: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _round(drafter: DFlashDraft, head: nn.Module, features: torch.Tensor, tables: tuple[torch.Tensor, ...],
           x: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], at: torch.Tensor,
           length: torch.Tensor) -> torch.Tensor:
    """Writes the context entries of ``features`` [1, W, K * H_t] at slots ``at`` [W], then runs the block ``x``
    [1, W, H] over the buffers' slots ``< length`` [1] and its own slots; returns slots 1..W-1's logits [W - 1, V]
    (``tables``: the context rows' then the block's rotary cos/sin)."""
    ctx_cos, ctx_sin, cos, sin = tables
    for kb, vb, (k, v) in zip(keys, values, drafter.context_kv(features, at, graph_linear, (ctx_cos, ctx_sin))):
        kb.index_copy_(2, at, k)
        vb.index_copy_(2, at, v)
    width = x.shape[1]
    j = torch.arange(keys[0].shape[2] + width, device=x.device)
    mask = torch.where((j < length) | (j >= keys[0].shape[2]), 0.0, float("-inf")).to(x.dtype)
    out = drafter(x, at, list(zip(keys, values)), mask[None].expand(width, -1), graph_linear, (cos, sin))
    return drafter.logits(out[0, 1:], head, graph_linear)


def _round_fn(drafter: DFlashDraft, head: nn.Module, width: int):
    """The compiled :func:`_round` of this drafter, head and width; their packed linears are registered when it
    is made (once, not every round)."""
    per = _stores.setdefault(drafter, {})
    key = (id(head), width)
    if key not in per:
        register_opaque(drafter)
        register_opaque(head)
        per[key] = weakref.WeakKeyDictionary()
    return own_compiled(_round, per[key], drafter)


def draft_round(drafter: DFlashDraft, head: nn.Module, cache, pending: torch.Tensor | None, x: torch.Tensor
                ) -> torch.Tensor:
    """One round's drafter work as one compiled call: the context entries of ``pending`` [m, K * H_t] (the
    features of the tokens committed since the last round; None: none) appended to ``cache`` (a ``ContextCache``
    with ``W`` spare slots), then the logits [W - 1, V] of block ``x`` [1, W, H] (slot 0: the last committed token,
    at the position after the context)."""
    width = x.shape[1]
    if cache.spare < width:
        raise RuntimeError(f"dflash compiled round: the context cache has {cache.spare} spare slots, the block {width}")
    m = 0 if pending is None else pending.shape[0]
    if m > width:
        raise RuntimeError(f"dflash compiled round: {m} committed tokens exceed the block width {width}")
    cache.check_room(m)
    dev = x.device
    features = torch.zeros((1, width, cache.feature_width), dtype=drafter.dtype, device=dev)
    if m:
        features[0, :m] = pending.to(drafter.dtype)
    begin = cache.length
    at = torch.arange(begin, begin + width, device=dev)
    cos, sin = drafter.rotary_tables(x.to(drafter.dtype), torch.cat([at, at + m]))
    tables = (cos[..., :width, :], sin[..., :width, :], cos[..., width:, :], sin[..., width:, :])
    length = torch.full((1,), begin + m, dtype=torch.long, device=dev)
    for buf in (*cache.k, *cache.v):
        torch._dynamo.maybe_mark_dynamic(buf, 2)
    logits = _round_fn(drafter, head, width)(drafter, head, features, tables, x, cache.k, cache.v, at, length)
    cache.length += m
    return logits
