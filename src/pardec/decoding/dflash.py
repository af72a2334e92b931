"""Method ``dflash``: a DFlash drafter (:mod:`pardec.models.dflash`) proposes a whole block in one forward from the
target's own features; the target verifies it as a chain (Chen et al. 2026; reference z-lab/dflash
``dflash_generate``).

The target runs with ``hidden_layer=layer_ids`` (the drafter's target layers), so prefill and every verification
also give the features the drafter reads. The drafter keeps a **context cache**: every layer's keys/values of the
committed tokens' fused features (preallocated for the prompt and ``max_new_tokens``; the reference's
``past_key_values_draft`` cropped back to the context after each draft forward). Each round:

1. one drafter forward over the block ``[last, mask x (block_size - 1)]`` at positions ``start .. start +
   block_size - 1`` (``start``: ``last``'s position; ``last``, the token the target chose last round, is in the
   block, not in the context), every slot seeing the whole context and the whole block;
2. the drafts are slots ``1 .. n`` (``n = num_speculative_tokens``, at most ``block_size - 1``): their argmax under
   greedy decoding (the reference's ``sample`` at temperature 0), or under sampling a token drawn from each slot's
   warped distribution ``q_k``;
3. one target forward over ``[last, d_1 .. d_n]`` (with the features), :func:`~pardec.decoding.verify.verify_chain`:
   greedy, the longest prefix equal to the target's argmax plus the target's next token (the reference's rule);
   sampling, speculative sampling against the slots' ``q_k`` (each ``q_k`` depends on the context alone, not on
   the drafts before it, so the rule stays lossless; the reference instead accepts a greedy draft while it equals
   the target's sample, the one-hot ``q`` case of the same rule);
4. the features of ``last`` and the accepted drafts join the context cache (one drafter pass: ``context_kv``).

Exactness: ``distribution`` (greedy output equals ``ar``; sampled output is distributed as the target's). Drafting
reads nothing back; each round's one host read is the verification's. ``block_size`` below the trained one drafts
from a shorter block (fewer mask slots: cheaper on a CPU, off the training distribution); above it is refused.
``tree`` (beyond the paper, whose reference verifies the block as a chain): the slots' distributions are K ranked
candidate lists, as Medusa's heads are (each slot reads the context and the anchor token, not the drafts before it),
so a static tree of their ranks (``<path>/trees/T<budget>.json``, searched by the drafter's eval stage from its
held-out rank accuracies, or a tree file) is verified in one target forward instead (the shared tree rule:
:func:`~pardec.decoding.verify.verify_tree`; deterministic candidates, so exactness stays ``distribution``); the
accepted path's features join the context cache. ``draft_vocab`` (beyond the paper: EAGLE-3's reduced draft
vocabulary applied at decoding) drafts over another
drafter's vocabulary through the target head's rows at its ids (:func:`~pardec.models.dflash.restrict_vocab`): a
head K/V as costly, each kept id's logit the whole head's; under sampling the drafts' ``q`` is 0 outside it, which
the verification's rule allows (the output's distribution is unchanged).
"""

from __future__ import annotations

from pathlib import Path

import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding.base import Decoder, DraftClock, GenerationResult, Stopper, check_range, register_method
from pardec.decoding.features import begin_with_features
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree_search import RankTree, resolve_tree, truncate_paths
from pardec.decoding.verify import verify_chain, verify_tree
from pardec.models.cached import CachedModel, to_device
from pardec.models.dflash import DFlashDraft, restrict_vocab
from pardec.models.dflash_compiled import draft_round
from pardec.models.dflash_formats import load_dflash
from pardec.models.drafters import check_int8_weights, place
from pardec.models.forward.compiled import compiler_missing
from pardec.models.vocab import DraftVocab, read_vocab


