"""`ouroboros`: Ouroboros (Zhao et al. 2024), a draft model that drafts phrase by phrase, drafts lengthened by
candidate phrases, and a phrase pool fed by verification and kept across prompts.

Each round:

1. **Drafting** (``accelerated_drafting``): the draft model runs lookahead decoding itself -- its own window
   (:class:`~pardec.decoding.ngram.LookaheadWindow`) fills the shared phrase pool, and each draft forward
   verifies up to ``guess_set`` pool phrases against the draft's own distribution, so one draft forward can
   add several tokens -- until ``gamma`` tokens are drafted. Off: plain token-by-token drafting.
   Draft tokens are exact samples from the draft's warped distribution ``q`` (greedy: its argmax), with ``q``
   recorded for each, whatever the route.
2. **Lengthening** (``lengthening``): the ``top_k_phrases`` most recent pool phrases that continue the draft's
   last token are appended as children of the draft's last node; draft + phrases are verified in one target
   forward as a :class:`~pardec.decoding.tree.Tree` (the draft causal, each phrase sees the draft and its own
   prefix, phrases do not see each other). If the draft is fully accepted the longest matching phrase extends it.
   Verification is :func:`~pardec.decoding.verify.verify_tree` with ``q`` on the draft chain and deterministic
   phrases: greedy output equals ``ar`` token for token, sampled output follows the target exactly.
3. **Phrases from verification** (``verified_phrases``): where the draft was rejected, the pieces of its rejected
   suffix that the target confirms (each token equal to the target's argmax after its predecessor, Sec. 3.3)
   go into the pool as phrases.
4. **Warm start** (``warm_start``): the pool persists across the prompts of a run (the paper's context locality).

Defaults follow the official implementation (gamma 4, window 20, guess set 20, level 7, top-3 phrases).
Reported (``extras``): ``block_efficiency`` (tokens per target forward after the prefill; drafting cost
ignored, the paper's Appendix C), ``draft_forwards_per_token``, ``accepted_from_draft`` /
``accepted_from_phrases`` (the split of accepted tokens), ``pool_size``.
"""

from __future__ import annotations

import torch

from pardec.config import ConfigError
from pardec.decoding.base import Decoder, DraftClock, GenerationResult, register_method
from pardec.decoding.ngram import (
    LookaheadWindow,
    NGramPool,
    candidate_tree,
    check_ranges,
    keep_path,
    lookahead_forward,
    prompt_filler,
)
from pardec.decoding.sampling import warp
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree


