"""FIRP's projections in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import layer_activations, loss_logits, stack_activations


@plan_terms("firp")
def terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms:
    """Pseudo states of projection i run through layers t_i..L-1 with gradients, attending to the real tokens'
    keys/values; K student rows (each depth's KL to the base's row) and the base's row per position."""
    layers = [int(x) for x in h.get("layers") or []]
    k = len(layers)
    passes = sum(a.layers - x for x in layers)
    activations = (stack_activations(passes, tokens, seq, a, act_bytes, eager, ckpt)
                   - (layer_activations(tokens, seq, a, act_bytes, eager) if ckpt else 0)
                   + (layer_activations(k * tokens, seq, a, act_bytes, eager) if ckpt else 0))
    kv = tokens * a.kv_bytes_per_token(run_bytes)  # the real tokens' K/V the pseudo states attend to
    logits = loss_logits(k * tokens, a.vocab, "kl", act_bytes) + tokens * a.vocab * run_bytes
    return DrafterTerms(activations, logits, kv, note=f"firp drafter, K={k}")
