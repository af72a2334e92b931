"""The frozen target's pass that hidden-state drafters (EAGLE-3, DFlash) train on: one forward over a batch giving
the states entering the draft's target layers, the logits and the embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardec.models.forward.lean import captured, capturing


@dataclass
class TargetPass:
    """One frozen target forward over ``ids`` [B, T]: ``features`` [B, T, n * H] (the states entering the draft's
    layers), ``logits`` [B, T, V] (None when not asked for), ``emb`` [B, T, H] (the target's embeddings of ``ids``)."""

    features: torch.Tensor
    logits: torch.Tensor | None
    emb: torch.Tensor


class _Enough(Exception):
    """Raised by a hook once the last state a truncated pass needs is captured."""


@torch.no_grad()
def target_pass(base, ids: torch.Tensor, layer_ids, logits: bool = True) -> TargetPass:
    """``base``: the target (a causal LM with ``.model.embed_tokens``); right-padded ids need no mask (causal). The
    features: the states entering each layer of ``layer_ids`` (``L``: after the final norm), concatenated in that
    order, captured by hooks (:func:`pardec.models.forward.lean.capturing`): only those layers' states are kept, not
    all ``L + 1`` as ``output_hidden_states`` would (33 of [B, T, 4096] for Llama-3.1-8B). Without ``logits`` the
    forward stops where the last state it needs enters its layer (a DFlash draft reading the target's first 5 of 30
    layers costs 4 of them): the states are the same, the layers after them never run."""
    layers, n_layers = tuple(int(i) for i in layer_ids), len(base.model.layers)
    stop = None if logits or n_layers in layers else max(layers)
    out = None
    with capturing(base.model, layers) as seen:
        if stop is None:
            out = base(input_ids=ids)
        else:
            def enough(_module, _args, _kwargs):
                raise _Enough

            hook = base.model.layers[stop].register_forward_pre_hook(enough, with_kwargs=True)  # after capture's
            try:
                base(input_ids=ids)
            except _Enough:
                pass
            finally:
                hook.remove()
    features = captured(seen, seen.get(n_layers), layers, n_layers)
    return TargetPass(features, None if out is None else out.logits, base.model.embed_tokens(ids))
