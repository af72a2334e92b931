"""Sampled rows of a batch follow the target's distribution (:mod:`pardec.decoding.batch`): the joint of three
consecutive tokens, each row a sample, with neighbours of other lengths in the same batch, chi-square against the
exact joint of ``tests/decoding/test_distribution_deep.py`` (its prompt, model, draft and power: N = 2000 at
temperature 1, 2400 warped; drafts 3 deep so tokens 2-4 are one round's drafts and token 5 its bonus or the next
round's)."""

from __future__ import annotations

from collections import Counter

import pytest

from pardec.config import SamplingConfig
from pardec.decoding import build_decoder
from pardec.decoding.batch import build_batched, run_batch
from pardec.models.cached import CachedModel
from pardec.models.ragged import RaggedModel
from tests.decoding.drafters import drafter_params
from tests.decoding.test_batched_sdsat import _forced, _forced_trees
from tests.decoding.test_distribution import SETTINGS, V, tiny_vocab
from tests.decoding.test_distribution_deep import (
    GROUPS,
    PROMPT,
    T,
    as_cells,
    dflash_deep,
    eagle_deep,
    exact_joints,
    near_draft,
    vocab_deep,
)
from tests.stats import chi_square_p

N = {"t1": 2000, "warped": 2400}
#: drafts 3 deep; eagle3 and dflash with the deep test's fitted drafters (eagle_deep, dflash_deep); eagle3's tree
#: as the deep test's (each row's own shape, verified by the batch's tree rule under per-row buffers)
PARAMS = {"ar": {}, "pld": {"max_ngram": 3, "num_pred": 4}, "sps": {"gamma": 3}, "jacobi": {"block_size": 4},
          "eagle3": {"mode": "chain", "num_speculative_tokens": 3},
          "eagle3_tree": {"mode": "tree", "total_tokens": 12, "depth": 3, "top_k": 3},
          "dflash": {"num_speculative_tokens": 3}, "medusa": {}, "firp": {},
          # the same drafter over a draft vocabulary without the cycle's token 9 (q = 0 there)
          "dflash_vocab": {"num_speculative_tokens": 3},
          # the trie of its pool per row (each row's own shape), verified row by row
          "lookahead": {"level": 4, "window": 3, "guess_set": 3, "pool_from_prompt": True, "pool_from_output": True},
          # the target's own chain of drafts from adaptive tokens after each row's drafts (id 15 stands in for one)
          "sdsat": {"k": 3, "variant": "fused", "tree": "caterpillar", "top_k": 1, "adaptive_ids": [15]},
          # its nucleus trees: the caterpillar of three tokens a depth, each row's tree and adaptive chain in one
          # forward (its lists forced: the main chain the target's greedy continuation, two leaves a depth)
          "sdsat_tree": {"k": 3, "variant": "fused", "tree": "caterpillar", "top_k": 3, "adaptive_ids": [15]},
          # k i.i.d. sequences per row in k draft rows of its own, K-SEQ on each row's trie
          "spectr": {"k": 3, "gamma": 3},
          # the draft's own lookahead per row, then its chain and the pool's phrases as a tree per row (q on the chain)
          "ouroboros": {"gamma": 3, "window": 3, "guess_set": 3, "level": 3, "top_k_phrases": 2}}
OTHERS = [[1, 2], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4], [7, 3, 7]]  # neighbours of other lengths


@pytest.mark.stat  # N = 2000-2400 rows per case and setting
@pytest.mark.parametrize("setting", ["t1", "warped"])
@pytest.mark.parametrize("case", list(PARAMS))
def test_each_rows_triples_follow_the_target_distribution(case, setting, one_thread):
    method = case.removesuffix("_tree").removesuffix("_vocab")
    n, s0 = N[setting], SETTINGS[setting]
    draft = near_draft() if method in ("sps", "spectr", "ouroboros") else None
    fitted = {"eagle3": eagle_deep, "dflash": dflash_deep}
    params = {**PARAMS[case], **({"path": fitted[method]()} if method in fitted else {}),
              **(drafter_params(method, tiny_vocab(0)) if method in ("medusa", "firp") else {}),  # (untrained)
              **({"draft_vocab": vocab_deep()} if case == "dflash_vocab" else {})}
    prompts = [PROMPT if i % 2 == 0 else OTHERS[(i // 2) % len(OTHERS)] for i in range(2 * n)]
    if method == "sdsat":  # an untrained model's adaptive rows draft nothing right: each row's kept drafts are
        # forced to the target's greedy continuation of its prompt (a function of its position, so still exact)
        greedy = {tuple(p): build_decoder("ar", CachedModel(tiny_vocab(0))).generate(p, T + 4).tokens
                  for p in [PROMPT, *OTHERS]}
        refs = [greedy[tuple(p)] for p in prompts]
        forced = _forced_trees(refs, V) if case == "sdsat_tree" else _forced(refs, None, {}, V)
        dec = forced(RaggedModel(tiny_vocab(0), 8, 32), None, None, **params)
    else:
        dec = build_batched(method, tiny_vocab(0), 8, 32, None, draft, **params)
    s = SamplingConfig(temperature=s0.temperature, top_k=s0.top_k, top_p=s0.top_p, seed=17)
    run = run_batch(dec, prompts, T, sampling=s)
    obs = {g: Counter() for g in GROUPS}
    deep = 0
    for res in run.results[::2]:
        assert len(res.tokens) == T
        deep += any(a >= 3 for a in res.accepted[1:])  # >= 2 drafted tokens accepted in one forward
        for g in GROUPS:
            obs[g][tuple(res.tokens[j - 1] for j in g)] += 1
    if method not in ("ar", "jacobi", "medusa", "firp"):  # (untrained heads / projections: rarely right twice in a row)
        assert deep >= n // 30, deep
    exact = exact_joints(setting, T, GROUPS)
    for g in GROUPS:
        p, dof = chi_square_p(obs[g], as_cells(exact[g], len(g)), n)
        assert dof >= 35 and p > 1e-3, (method, setting, g, p, dof)
