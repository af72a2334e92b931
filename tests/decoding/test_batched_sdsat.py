"""Batched ``sdsat`` (:mod:`pardec.decoding.batch.sdsat`): with forced (oracle) drafts, right or wrong at one
depth, every row equals its batch-1 ``ar`` output and accepts, round for round, what batch-1 ``sdsat`` accepts with
the same drafts, in both variants; with the model's own drafts each row drafts what batch-1 drafts (its adaptive rows
read at its own offsets); sampled nucleus trees (the target's warp at top-k 1: deterministic) give every row its
``ar`` output and batch-1's rounds; bad input refused before any model loads."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import build_decoder
from pardec.decoding.batch import build_batched, run_batch
from pardec.decoding.batch.engine import check_batched
from pardec.decoding.batch.sdsat import BatchedSDSAT
from pardec.decoding.sdsat import SDSAT, without_adaptive
from pardec.models.cached import CachedModel
from pardec.models.ragged import RaggedModel
from tests.conftest import tiny
from tests.decoding.test_batched import N_NEW, _early_stop, _prompts, _reference
from tests.decoding.test_sdsat import ADAPTIVE, _oracle

K = 3


class _Forcing(BatchedSDSAT):
    """Batched sdsat whose kept drafts (or candidate lists) each row's ``force`` replaces after its admission and after
    every round."""

    def force(self, r) -> None:
        raise NotImplementedError

    def admit(self, row):
        super().admit(row)
        self.force(row)

    def round(self, rows):
        super().round(rows)
        for r in rows:
            self.force(r)


def _continuation(ref: list[int], i: int, k: int) -> list[int]:
    return [ref[i + j] if i + j < len(ref) else 0 for j in range(k)]


def _forced(refs: list[list[int]], wrong_at: int | None, log: dict, vocab: int):
    """Batched sdsat whose kept drafts are replaced by each row's reference continuation (as
    tests/decoding/test_sdsat.py's oracle drafts after the committed tokens); ``log[row]`` gets the drafts the model
    made, with the output length they follow."""

    class Forced(_Forcing):
        def force(self, r):
            if r.state["drafts"] is None:
                return
            i = len(r.out.tokens)
            log.setdefault(r.index, []).append((i, r.state["drafts"]))
            got = _continuation(refs[r.index], i, self.k)
            if wrong_at is not None:
                got[wrong_at - 1] = (got[wrong_at - 1] + 1) % (vocab - 1)  # (the batch-1 oracle's wrong token)
            r.state["drafts"] = got

    return Forced


def _forced_trees(refs: list[list[int]], vocab: int, width: int = 3):
    """Batched sdsat of sampled caterpillar trees whose kept candidate lists are forced: at each depth the row's
    reference token (the main chain) and the ``width - 1`` ids after it (leaves), all inside the nucleus."""

    class ForcedTrees(_Forcing):
        def force(self, r):
            if r.state.get("lists") is None:
                return
            main = _continuation(refs[r.index], len(r.out.tokens), self.k)
            r.state["lists"] = [[[(t + w) % vocab for w in range(width)] for t in main], [[1] * width] * self.k,
                                [[t] * width for t in main]]

    return ForcedTrees


@pytest.mark.parametrize("wrong_at", [None, 2])
@pytest.mark.parametrize("variant", ["two_step", "fused"])
def test_forced_drafts_rows_equal_ar_and_accept_as_batch_one(variant, wrong_at):
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    ref = _reference(lm, prompts, stop)
    long_ref = _reference(lm, prompts, None)  # the oracle's continuation past an early stop
    params = {"k": K, "variant": variant, "tree": "caterpillar", "adaptive_ids": [ADAPTIVE]}
    made: dict[int, list] = {}
    forced = _forced(long_ref, wrong_at, made, int(lm.model.config.vocab_size))
    dec = forced(RaggedModel(lm.model, 3, 64), lm.tokenizer, None, **params)
    run = run_batch(dec, prompts, N_NEW, stop)
    assert [r.tokens for r in run.results] == ref
    alone, made_alone = [], {}
    for i, (p, lr) in enumerate(zip(prompts, long_ref)):
        single = _oracle(build_decoder("sdsat", CachedModel(lm.model), lm.tokenizer, **params), lr, wrong_at)
        forced, index = single.draft_logits, torch.tensor([ADAPTIVE])

        def recording(rows, before, token, i=i, forced=forced, index=index):
            made_alone.setdefault(i, []).append((len(before) + 1, without_adaptive(rows, index).argmax(-1).tolist()))
            return forced(rows, before, token)

        single.draft_logits = recording
        alone.append(single.generate(p, N_NEW, stop))
    if wrong_at is None:  # every chain accepted whole: every drafting forward's drafts kept, and made as batch-1's
        # (fused: each row's adaptive rows after its own chain), until the row's output ends
        def upto_end(log):
            return {i: [e for e in v if e[0] < len(ref[i])] for i, v in log.items()}

        assert upto_end(made) == upto_end(made_alone)
        assert sum(map(len, made.values())) >= 3 * len(prompts)
    assert [r.accepted for r in run.results] == [a.accepted for a in alone]
    assert [(r.drafted, r.draft_accepted) for r in run.results] == [(a.drafted, a.draft_accepted) for a in alone]
    most = max(a for r in run.results for a in r.accepted)
    assert most == (K + 1 if wrong_at is None else wrong_at)  # whole chains accepted, or up to the wrong depth


@pytest.mark.parametrize("variant", ["two_step", "fused"])
def test_each_row_drafts_what_batch_one_drafts(variant):
    """The model's own drafts (an untrained model's adaptive rows): the chains each row verifies are batch-1's."""
    lm = tiny(0)
    prompts = _prompts(lm)
    params = {"k": K, "variant": variant, "tree": "caterpillar", "adaptive_ids": [ADAPTIVE]}
    seen: dict[int, list] = {i: [] for i in range(len(prompts))}

    class Recording(BatchedSDSAT):
        def round(self, rows):
            for r in rows:
                if r.state["drafts"] is not None and r.out.room > 1:
                    seen[r.index].append(r.state["drafts"][: min(self.k, r.out.room - 1)])
            super().round(rows)

    run_batch(Recording(RaggedModel(lm.model, 3, 64), lm.tokenizer, None, **params), prompts, N_NEW)
    for i, p in enumerate(prompts):
        single = build_decoder("sdsat", CachedModel(lm.model), lm.tokenizer, **params)
        chains = []
        tree = single.tree_from_lists
        single.tree_from_lists = lambda got, s, tree=tree, chains=chains: (chains.append([row[0] for row in got[0]]),
                                                                  tree(got, s))[1]
        single.generate(p, N_NEW)
        assert seen[i] == chains and len(chains) >= 3, i