@register_method("ouroboros")
class Ouroboros(Decoder):
    exactness = "distribution"
    custom_mask = True
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 4, window: int = 20, guess_set: int = 20,
                 level: int = 7, top_k_phrases: int = 3, accelerated_drafting: bool = True,
                 lengthening: bool = True, verified_phrases: bool = True, warm_start: bool = False):
        super().__init__(target, tokenizer, draft)
        check_ranges(gamma=gamma, window=window, guess_set=guess_set, level=level, top_k_phrases=top_k_phrases)
        if lengthening and top_k_phrases == 0:
            raise ConfigError("method.top_k_phrases=0 with method.lengthening=true: lengthening needs >= 1 phrase "
                              "(or set method.lengthening=false)")
        self.gamma, self.window, self.guess_set, self.level = gamma, window, guess_set, level
        self.top_k_phrases = top_k_phrases
        self.accelerated_drafting, self.lengthening = accelerated_drafting, lengthening
        self.verified_phrases, self.warm_start = verified_phrases, warm_start
        self.pool = NGramPool(level, guess_set)

    # ------------------------------------------------------------------------------------------- drafting
    def draft_phrases(self, seq: list[int], k: int, st, window: LookaheadWindow | None
                      ) -> tuple[list[int], list[torch.Tensor], int]:
        """Up to ``k`` draft tokens after ``seq`` (prompt + committed). Returns (tokens, q per token, draft forwards);
        ``q`` is empty under greedy."""
        d = self.draft
        toks: list[int] = []
        qs: list[torch.Tensor] = []
        forwards = 0
        while len(toks) < k:
            feed = d.sync(seq + toks)
            room = k - len(toks) - 1  # the draft's own verification adds one token
            tree = candidate_tree(self.pool, feed[-1], self.guess_set, room) if window is not None else Tree.chain([])
            logits, top = lookahead_forward(d, feed, tree, window)
            forwards += 1
            verdict = verify_tree(tree, logits, st.s, st.gen)
            keep_path(d, len(feed), verdict.path)
            if window is not None:
                window.update(top.argmax(-1).tolist(), self.pool, advance=len(verdict.tokens))
            toks += verdict.tokens
            if not st.s.greedy:  # each token is an exact sample from q at its parent node
                qs += [warp(logits[n], st.s) for n in verdict.path]
        return toks[:k], qs[:k], forwards

    # ------------------------------------------------------------------------------------------- rounds
    def phrases_for(self, draft: list[int], room: int) -> list[tuple[int, ...]]:
        """Pool phrases continuing the draft's last token, cut to ``room`` tokens; tests override it."""
        if not self.lengthening or room <= 0:
            return []
        return [p[:room] for p in self.pool.get(draft[-1], self.top_k_phrases)]

    def _harvest_rejected(self, draft: list[int], logits: torch.Tensor, accepted: int) -> None:
        """Sec. 3.3: runs of the rejected draft suffix that the target confirms become pool phrases."""
        pred = logits.argmax(-1).tolist()
        run: list[int] = []
        key = None
        for j in range(accepted + 1, len(draft)):  # node j holds draft[j-1]; pred[j] is the target's next token
            if pred[j] == draft[j]:
                if not run:
                    key = draft[j - 1]
                run.append(draft[j])
                continue
            if len(run) >= 2:
                self.pool.add(key, run)
            run = []
        if len(run) >= 2:
            self.pool.add(key, run)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self._start(prompt_ids, max_new_tokens, stop, sampling)
        if not self.warm_start:
            self.pool.clear()
        self.draft.reset()
        prompt = st.ids[0].tolist()
        window = (LookaheadWindow(self.window, self.level, prompt_filler(prompt, st.s.seed))
                  if self.accelerated_drafting else None)
        drafted = from_draft = from_phrases = rounds = 0
        clock = DraftClock()
        while not st.out.done:
            room = st.out.room - 1  # the target adds one token of its own
            k = min(self.gamma, room)
            if k < 1:
                last = self._step_alone(st, last)
                continue
            toks, qs, _ = clock.run(st, self.draft_phrases, prompt + st.out.tokens, k, st, window)
            phrases = self.phrases_for(toks, room - len(toks))
            tree = Tree.from_paths([toks] + [toks + list(p) for p in phrases])  # nodes 1..k: the draft chain
            q = {i: qs[i] for i in range(len(qs))} if qs else None  # node i's child (draft token i+1) came from q
            logits, acc, _ = self._verify_tree(st, last, tree, q)
            n_acc = len(acc) - 1
            drafted += len(toks)
            from_draft += min(n_acc, len(toks))
            from_phrases += max(0, n_acc - len(toks))
            if self.verified_phrases and n_acc < len(toks):
                self._harvest_rejected(toks, logits, n_acc)
            rounds += 1
            last = acc[-1]
        n_new = len(st.out.tokens)
        extras = {"block_efficiency": (n_new - 1) / (st.target_forwards - 1) if st.target_forwards > 1 else None,
                  "draft_forwards_per_token": clock.forwards / n_new if n_new else None,
                  "accepted_from_draft": from_draft, "accepted_from_phrases": from_phrases,
                  "draft_acceptance": from_draft / drafted if drafted else None, "pool_size": len(self.pool)}
        return self._result(st, extras, clock.forwards, clock.seconds, drafted, from_draft)
