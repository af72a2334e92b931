"""`pld`: prompt lookup decoding. The last n-gram of prompt + output is looked up in the same sequence
(longest n first, most recent match); the tokens that followed it are the draft, verified in one forward."""

from __future__ import annotations

import torch

from pardec.config import ConfigError
from pardec.decoding.base import Decoder, GenerationResult, register_method


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
                 num_pred: int = 10):
        super().__init__(target, tokenizer, draft)
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"method.min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min <= max")
        if num_pred < 1:
            raise ConfigError(f"method.num_pred={num_pred} is out of range: it must be >= 1")
        self.max_ngram, self.min_ngram, self.num_pred = max_ngram, min_ngram, num_pred

    def propose(self, seq: torch.Tensor) -> torch.Tensor:
        """Draft tokens for the sequence so far (prompt + output) [L]; tests override it."""
        return lookup(seq, self.max_ngram, self.min_ngram, self.num_pred)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self._start(prompt_ids, max_new_tokens, stop, sampling)
        seq = torch.cat([st.ids[0].cpu(), torch.tensor([last])])
        drafted = accepted = 0
        while not st.out.done:
            draft = self.propose(seq)[: st.out.room - 1]
            _, acc, kept = self._verify_chain(st, last, draft)
            drafted += draft.numel()
            accepted += len(acc) - 1
            last = acc[-1]
            seq = torch.cat([seq, torch.tensor(kept, dtype=torch.long)])
        extras = {"drafted_tokens": drafted, "accepted_draft_tokens": accepted,
                  "draft_acceptance": accepted / drafted if drafted else None}
        return self._result(st, extras, drafted=drafted, draft_accepted=accepted)
