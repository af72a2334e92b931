"""Medusa's heads in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import loss_logits


@plan_terms("medusa")
def terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms:
    """The base runs without gradients; each head's ResBlocks keep input, pre-activation and SiLU output; K student
    rows (each depth's KL to the base's row) and the base's row per position."""
    k = int(h.get("num_heads", 3))
    activations = tokens * a.hidden * act_bytes * (1 + 3 * k * int(h.get("num_blocks", 1)))
    logits = loss_logits(k * tokens, a.vocab, "kl", act_bytes) + tokens * a.vocab * run_bytes
    return DrafterTerms(activations, logits, note=f"medusa drafter, K={k}")