class ContextCache:
    """Every draft layer's context keys/values, preallocated ``[1, kv, capacity + spare, d]``; ``length`` entries
    filled (``spare``: slots past the capacity a compiled round writes its padding rows to,
    :mod:`pardec.models.dflash_compiled`)."""

    def __init__(self, drafter: DFlashDraft, capacity: int, device, dtype, spare: int = 0):
        c = drafter.config
        shape = (1, c.num_key_value_heads, capacity + spare, c.head_dim)
        # zeros, not empty: a compiled round attends over the whole buffer, its unwritten slots masked (a weight of
        # exactly 0 times uninitialised memory could be 0 * NaN)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(c.num_hidden_layers)]
        self.drafter, self.length, self.capacity, self.spare = drafter, 0, capacity, spare
        self.feature_width = len(c.layer_ids) * c.target_hidden_size

    def append(self, features: torch.Tensor) -> tuple[int]:
        """Context entries for ``features`` [n, K * H_t] at the next ``n`` positions; returns (draft forwards,)."""
        n = features.shape[0]
        self.check_room(n)
        pos = torch.arange(self.length, self.length + n, device=features.device)
        for i, (k, v) in enumerate(self.drafter.context_kv(features[None], pos)):
            self.k[i][:, :, self.length : self.length + n] = k
            self.v[i][:, :, self.length : self.length + n] = v
        self.length += n
        return (1,)

    def check_room(self, n: int) -> None:
        """Refuse ``n`` more entries past the capacity."""
        if self.length + n > self.capacity:
            raise RuntimeError(f"dflash context cache: {self.length} + {n} entries exceed its {self.capacity}")

    def view(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in zip(self.k, self.v)]


def load_dflash_for(path: str, target_config) -> DFlashDraft:
    """A DFlash drafter from ``path`` (a pardec ``drafter.type: dflash`` run's ``final`` dir, or a published z-lab or
    ``speculators`` checkpoint: :mod:`pardec.models.dflash_formats`)."""
    return load_dflash(path, target_config, key="method.path")[0]


def draft_vocab_of(path: str | None, key: str = "method.draft_vocab") -> DraftVocab | None:
    """``method.draft_vocab``: the vocabulary of the drafter at ``path`` (a directory; ``zoo:<name>`` is resolved
    before), read before any model loads; None: the DFlash drafter's own."""
    return None if path is None else read_vocab(path, key)


def decoding_drafter(drafter: DFlashDraft, target_model, device, int8_weights: str | None,
                     vocab: DraftVocab | None) -> DFlashDraft:
    """The drafter for decoding: placed as the target runs (:func:`~pardec.models.drafters.place`), then, given a
    ``vocab``, restricted to it through the target's head (:func:`~pardec.models.dflash.restrict_vocab`)."""
    placed = place(drafter, target_model, device, int8_weights)
    return placed if vocab is None else restrict_vocab(placed, vocab, target_model.get_output_embeddings())


def block_shape(c, target_config, block_size: int | None, num_speculative_tokens: int | None) -> tuple[int, int]:
    """(the drafted block's width, the drafts verified per round) of a drafter with config ``c`` on a target with
    ``target_config``, from the method's ``block_size`` / ``num_speculative_tokens`` (null: the trained block,
    ``block_size - 1``); a drafter made for another target, or values past the trained block, refused in one line."""
    if c.target_hidden_size != int(target_config.hidden_size) or c.vocab_size != int(target_config.vocab_size):
        raise ConfigError(f"the DFlash drafter reads features of width {c.target_hidden_size} and vocabulary "
                          f"{c.vocab_size}; the target has {target_config.hidden_size} and {target_config.vocab_size}")
    width = c.block_size if block_size is None else int(block_size)
    if width > c.block_size:
        raise ConfigError(f"method.block_size={block_size} is out of range: the drafter was trained on blocks "
                          f"of {c.block_size} (choose 2..{c.block_size})")
    n = width - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
    if n > width - 1:
        raise ConfigError(f"method.num_speculative_tokens={num_speculative_tokens} is out of range: a block of "
                          f"{width} proposes at most {width - 1}")
    return width, n