@pytest.mark.parametrize(("tree", "k", "top_k"), [("official", 5, 10), ("caterpillar", K, 3)])
def test_sampled_nucleus_trees_rows_equal_batch_one(tree, k, top_k):
    """Sampled decoding with batch-1's nucleus trees (the reference code's for k = 5, the caterpillar with three
    tokens a depth), each row's tree and adaptive chain padded into one forward: under the target's warp at top-k 1
    (every sample its argmax, so a row's output is deterministic) each row equals its batch-1 ``ar`` output and
    drafts, accepts and commits round for round what batch-1 ``sdsat`` does under the same sampling."""
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    ref = _reference(lm, prompts, stop)
    s = SamplingConfig(temperature=1.0, top_k=1, seed=3)
    params = {"k": k, "variant": "fused", "tree": tree, "top_k": top_k, "adaptive_ids": [ADAPTIVE]}
    sizes = []

    class Sizes(BatchedSDSAT):  # the trees the rows verify
        def _round_trees(self, rows):
            single = self.single.tree_from_lists
            self.single.tree_from_lists = lambda got, s: (lambda t: (sizes.append(len(t[0])), t)[1])(single(got, s))
            super()._round_trees(rows)
            self.single.tree_from_lists = single

    run = run_batch(Sizes(RaggedModel(lm.model, 3, 64), lm.tokenizer, None, **params), prompts, N_NEW, stop,
                    sampling=s)
    assert [r.tokens for r in run.results] == ref
    single = build_decoder("sdsat", CachedModel(lm.model), lm.tokenizer, **params)
    alone = [single.generate(p, N_NEW, stop, s) for p in prompts]
    assert [r.accepted for r in run.results] == [a.accepted for a in alone]
    assert [(r.drafted, r.draft_accepted) for r in run.results] == [(a.drafted, a.draft_accepted) for a in alone]
    assert max(sizes) > k + 1  # trees, not chains (k + 1 nodes)


def test_bad_input_is_refused_before_any_model_loads():
    s = SamplingConfig(temperature=1.0, seed=0)
    for params in ({}, {"tree": "caterpillar", "top_k": 1}):  # nucleus trees, the argmax chain
        check_batched("sdsat", 2, params, s)
    with pytest.raises(ConfigError, match="method.variant"):
        build_batched("sdsat", tiny(0).model, 2, 64, variant="three_step", adaptive_ids=[ADAPTIVE])
    with pytest.raises(ConfigError, match="has no SDSAT adaptive token"):
        build_batched("sdsat", tiny(0).model, 2, 64)
    with pytest.raises(ConfigError, match="method.tree=official has no tree for method.k=3"):
        build_batched("sdsat", tiny(0).model, 2, 64, k=3, adaptive_ids=[ADAPTIVE])
    assert SDSAT.exactness == BatchedSDSAT.exactness == "distribution"
