"""DFlash's draft in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import loss_logits, stack_activations


@plan_terms("dflash")
def terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms:
    """num_anchors blocks of block_size queries per sequence through the draft's layers, each over the sequence's
    context keys/values plus the blocks'; fp32 logits of every predicted slot over the target's vocabulary (the
    shared head), and the base's logits (its forward returns them)."""
    n, blk = int(h.get("num_layers", 5)), int(h.get("block_size", 16))
    queries = b * min(int(h.get("num_anchors", 512)), seq) * blk
    activations = stack_activations(n, queries, seq + queries // b, a, act_bytes, eager, ckpt)
    kv = tokens * n * 2 * a.kv_heads * a.head_dim * act_bytes  # every layer's context keys/values
    logits = loss_logits(queries, a.vocab, "dflash", act_bytes) + tokens * a.vocab * run_bytes
    return DrafterTerms(activations, logits, kv, note=f"dflash drafter, {n} layers, {queries // b} block slots per "
                                                      f"sequence")
