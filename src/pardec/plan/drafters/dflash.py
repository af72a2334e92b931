"""DFlash's draft in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import stack_activations

#: fp32 copies of the slots' logits a whole training step holds beyond them: 2.2 measured in the step
#: (tests/test_plan_measured.py), where the loss alone, measured apart, holds 3 (LOSS_PEAK["dflash"])
SLOT_COPIES = 2.2


@plan_terms("dflash")
def terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms:
    """num_anchors blocks of block_size queries per sequence through the draft's layers, each over the sequence's
    context keys/values plus the blocks'; fp32 logits of every predicted slot over the target's vocabulary (the
    shared head) or a reduced head's ids, and, for the KL loss, the base's logits."""
    n, blk = int(h.get("num_layers", 5)), int(h.get("block_size", 16))
    queries = b * min(int(h.get("num_anchors", 512)), seq) * blk
    activations = stack_activations(n, queries, seq + queries // b, a, act_bytes, eager, ckpt)
    kv = tokens * n * 2 * a.kv_heads * a.head_dim * act_bytes  # every layer's context keys/values
    # the target's logits only for the KL loss: for CE its pass stops at the last layer the draft reads
    base = tokens * a.vocab * run_bytes if h.get("loss", "ce") == "kl" else 0
    vocab = int(h.get("draft_vocab_size") or a.vocab)  # a reduced head's ids, or the target's whole vocabulary
    logits = queries * vocab * (act_bytes + 4 * SLOT_COPIES) + base
    return DrafterTerms(activations, logits, kv, note=f"dflash drafter, {n} layers, {queries // b} block slots per "
                                                      f"sequence")
