"""`lookahead`: lookahead decoding (Fu et al. 2024), target model only.

Each step is one target forward over two branches under one mask (:func:`~pardec.decoding.ngram.lookahead_forward`):

* the **lookahead branch**, a :class:`~pardec.decoding.ngram.LookaheadWindow` of ``level - 1`` levels by
  ``window`` columns iterated Jacobi-style; once full it yields ``window`` n-grams (n = ``level``) per step into
* the **n-gram pool** (:class:`~pardec.decoding.ngram.NGramPool`), keyed by first token, at most ``guess_set``
  per key, least recently used evicted; by default only the window's n-grams go in (LADE's default);
* the **verification branch**: up to ``guess_set`` pool n-grams keyed by the last committed token, as a trie
  (:class:`~pardec.decoding.tree.Tree`), verified by :func:`~pardec.decoding.verify.verify_tree`: greedy commits
  the longest candidate prefix equal to the target's argmax plus one target token (token-exact with ``ar``);
  sampling uses the recursive rejection rule for deterministic candidates (exact in distribution).

Defaults are the paper's 7B setting (W=15, N=5, G=15). The window (LADE's layout, see
:class:`~pardec.decoding.ngram.LookaheadWindow`) starts from ``W+N-3`` random prompt tokens (seeded by
``sampling.seed``), as LADE's ``copy_from`` initialisation.

Pool sources beyond the window (both off by default, as LADE's ``POOL_FROM_PROMPT=0``): ``pool_from_prompt`` seeds
the pool with the prompt's n-grams (LADE's ``fill_pool_with_prompt``), ``pool_from_output`` adds the n-grams that end
in each newly committed token (LADE's ``append_new_generated_pool``, which its code runs under the same flag); LADE's
``POOL_FROM_PROMPT=1`` is both on. ``pool_from_output`` makes the pool find repeats of the output itself
(prompt-lookup-like hits, pardec's earlier behaviour). Works on any causal LM, a CLLM checkpoint
(``model=local``) included, as the CLLM paper pairs them.

Reported per generation (``extras``): ``accepted_per_step`` (tokens per target forward after the prefill),
``pool_lookup_rate`` (steps whose last token had candidates), ``pool_hit_rate`` (steps where a candidate
token was accepted), ``pool_size`` (n-grams at the end).
"""

from __future__ import annotations

import torch

from pardec.decoding.base import Decoder, GenerationResult, register_method
from pardec.decoding.ngram import (
    LookaheadWindow,
    NGramPool,
    candidate_tree,
    check_ranges,
    keep_path,
    lookahead_forward,
    prompt_filler,
)
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree


class LookaheadState:
    """What batch-1 and batched ``lookahead`` share: the parameters (checked once) and, per request, the pool and
    window and how each step's tokens reach the pool."""

    def set_lookahead(self, level: int, window: int, guess_set: int, pool_from_prompt: bool,
                      pool_from_output: bool) -> None:
        check_ranges(level=level, window=window, guess_set=guess_set)
        self.level, self.window, self.guess_set = level, window, guess_set
        self.pool_from_prompt, self.pool_from_output = pool_from_prompt, pool_from_output

    def begin_request(self, prompt: list[int], seed: int) -> tuple[NGramPool, LookaheadWindow]:
        """A request's pool (the prompt's n-grams with ``pool_from_prompt``) and window (random prompt tokens)."""
        pool = NGramPool(self.level, self.guess_set)
        if self.pool_from_prompt:
            pool.add_sequence(prompt)
        return pool, LookaheadWindow(self.window, self.level, prompt_filler(prompt, seed))

    def pool_output(self, pool: NGramPool, prompt: list[int], tokens: list[int], kept: int) -> None:
        """``pool_from_output``: the n-grams that end in the ``kept`` tokens just committed (``tokens``: the output)."""
        if self.pool_from_output:
            recent = prompt[-self.level:] + tokens[-(kept + self.level - 1):]
            pool.add_sequence(recent[-(kept + self.level - 1):])


@register_method("lookahead", aliases=("lade",))
class Lookahead(LookaheadState, Decoder):
    exactness = "distribution"
    custom_mask = True

    def __init__(self, target, tokenizer=None, draft=None, level: int = 5, window: int = 15, guess_set: int = 15,
                 pool_from_prompt: bool = False, pool_from_output: bool = False):
        super().__init__(target, tokenizer, draft)
        self.set_lookahead(level, window, guess_set, pool_from_prompt, pool_from_output)

    def candidates(self, pool: NGramPool, last: int, room: int) -> Tree:
        """The verification branch: pool continuations of ``last``, cut to ``room`` tokens; tests override it."""
        return candidate_tree(pool, last, self.guess_set, room)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        prompt = st.ids[0].tolist()
        pool, window = self.begin_request(prompt, st.s.seed)
        steps = lookups = hits = 0
        while not st.out.done:
            tree = self.candidates(pool, last, st.out.room - 1)  # the target adds one token
            tree_logits, top = lookahead_forward(self.target, [last], tree, window)
            st.target_forwards += 1
            # the window's next guesses come back in the verification's one host read
            verdict = verify_tree(tree, tree_logits, st.s, st.gen, extra=top.argmax(-1))
            keep_path(self.target, 1, verdict.path)
            kept = st.out.commit(verdict.tokens)
            window.update(verdict.extra, pool, root=last)
            self.pool_output(pool, prompt, st.out.tokens, len(kept))
            steps, lookups, hits = steps + 1, lookups + (len(tree) > 1), hits + (len(verdict.path) > 1)
            last = verdict.tokens[-1]
        extras = {"accepted_per_step": (len(st.out.tokens) - 1) / steps if steps else None,
                  "pool_lookup_rate": lookups / steps if steps else None,
                  "pool_hit_rate": hits / steps if steps else None, "pool_size": len(pool)}
        return self._result(st, extras)
