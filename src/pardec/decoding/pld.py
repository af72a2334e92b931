"""`pld`: prompt lookup decoding. The last n-gram of prompt + output is looked up in the same sequence
(longest n first, most recent match); the tokens that followed it are the draft, verified in one forward.

``num_pred_by_cost=true`` (pardec's, off by default: the paper drafts ``num_pred`` = 10) cuts each round's draft to
the length with the most expected tokens per ms, as ``sps``'s ``gamma_by_cost`` does
(:func:`pardec.models.cost.best_draft_length`, the draft costing nothing): the verification's cost of g + 1 rows
comes from this machine's forward-cost table, the acceptance rate from this generation's rounds. On a CPU, where a
forward of 11 rows costs 1.3-1.6x one row and prompt lookup accepts ~1.4 of its drafted tokens per round, a shorter
draft could buy more tokens per second. Measured on a 2-core Zen 4 at int8 it did not (docs/cpu_speed.md, "Speculative sampling
with the per-token target"): lookup drafts are right to their end or wrong from their first token, which the rule's
geometric acceptance does not model. Exactness is untouched: only the draft's length changes."""

from __future__ import annotations

import torch

from pardec.config import ConfigError, check_at_least
from pardec.decoding.base import Decoder, GenerationResult, register_method
from pardec.models.cost import best_draft_length


def lookup(seq: torch.Tensor, max_ngram: int, min_ngram: int, num_pred: int) -> torch.Tensor:
    """Draft tokens following the most recent earlier occurrence of the trailing n-gram of ``seq`` [L]."""
    L = seq.numel()
    for n in range(max_ngram, min_ngram - 1, -1):
        if L <= n:
            continue
        windows = seq[: L - 1].unfold(0, n, 1)  # [L-n, n]: every n-gram that has a successor
        hits = (windows == seq[L - n :]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return seq[start : start + num_pred]
    return seq[:0]


@register_method("pld", aliases=("prompt_lookup",))
class PromptLookup(Decoder):
    exactness = "distribution"

    def __init__(self, target, tokenizer=None, draft=None, max_ngram: int = 3, min_ngram: int = 1,
                 num_pred: int = 10, num_pred_by_cost: bool = False):
        super().__init__(target, tokenizer, draft)
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"method.min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min <= max")
        check_at_least("method.num_pred", num_pred, 1)
        self.max_ngram, self.min_ngram, self.num_pred = max_ngram, min_ngram, num_pred
        self.num_pred_by_cost = num_pred_by_cost

    def propose(self, seq: torch.Tensor) -> torch.Tensor:
        """Draft tokens for the sequence so far (prompt + output) [L]; tests override it."""
        return lookup(seq, self.max_ngram, self.min_ngram, self.num_pred)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        if self.num_pred_by_cost and self.target.cost is None:
            raise ConfigError("method.num_pred_by_cost=true needs this machine's forward-cost table for the target, "
                              "and there is none: run python -m pardec.bench cost (and keep forward_padding=true)")
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        seq = torch.cat([st.ids[0].cpu(), torch.tensor([last])])
        drafted = accepted = rejections = 0
        while not st.out.done:
            draft = self.propose(seq)[: st.out.room - 1]
            if self.num_pred_by_cost and draft.numel() > 1:
                draft = draft[: best_draft_length(self.target.cost, accepted, rejections, 0.0, 1, draft.numel())]
            _, acc, kept = self._verify_chain(st, last, draft)
            drafted += draft.numel()
            accepted += len(acc) - 1
            rejections += len(acc) - 1 < draft.numel()
            last = acc[-1]
            seq = torch.cat([seq, torch.tensor(kept, dtype=torch.long)])
        extras = {"drafted_tokens": drafted, "accepted_draft_tokens": accepted,
                  "draft_acceptance": accepted / drafted if drafted else None}
        return self._result(st, extras, drafted=drafted, draft_accepted=accepted)
