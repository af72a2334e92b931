"""EAGLE-3's draft in the memory plan."""

from __future__ import annotations

from pardec.plan.drafters import DrafterTerms, plan_terms
from pardec.plan.formulas import loss_logits, stack_activations


@plan_terms("eagle3")
def terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms:
    """One layer of 2H input unrolled ttt_steps times over every position; the target's logits once, the draft's
    over its vocabulary per step."""
    k = int(h.get("ttt_steps", 7))
    activations = stack_activations(k, tokens, seq * k, a, act_bytes, eager, ckpt)
    draft_vocab = int(h.get("draft_vocab_size", a.vocab))
    # the base's logits, its fp32 log-softmax; per TTT step the draft's logits and their loss, and the target's
    # probabilities the soft CE keeps for its backward (made outside the loss, so not in LOSS_PEAK["soft_ce"])
    logits = (tokens * a.vocab * run_bytes + tokens * draft_vocab * 4
              + loss_logits(k * tokens, draft_vocab, "soft_ce", act_bytes) + k * tokens * draft_vocab * 4)
    return DrafterTerms(activations, logits, note=f"eagle3 drafter, {k} TTT steps")