@register_method("dflash")
class DFlash(Decoder):
    """``path``: the drafter (a dir or a Hub id); ``block_size``: the drafted block's width (null: the drafter's
    trained block size, the paper's 16); ``num_speculative_tokens``: drafts verified per round (null:
    ``block_size - 1``, the reference's); ``int8_weights``: the drafter's int8 scheme when the target runs int8
    (``pardec.models.drafters.place``; null: fp32); ``draft_vocab``: a drafter whose draft vocabulary the drafts are
    restricted to (a directory or ``zoo:<name>``, e.g. ``zoo:eagle3``; null: the drafter's own, module docstring);
    ``compile``: each round's drafter work (the committed tokens' context entries, then the block) as one
    ``torch.compile`` graph (:mod:`pardec.models.dflash_compiled`; one drafter pass a round instead of two);
    ``tree``: ``chain`` (the paper's) or a static tree over the slots' ranks, a name in ``<path>/trees`` or a tree
    file (module docstring), cut to ``num_speculative_tokens`` slots."""

    exactness = "distribution"

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, path: str | None = None,
                 block_size: int | None = None, num_speculative_tokens: int | None = None,
                 int8_weights: str | None = "per_token", draft_vocab: str | None = None, compile: bool = False,
                 tree: str = "chain"):
        drafter = draft if isinstance(draft, DFlashDraft) else None
        check_int8_weights(int8_weights)
        vocab = draft_vocab_of(draft_vocab)
        super().__init__(target, tokenizer, None)
        if block_size is not None:
            check_range("block_size", block_size, 2, 1024)
        if num_speculative_tokens is not None:
            check_range("num_speculative_tokens", num_speculative_tokens, 1, 1023)
        if drafter is None and path is None:
            raise ConfigError("method 'dflash' needs a DFlash drafter: method.path=<dir or hub id> (train one with "
                              "python -m train +experiment=dflash_smollm2)")
        self.block_size, self.num_speculative_tokens, self.draft_vocab = block_size, num_speculative_tokens, draft_vocab
        self.compile = compile
        tree_dirs = [Path(path) / "trees"] if path is not None else []
        # checked before any model loads (every tree is valid at some depth: the drafter's block bounds it below)
        self.tree_name, _ = resolve_tree(tree, tree_dirs, 1023)
        if target is None:
            return
        if drafter is None:
            drafter = load_dflash_for(path, target.config)
        c = drafter.config
        self.width, self.n = block_shape(c, target.config, block_size, num_speculative_tokens)
        # a tree deeper than the drafter's block is refused; one deeper than the slots asked for is cut to them
        self.ranks = None if self.tree_name == "chain" else \
            RankTree(truncate_paths(resolve_tree(tree, tree_dirs, c.block_size - 1)[1], self.n))
        self.drafter = decoding_drafter(drafter, target.model, target.device, int8_weights, vocab)
        why = compiler_missing(next(self.drafter.parameters()).device) if compile else None
        if why is not None:
            raise ConfigError(f"method.compile=true: {why} (or method.compile=false)")
        self.layers = tuple(int(i) for i in c.layer_ids)
        self.embed = target.inner().embed_tokens
        self.head = target.model.get_output_embeddings()  # (a module: what a compiled round traces)
        self.clock = DraftClock()

    def _slots(self, cache: ContextCache, last: torch.Tensor, start: int, n: int,
               pending: torch.Tensor | None = None) -> torch.Tensor:
        """The block after ``last`` [1] at ``start``: slots 1 .. n's logits [n, V] (or [n, K]: a draft vocabulary);
        compiled, ``pending``'s context entries are appended first, in the same graph."""
        d = self.drafter
        x = d.block_inputs(self.embed, last, self.width)  # [1, W, H]
        if self.compile:
            return draft_round(d, self.head, cache, pending, x)[:n]
        pos = torch.arange(start, start + self.width, device=last.device)
        out = d(x, pos, cache.view())
        return d.logits(out[0, 1 : n + 1], self.target.lm_head)

    def _propose(self, cache: ContextCache, last: torch.Tensor, start: int, n: int, s: SamplingConfig,
                 gen: torch.Generator | None, pending: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """(the drafts [n] of :meth:`_slots`, their warped distributions [n, V] under sampling (None greedy),
        forwards)."""
        d = self.drafter
        logits = self._slots(cache, last, start, n, pending)
        if s.greedy:
            return d.to_target(logits.argmax(-1)), None, 1
        q = warp(d.full_logits(logits), s)
        return sample(q, gen)[:, 0], q, 1

    def _chain_round(self, st, cache: ContextCache, last: int, pending: torch.Tensor | None,
                     ) -> tuple[list[int], torch.Tensor, int]:
        """One round of the chain (the paper's): (the committed tokens, their features [len, K * H_t] (``last``'s and
        the accepted drafts'), the drafts verified)."""
        tgt, dev = self.target, st.ids.device
        n = min(self.n, st.out.room - 1)  # the target's token after the drafts always comes too
        base = tgt.length
        last_t = torch.full((1,), last, dtype=torch.long, device=dev)
        if n == 0:
            draft, q = torch.zeros(0, dtype=torch.long, device=dev), None
        else:
            draft, q, _ = self.clock.run(st, self._propose, cache, last_t, base, n, st.s, st.gen, pending)
        out = tgt.forward(torch.cat([last_t, draft])[None], hidden_layer=self.layers)
        st.target_forwards += 1
        tokens = verify_chain(draft, out.logits[0], st.s, st.gen, q)
        tgt.truncate(base + len(tokens))
        return tokens, out.hidden[0, : len(tokens)], n

    def _tree_round(self, st, cache: ContextCache, last: int, pending: torch.Tensor | None,
                    ) -> tuple[list[int], torch.Tensor, int]:
        """One round over the rank tree: (the committed tokens, the accepted path's features [len, K * H_t], the
        tree's drafted nodes)."""
        tgt, dev = self.target, st.ids.device
        depth = min(self.n, st.out.room - 1)
        base = tgt.length

        def propose():
            slots = self._slots(cache, torch.full((1,), last, dtype=torch.long, device=dev), base, depth, pending)
            return self.ranks.candidates(slots, depth, self.drafter.to_target), 1

        tree = self.clock.run(st, propose)[0] if depth > 0 else self.ranks.cut(0, dev)[0]
        out = tgt.forward(tree.tokens(last, dev)[None], tree.positions(base, dev), tree.on(dev).attend,
                          hidden_layer=self.layers)
        st.target_forwards += 1
        verdict = verify_tree(tree, out.logits[0], st.s, st.gen)
        tgt.keep(verdict.path)
        path = to_device(torch.tensor(verdict.path), dev)  # (not a blocking upload: pinned)
        return verdict.tokens, out.hidden[0].index_select(0, path), len(tree) - 1

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, stop: Stopper | None = None,
                 sampling: SamplingConfig | None = None) -> GenerationResult:
        st, last, features = begin_with_features(self, prompt_ids, max_new_tokens, stop, sampling)
        cache = ContextCache(self.drafter, st.ids.shape[1] + max_new_tokens + 1, st.ids.device, self.drafter.dtype,
                             self.width if self.compile else 0)
        self.clock.run(st, cache.append, features)
        one_round = self._chain_round if self.ranks is None else self._tree_round
        pending = None  # compiled: the committed tokens' features, appended by the next round's graph
        drafted = accepted = rounds = 0
        by_slot = [0] * self.n  # rounds that accepted a draft at slot k + 1 (a tree: a path that deep)
        while not st.out.done:
            tokens, features, nodes = one_round(st, cache, last, pending)
            pending = None
            drafted += nodes
            accepted += len(tokens) - 1
            rounds += 1
            for k in range(len(tokens) - 1):
                by_slot[k] += 1
            st.out.commit(tokens)
            last = tokens[-1]
            if st.out.done:
                break
            if self.compile:
                pending = features
            else:
                self.clock.run(st, cache.append, features)
        extras = {"block_size": self.width, "num_speculative_tokens": self.n, "rounds": rounds,
                  "accepted_by_slot": by_slot,
                  "draft_vocab_size": self.drafter.config.draft_vocab_size or self.drafter.config.vocab_size}
        if self.ranks is not None:
            extras.update(tree=self.tree_name, tree_nodes=len(self.ranks.cut(self.n, "cpu")[0]) - 1)
        return self._result(st, extras, draft_forwards=self.clock.forwards, draft_s=self.clock.seconds,
                            drafted=drafted, draft_accepted=accepted)
