"""FIRP's projections in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import depth_logits, layer_activations, stack_activations

#: as Medusa's (:data:`pardec.plan.drafters.medusa.BASE_COPIES`), and the base's own logits at the anchors that
#: the pseudo pass returns beside the students' (measured, K = 2)
BASE_COPIES = 4.0


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
    logits = depth_logits(k, tokens, a.vocab, run_bytes, BASE_COPIES)
    return DrafterTerms(activations, logits, kv, note=f"firp drafter, K={k}")
