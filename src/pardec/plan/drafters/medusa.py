"""Medusa's heads in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import depth_logits

#: fp32 copies of one depth's logits besides the K depths' own 3 each (:func:`~pardec.plan.formulas.depth_logits`):
#: measured (tests/test_plan_measured.py, K = 2)
BASE_COPIES = 2.5


@plan_terms("medusa")
def terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms:
    """The base runs without gradients; each head's ResBlocks keep input, pre-activation and SiLU output; the
    logits: :func:`depth_logits` (K student rows per position and the base's row, each depth's KL to it)."""
    k = int(h.get("num_heads", 3))
    activations = tokens * a.hidden * act_bytes * (1 + 3 * k * int(h.get("num_blocks", 1)))
    return DrafterTerms(activations, depth_logits(k, tokens, a.vocab, run_bytes, BASE_COPIES),
                        note=f"medusa drafter, K={k}")
