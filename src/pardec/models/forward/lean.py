"""``forward_impl=lean``: :class:`~pardec.models.cached.CachedModel`'s forward through a Llama-family decoder
without transformers' module stack.

Why: a decode step of a small model on a CPU (and of any model at batch 1 on a GPU, where kernel launches are the
cost) is dominated by per-op overhead, not by the weights' trip from memory alone. transformers' forward wraps
every step in decorators, keyword processing, output recording, mask construction and ~13 ``nn.Module`` calls per
layer (``scripts/profile_step.py``: ~14 of SmolLM2's 52 ms per fp32 step are outside the linear layers). This
path runs the same computation on the same weights, in place of ``model(...)``, as plain tensor ops:

    embed -> rotary tables (the model's own ``rotary_emb``: every rope scaling it knows) -> per layer:
    RMSNorm -> q/k/v projections -> rotary -> ``cache.update`` -> SDPA -> o projection -> residual ->
    RMSNorm -> SiLU(gate) * up -> down -> residual -> final RMSNorm on the kept positions -> LM head

with the ops in transformers' order (RMSNorm in fp32 as ``LlamaRMSNorm`` computes it; SDPA with the same mask,
scale, causal flag and grouped-query handling as its ``sdpa`` attention), so the logits equal the HF path's up to
the float rounding of a kernel that is chosen differently (tested on both caches and every ``forward`` argument).
It covers :meth:`CachedModel.forward` and ``prefill``, ``hidden_layer`` captures included; ``run_upper`` and
``forward_pseudo`` keep transformers' layers.

Supported: ``llama``, ``mistral`` and ``qwen2`` decoders (and pardec's ``pardec_draft``) with full attention in
every layer, SiLU MLPs, ``sdpa`` or ``eager`` attention, on one device; plain or int8-quantized linears (a module
that is not an ``nn.Linear`` is called as a module). Anything else is refused in one line by
:func:`unsupported`, naming what does not fit (``forward_impl=hf`` runs every model).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from pardec.models.rotary import rotate as _rotate

#: model types whose decoder layers are Llama's (pre-norm, rotary, GQA attention, SiLU-gated MLP)
SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "pardec_draft")


def unsupported(model: nn.Module, attention: tuple[str, ...] = ("sdpa", "eager")) -> str | None:
    """Why the lean forward cannot run ``model`` (None: it can); ``attention``: the attention implementations the
    caller runs itself (the ragged batch also runs ``invariant``'s: :mod:`pardec.models.ragged`)."""
    cfg = model.config
    if cfg.model_type not in SUPPORTED_TYPES:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(SUPPORTED_TYPES)}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return f"{type(model).__name__} has no .model.layers / .lm_head"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ())):
        return f"layer types {sorted(set(cfg.layer_types))}: only full_attention layers are supported"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return f"sliding_window={cfg.sliding_window}: the lean forward applies no window"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act={cfg.hidden_act!r}: the lean MLP is SiLU-gated"
    impl = getattr(cfg, "_attn_implementation", None) or "sdpa"
    if impl not in attention:
        return f"attn_implementation={impl!r}: the lean forward runs SDPA (use {' or '.join(attention)})"
    devices = set((getattr(model, "hf_device_map", None) or {}).values())
    if len(devices) > 1:
        return "the model is split over several devices (device_map)"
    for i, layer in enumerate(inner.layers):
        a = getattr(layer, "self_attn", None)
        if a is None or not all(hasattr(a, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim")):
            return f"layer {i} has no Llama-style self_attn"
        if any(hasattr(a, n) for n in ("q_norm", "k_norm")):
            return f"layer {i}'s attention normalises q/k (q_norm/k_norm)"
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
            return f"layer {i} has no gated MLP (gate_proj/up_proj/down_proj)"
    return None


def _rms(norm: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """``LlamaRMSNorm.forward``'s ops: the statistics in fp32, the weight applied in the input dtype. In fp32,
    ``F.rms_norm`` (ATen composes it of the same ops, ``pow -> mean -> + eps -> rsqrt -> * -> * weight``: the same
    values, bitwise, in one call instead of five)."""
    dtype = h.dtype
    if dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(h, (h.shape[-1],), norm.weight, norm.variance_epsilon)
    x = h if dtype == torch.float32 else h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * (x if dtype == torch.float32 else x.to(dtype))


def _lin(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if type(mod) is nn.Linear:
        return F.linear(x, mod.weight, mod.bias)
    return mod(x)  # a quantized linear (int8), or any other replacement module


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    if n == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n, s, d).reshape(b, h * n, s, d)


def embed(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor):
    """The embeddings of ``ids`` [B, T] and the rotary tables at ``positions``, as [B, 1, T, D] (broadcast over
    heads): what every decoder layer starts from."""
    inner = model.model
    h = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(h, position_ids=positions)  # (the model's own: every rope scaling it knows)
    return h, cos[:, None], sin[:, None]


def decoder_layers(model: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, lin=_lin,
                   on_layer=None):
    """Every decoder layer over ``h`` [B, T, hidden]; ``attend(self_attn, q, k, v)`` stores the new keys/values
    where its cache keeps them and returns the attention output [B, heads, T, head_dim]; ``lin(module, x)`` runs a
    projection; ``on_layer(i, h)``, if given, sees the hidden states entering layer ``i``."""
    for i, layer in enumerate(model.model.layers):
        if on_layer is not None:
            on_layer(i, h)
        h = decoder_layer(layer, h, cos, sin, attend, lin)
    return h


def decoder_layer(layer: nn.Module, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend, lin=_lin
                  ) -> torch.Tensor:
    """One decoder layer over ``h`` [B, T, hidden] (:func:`decoder_layers`' step; the same arguments)."""
    bsz, t = h.shape[:2]
    a, mlp = layer.self_attn, layer.mlp
    x = _rms(layer.input_layernorm, h)
    q = lin(a.q_proj, x).view(bsz, t, -1, a.head_dim).transpose(1, 2)
    k = lin(a.k_proj, x).view(bsz, t, -1, a.head_dim).transpose(1, 2)
    v = lin(a.v_proj, x).view(bsz, t, -1, a.head_dim).transpose(1, 2)
    o = attend(a, _rotate(q, cos, sin), _rotate(k, cos, sin), v)
    h = h + lin(a.o_proj, o.transpose(1, 2).reshape(bsz, t, -1))
    x = _rms(layer.post_attention_layernorm, h)
    return h + lin(mlp.down_proj, F.silu(lin(mlp.gate_proj, x)) * lin(mlp.up_proj, x))


def head(model: nn.Module, h: torch.Tensor, lin=_lin) -> torch.Tensor:
    """Logits of the final hidden states ``h`` (final norm, LM head; pardec's draft scatters its kept ids into the
    vocabulary)."""
    return norm_head(model, h, lin)[1]


def norm_head(model: nn.Module, h: torch.Tensor, lin=_lin, keep: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the final norm's output, what the LM head reads; the logits) of the final hidden states ``h``; with
    ``keep`` (position indices), the logits of those positions only (the LM head sees only their rows, as
    ``logits_to_keep`` does: an int8 head scales its whole input at once)."""
    normed = _rms(model.model.norm, h)
    logits = lin(model.lm_head, normed if keep is None else normed[:, keep])
    full = getattr(model, "full_logits", None)
    return normed, (full(logits) if full is not None else logits)


def capture_layers(hidden_layer: int | tuple[int, ...] | list[int] | None, num_layers: int, name: str
                   ) -> tuple[int, ...] | None:
    """``hidden_layer`` as the tuple of layers a forward captures (None: none), each checked: 0 (the embeddings) ..
    ``num_layers`` (after the final norm) of model ``name``."""
    if hidden_layer is None:
        return None
    layers = (hidden_layer,) if isinstance(hidden_layer, int) else tuple(int(i) for i in hidden_layer)
    for i in layers:
        if not 0 <= i <= num_layers:
            raise ValueError(f"hidden_layer={i} is out of range: choose 0 (the embeddings) .. {num_layers} "
                             f"(after the final norm) for {name}'s {num_layers} layers")
    if not layers:
        raise ValueError("hidden_layer=(): name at least one layer to capture")
    return layers


@contextmanager
def capturing(decoder: nn.Module | None, capture: tuple[int, ...] | None) -> Iterator[dict[int, torch.Tensor]]:
    """While open, a forward of transformers' Llama-style ``decoder`` (``model.model``: ``layers``, ``norm``) records
    into the yielded dict what :func:`captured` reads: the hidden states entering layer ``i`` for each ``i`` of
    ``capture`` below the layer count, the final norm's output for ``i`` equal to it (hooks, removed on closing).
    Unlike ``output_hidden_states=True``, the other layers' states are never kept. Nothing to capture (``capture``
    None or empty): no hooks, and ``decoder`` is not read (any model)."""
    seen: dict[int, torch.Tensor] = {}
    hooks = []
    for i in capture or ():
        if i == len(decoder.layers):
            hooks.append(decoder.norm.register_forward_hook(lambda _m, _args, out, i=i: seen.__setitem__(i, out)))
        else:
            hooks.append(decoder.layers[i].register_forward_pre_hook(
                lambda _m, args, kw, i=i: seen.__setitem__(i, args[0] if args else kw["hidden_states"]),
                with_kwargs=True))
    try:
        yield seen
    finally:
        for hook in hooks:
            hook.remove()


def captured(seen: dict[int, torch.Tensor], normed: torch.Tensor, capture: tuple[int, ...], n_layers: int
             ) -> torch.Tensor:
    """The hidden states a forward captured, [B, T, len(capture) * H]: for each layer of ``capture`` in order, those
    entering it (``seen[i]``), or ``normed`` (after the final norm) for ``n_layers``; concatenated on the last
    dimension (EAGLE-3's low/mid/high features; one layer: that layer's states)."""
    parts = [normed if i == n_layers else seen[i] for i in capture]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def lean_logits(model: nn.Module, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                keep: int | torch.Tensor | None, capture: tuple[int, ...] | None = None):
    """Logits [B, T', V] of ``ids`` [B, T] at ``positions`` [B, T] after the positions ``cache`` holds (which gets
    their keys/values), as ``model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache,
    logits_to_keep=keep)`` computes them. ``mask``: an additive [B, 1, T, past+T] mask, or None for causal
    attention (then ``T == 1`` or an empty cache). ``keep``: None (all positions), an int (the last ones) or a tensor
    of position indices. With ``capture`` (layer indices), ``(logits, the hidden states of every position entering
    those layers)`` (:func:`captured`)."""
    h, cos, sin = embed(model, ids, positions)
    causal = mask is None and ids.shape[1] > 1

    def attend(a, q, k, v):
        k, v = cache.update(k, v, a.layer_idx)
        groups = q.shape[1] // k.shape[1]
        if mask is None:  # (transformers' sdpa: grouped-query attention inside SDPA when there is no mask)
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=a.scaling, enable_gqa=groups > 1)
        return F.scaled_dot_product_attention(q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=mask,
                                              scale=a.scaling)

    seen: dict[int, torch.Tensor] = {}
    h = decoder_layers(model, h, cos, sin, attend, on_layer=seen.__setitem__ if capture is not None else None)
    full = h
    if isinstance(keep, int) and keep > 0:
        h = h[:, -keep:]
    elif isinstance(keep, torch.Tensor):
        h = h[:, keep]
    logits = head(model, h)
    if capture is None:
        return logits
    n = len(model.model.layers)
    return logits, captured(seen, _rms(model.model.norm, full) if n in capture else full, capture, n)
