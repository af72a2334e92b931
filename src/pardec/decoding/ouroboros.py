"""`ouroboros`: Ouroboros (Zhao et al. 2024, "Ouroboros: Generating Longer Drafts Phrase by Phrase for Faster
Speculative Decoding", EMNLP 2024), a draft model that drafts phrase by phrase, drafts lengthened by candidate
phrases, and a phrase pool fed by verification and kept across prompts.

Each round:

1. **Drafting** (``accelerated_drafting``, Sec. 3.1): the draft model runs lookahead decoding itself -- its own window
   (:class:`~pardec.decoding.ngram.LookaheadWindow`, LADE's layout) fills the shared phrase pool, and each draft
   forward verifies up to ``guess_set`` pool phrases against the draft's own distribution, so one draft forward can
   add several tokens -- until ``gamma`` tokens are drafted. Off: plain token-by-token drafting.
   Draft tokens are exact samples from the draft's warped distribution ``q`` (greedy: its argmax), with ``q``
   recorded for each, whatever the route.
2. **Lengthening** (``lengthening``, Sec. 3.2): the ``top_k_phrases`` most recent pool phrases that continue the
   draft's last token are appended as children of the draft's last node; draft + phrases are verified in one target
   forward as a :class:`~pardec.decoding.tree.Tree` (the draft causal, each phrase sees the draft and its own
   prefix, phrases do not see each other). If the draft is fully accepted the longest matching phrase extends it.
   Verification is :func:`~pardec.decoding.verify.verify_tree` with ``q`` on the draft chain and deterministic
   phrases: greedy output equals ``ar`` token for token, sampled output follows the target exactly.
3. **Phrases from verification** (Sec. 3.3), from the target's argmax at every node of that forward:

   * ``refine_phrases``: each lengthening phrase the target scored is replaced in the pool, in place, by the
     target's version (its token after the draft, then its token after each of the phrase's prefixes), so a phrase
     the target partly confirms comes back corrected (official ``CacheEngine.update_in_place``, applied to the
     top-K phrases after every verification; phrases cut by the token budget are left alone);
   * ``verified_phrases``: where the draft was rejected, phrases from its rejected suffix go into the pool.
     ``phrase_harvest="target"`` (default, official ``CacheEngine.add_extra_ngram``): for each rejected-suffix
     token, the target's next ``level - 1`` tokens after it, kept only when the draft agreed with the target on all
     but the last of them (the last may be the target's correction) -- full-length phrases of target tokens.
     ``"confirmed_runs"`` (pardec's earlier behaviour): runs of >= 2 draft tokens each equal to the target's argmax
     after its predecessor, keyed by the token before the run (variable length, draft tokens only).

   Phrases only change speed, never the output: greedy stays token-exact, sampling exact in distribution (the
   harvest reads the target's argmax whatever the sampling settings).
4. **Warm start** (``warm_start``, Sec. 3.4; the paper's full method, the last row of its ablation, Table 4): the pool
   persists across the prompts of a run. The evaluation loop builds one decoder per role and keeps it for every
   prompt (rebuilt once after the warm-up, which must leave nothing behind). Consequences: a prompt's speed figures
   (target forwards, ``block_efficiency``, ``pool_size``) depend on the prompts run before it on the same rank;
   the greedy tokens never do. A resumed run starts its pool empty at the first prompt it still has to run, and
   several ranks each keep their own pool: their speed figures are not those of one uninterrupted single-process
   run (sampled tokens may differ too -- each still an exact sample -- since the random draws follow the tree
   shapes). ``repeats > 1`` run the same prompt again with the pool its earlier repeats filled.

Defaults: the paper's code-generation setting for the Yi-34B / Yi-6B pair (HumanEval), which is the official
README's example and ``benchmark/test_human_eval.py``'s argparse defaults (gamma 12, window 20, guess set 20,
level 7), top-3 phrases (``ouroboros(topk=3)``); per-task values are in the ``conf/recipe/ouroboros_*`` recipes.
Reported (``extras``): ``block_efficiency`` (the paper's App. C: generated tokens / target forwards, the prefill
included; drafting cost ignored), ``draft_forwards_per_token``, ``accepted_from_draft`` / ``accepted_from_phrases``
(the split of accepted tokens), ``phrases_refined`` (pool phrases changed in place), ``pool_size``.
"""

from __future__ import annotations

import copy

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


