"""Every decoder whose exactness is `distribution` samples exactly from the target's (warped) distribution:
a chi-square test of the joint distribution of the first three new tokens, on a tiny-vocabulary model (16
tokens, peaked logits) where that distribution can be enumerated, with and without top-k / top-p."""

from __future__ import annotations

import functools
from collections import Counter

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pardec.config import SamplingConfig
from pardec.decoding import METHODS, Stopper, build_decoder
from pardec.decoding.sampling import warp
from pardec.decoding.tree import Tree
from pardec.models.cached import CachedModel
from tests.decoding.drafters import drafter_params
from tests.stats import chi_square_p

V = 16
PROMPT = [3, 9, 3, 9, 3]  # repetitive, so prompt lookup proposes drafts
SETTINGS = {"t1": SamplingConfig(temperature=1.0), "warped": SamplingConfig(temperature=2.0, top_k=5, top_p=0.9)}
DISTRIBUTION = [m for m in METHODS.names() if METHODS.get(m).exactness == "distribution"]
N = 1200
PARAMS = {"sps": {"gamma": 2}, "jacobi": {"block_size": 3}, "lookahead": {"level": 3, "window": 3, "guess_set": 2},
          "ouroboros": {"gamma": 2, "level": 3, "window": 2, "guess_set": 2}, "spectr": {"k": 2, "gamma": 2},
          "sdsat": {"top_k": 4}}  # k 5: the official tree (tests/decoding/test_sdsat.py: both shapes, 5 deep)


@functools.cache
def tiny_vocab(seed: int) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=False)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg).eval()
        with torch.no_grad():
            model.lm_head.weight.mul_(30.0)  # peaked, context-dependent distributions
    return model


def exact_joint(model, s: SamplingConfig) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3 | PROMPT) under ``s``, by enumeration."""
    with torch.no_grad():
        p1 = warp(model(input_ids=torch.tensor([PROMPT])).logits[0, -1], s)  # [V]
        seq2 = torch.tensor([PROMPT + [a] for a in range(V)])
        p2 = warp(model(input_ids=seq2).logits[:, -1], s)  # [V, V]
        seq3 = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = warp(model(input_ids=seq3).logits[:, -1], s).reshape(V, V, V)
    joint = p1[:, None, None] * p2[:, :, None] * p3
    return {(a, b, c): float(joint[a, b, c]) for a in range(V) for b in range(V) for c in range(V)
            if joint[a, b, c] > 0}


def test_every_distribution_method_is_covered():
    assert {"ar", "jacobi", "pld", "sps", "spectr", "medusa", "firp", "sdsat"} <= set(DISTRIBUTION)


@pytest.mark.stat  # N = 1200 samples per case: fewer lose the power to see a 10% contamination (tests/stats.py)
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", DISTRIBUTION)
def test_sampled_output_follows_the_target_distribution(method, setting):
    s0 = SETTINGS[setting]
    target = tiny_vocab(0)
    # (lean forwards: the logits of transformers' up to rounding, at ~60% of the time per sample)
    draft = CachedModel(tiny_vocab(1), name="draft", forward_impl="lean") if METHODS.get(method).needs_draft else None
    params = {**drafter_params(method, target), **PARAMS.get(method, {})}
    dec = build_decoder(method, CachedModel(target, forward_impl="lean"), None, draft, **params)
    if method == "lookahead":  # fixed candidates that the target often, not always, continues with
        fixed = {15: [(14, 0), (15,), (12, 4)], 14: [(0,), (13, 0)], 12: [(4,)]}
        dec.candidates = lambda pool, last, room: Tree.from_paths([c[:room] for c in fixed.get(last, []) if room])
    obs: Counter = Counter()
    drafted = accepted = hits = 0
    for i in range(N):
        s = SamplingConfig(temperature=s0.temperature, top_k=s0.top_k, top_p=s0.top_p, seed=1000 + i)
        res = dec.generate(PROMPT, 3, Stopper(), s)
        obs[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.drafted, accepted + res.draft_accepted
        hits += bool(res.extras.get("pool_hit_rate"))
    p, dof = chi_square_p(obs, exact_joint(target, s0), N)
    assert dof >= 8, dof
    assert p > 1e-3, (method, setting, p)
    if method in ("sps", "pld", "ouroboros", "spectr", "medusa", "firp", "sdsat"):  # drafts exercised, partly accepted
        assert drafted > 0 and 0 < accepted < drafted, (drafted, accepted)
    if method == "lookahead":  # pool candidates were accepted in some runs, not all
        assert 0 < hits < N, hits
