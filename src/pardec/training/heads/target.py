"""The frozen target's pass that hidden-state drafters (EAGLE-3, DFlash) train on: one forward over a batch giving
the states entering the draft's target layers, the logits and the embeddings."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardec.models.forward.lean import captured, capturing


@dataclass
class TargetPass:
    """One frozen target forward over ``ids`` [B, T]: ``features`` [B, T, n * H] (the states entering the draft's
    layers), ``logits`` [B, T, V], ``emb`` [B, T, H] (the target's embeddings of ``ids``)."""

    features: torch.Tensor
    logits: torch.Tensor
    emb: torch.Tensor


@torch.no_grad()
def target_pass(base, ids: torch.Tensor, layer_ids) -> TargetPass:
    """``base``: the target (a causal LM with ``.model.embed_tokens``); right-padded ids need no mask (causal). The
    features: the states entering each layer of ``layer_ids`` (``L``: after the final norm), concatenated in that
    order, captured by hooks (:func:`pardec.models.forward.lean.capturing`): only those layers' states are kept, not
    all ``L + 1`` as ``output_hidden_states`` would (33 of [B, T, 4096] for Llama-3.1-8B)."""
    layers, n_layers = tuple(int(i) for i in layer_ids), len(base.model.layers)
    with capturing(base.model, layers) as seen:
        out = base(input_ids=ids)
    features = captured(seen, seen.get(n_layers), layers, n_layers)
    return TargetPass(features, out.logits, base.model.embed_tokens(ids))