class OuroborosState:
    """What batch-1 and batched ``ouroboros`` share: the parameters (their defaults, checked once) and the phrase
    rules of Sec. 3.2-3.3 on a pool (the run's, or a request's without ``warm_start`` over a batch)."""

    #: ``phrase_harvest`` choices: the official ``add_extra_ngram`` rule, and pardec's earlier one
    HARVESTS = ("target", "confirmed_runs")

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 12, window: int = 20, guess_set: int = 20,
                 level: int = 7, top_k_phrases: int = 3, accelerated_drafting: bool = True,
                 lengthening: bool = True, verified_phrases: bool = True, phrase_harvest: str = "target",
                 refine_phrases: bool = True, warm_start: bool = True):
        super().__init__(target, tokenizer, draft)  # (the decoder's: batch-1's or the batched one's)
        check_ranges(gamma=gamma, window=window, guess_set=guess_set, level=level, top_k_phrases=top_k_phrases)
        if lengthening and top_k_phrases == 0:
            raise ConfigError("method.top_k_phrases=0 with method.lengthening=true: lengthening needs >= 1 phrase "
                              "(or set method.lengthening=false)")
        if phrase_harvest not in self.HARVESTS:
            raise ConfigError(f"method.phrase_harvest={phrase_harvest!r} is not one of {', '.join(self.HARVESTS)}")
        self.gamma, self.window, self.guess_set, self.level = gamma, window, guess_set, level
        self.top_k_phrases = top_k_phrases
        self.accelerated_drafting, self.lengthening = accelerated_drafting, lengthening
        self.verified_phrases, self.phrase_harvest = verified_phrases, phrase_harvest
        self.refine_phrases, self.warm_start = refine_phrases, warm_start
        self.pool = NGramPool(level, guess_set)

    def new_window(self, prompt: list[int], seed: int) -> LookaheadWindow | None:
        """The draft's lookahead window for a prompt (random prompt tokens), or None without accelerated drafting."""
        return LookaheadWindow(self.window, self.level, prompt_filler(prompt, seed)) if self.accelerated_drafting \
            else None

    def lengthening_phrases(self, pool: NGramPool, draft: list[int], room: int) -> list[tuple[int, ...]]:
        """The ``top_k_phrases`` most recent pool phrases continuing the draft's last token, cut to ``room``."""
        if not self.lengthening or room <= 0:
            return []
        return [p[:room] for p in pool.get(draft[-1], self.top_k_phrases)]

    def whole_phrases(self, pool: NGramPool, draft: list[int], phrases: list[tuple[int, ...]]
                      ) -> list[tuple[int, ...]]:
        """The lengthening ``phrases`` verified uncut (one cut by the budget is left alone), which
        ``refine_phrases`` refines after the verification."""
        verified = set(phrases)
        return [p for p in pool.get(draft[-1], self.top_k_phrases) if p in verified] if self.refine_phrases else []

    def learn(self, pool: NGramPool, tree: Tree, draft: list[int], whole: list[tuple[int, ...]], pred: list[int],
              accepted: int) -> int:
        """Sec. 3.3 after a verification of ``tree`` (the ``draft`` chain and its phrases; ``pred[j]``: the target's
        argmax at node j; ``accepted``: draft tokens accepted): ``whole`` refined, the rejected suffix harvested.
        Returns the phrases refined."""
        refined = self.refine(pool, tree, len(draft), whole, draft[-1], pred) if whole else 0
        if self.verified_phrases and accepted < len(draft):
            self.harvest(pool, draft, pred, accepted)
        return refined

    def harvest(self, pool: NGramPool, draft: list[int], pred: list[int], accepted: int) -> None:
        """Sec. 3.3: phrases from the rejected draft suffix into ``pool``. ``pred[j]``: the target's argmax at node j
        (node j >= 1 holds ``draft[j-1]``; ``pred[len(draft)]`` follows the whole draft); ``draft[accepted]`` is the
        first rejected token."""
        k = len(draft)
        if self.phrase_harvest == "confirmed_runs":
            run: list[int] = []
            key = None
            for j in range(accepted + 1, k):
                if pred[j] == draft[j]:
                    if not run:
                        key = draft[j - 1]
                    run.append(draft[j])
                    continue
                if len(run) >= 2:
                    pool.add(key, run)
                run = []
            if len(run) >= 2:
                pool.add(key, run)
            return
        want = self.level - 1
        for s in range(accepted, k):  # key: rejected-suffix token draft[s]; the target's tokens after it
            phrase: list[int] = []
            for j in range(s + 1, min(s + want, k) + 1):  # node j's argmax is the target's token after draft[j-1]
                phrase.append(pred[j])
                if j < k and draft[j] != pred[j]:  # the target corrects the draft here: the phrase ends
                    break
            if len(phrase) == want:
                pool.add(draft[s], phrase)

    def refine(self, pool: NGramPool, tree: Tree, k: int, phrases: list[tuple[int, ...]], key: int, pred: list[int]
               ) -> int:
        """Sec. 3.3 (official ``update_in_place``): each ``pool`` phrase verified whole after the draft (``phrases``)
        becomes, in place, the target's version of it: its argmax after the draft (node ``k``), then after each of
        the phrase's prefixes. Returns the phrases changed."""
        changed = 0
        for phrase in phrases:
            node, fixed = k, [pred[k]]
            for tok in phrase[:-1]:
                node = next(c for c in tree.children[node] if tree.labels[c] == tok)
                fixed.append(pred[node])
            if tuple(fixed) != phrase and pool.replace(key, phrase, fixed):
                changed += 1
        return changed


@register_method("ouroboros")
class Ouroboros(OuroborosState, Decoder):
    exactness = "distribution"
    custom_mask = True
    needs_draft = True

    def carried(self) -> NGramPool | None:
        return copy.deepcopy(self.pool) if self.warm_start else None

    def restore(self, carried: NGramPool | None) -> None:
        if carried is not None:
            self.pool = copy.deepcopy(carried)

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
            # one host read per draft forward: the window's next guesses ride on the verification's read, and the
            # kept tokens are settled as host values (the next sync reads nothing back)
            verdict = verify_tree(tree, logits, st.s, st.gen, extra=None if window is None else top.argmax(-1))
            keep_path(d, len(feed), verdict.path, known=feed + verdict.tokens[:-1])
            if window is not None:
                window.update(verdict.extra, self.pool, root=feed[-1])
            toks += verdict.tokens
            if not st.s.greedy:  # each token is an exact sample from q at its parent node
                qs += [warp(logits[n], st.s) for n in verdict.path]
        return toks[:k], qs[:k], forwards

    # ------------------------------------------------------------------------------------------- rounds
    def phrases_for(self, draft: list[int], room: int) -> list[tuple[int, ...]]:
        """The lengthening phrases of the run's pool; tests override it."""
        return self.lengthening_phrases(self.pool, draft, room)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        if not self.warm_start:
            self.pool.clear()
        self.draft.reset()
        prompt = st.ids[0].tolist()
        window = self.new_window(prompt, st.s.seed)
        drafted = from_draft = from_phrases = rounds = refined = 0
        clock = DraftClock()
        while not st.out.done:
            room = st.out.room - 1  # the target adds one token of its own
            k = min(self.gamma, room)
            if k < 1:
                last = self._step_alone(st, last)
                continue
            toks, qs, _ = clock.run(st, self.draft_phrases, prompt + st.out.tokens, k, st, window)
            phrases = self.phrases_for(toks, room - len(toks))
            whole = self.whole_phrases(self.pool, toks, phrases)
            tree = Tree.from_paths([toks] + [toks + list(p) for p in phrases])  # nodes 1..k: the draft chain
            q = {i: qs[i] for i in range(len(qs))} if qs else None  # node i's child (draft token i+1) came from q
            # the target's token after every node, when the pool may need it: read with the verdict, one host read
            want_pred = bool(whole) or self.verified_phrases
            _, verdict, _ = self._verify_tree(st, last, tree, q,
                                              extra=(lambda lg: lg.argmax(-1)) if want_pred else None)
            acc, pred = verdict.tokens, verdict.extra
            n_acc = len(acc) - 1
            drafted += len(toks)
            from_draft += min(n_acc, len(toks))
            from_phrases += max(0, n_acc - len(toks))
            refined += self.learn(self.pool, tree, toks, whole, pred, n_acc)
            rounds += 1
            last = acc[-1]
        n_new = len(st.out.tokens)
        extras = {"block_efficiency": n_new / st.target_forwards,  # App. C: generated tokens / target forwards
                  "draft_forwards_per_token": clock.forwards / n_new if n_new else None,
                  "accepted_from_draft": from_draft, "accepted_from_phrases": from_phrases,
                  "draft_acceptance": from_draft / drafted if drafted else None, "phrases_refined": refined,
                  "pool_size": len(self.pool)}
        return self._result(st, extras, clock.forwards, clock.seconds, drafted, from_draft)
