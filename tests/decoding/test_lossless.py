"""Every method whose exactness is `tokens` or `distribution` reproduces greedy `ar` token for token in fp32 on
tiny random models; draft methods are run with drafts that accept everything, some, and almost nothing."""

from __future__ import annotations

import pytest
import torch

from pardec.config import SamplingConfig
from pardec.decoding import METHODS, Stopper, build_decoder
from pardec.decoding.base import lossless_under_greedy
from pardec.decoding.jacobi import Jacobi
from pardec.decoding.pld import PromptLookup, lookup
from pardec.models.cached import CachedModel
from tests.conftest import draft_for, tiny
from tests.decoding.drafters import drafter_params

LOSSLESS = [m for m in METHODS.names() if lossless_under_greedy(METHODS.get(m))]
DRAFTS = ("self", "noisy", "random")
PROMPTS = {
    "short": [1, 504, 1812],
    "code": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "long": "The quick brown fox jumps over the lazy dog. " * 12,
}
PARAMS = {"jacobi": [{"block_size": 16}, {"block_size": 5}, {"block_size": 1}, {"block_size": 7, "max_iters": 2}],
          "pld": [{}, {"max_ngram": 1, "num_pred": 3}, {"max_ngram": 4, "min_ngram": 2, "num_pred": 20}],
          "sps": [{"gamma": 4}, {"gamma": 1}, {"gamma": 9}, {"gamma": 3, "adaptive": True, "gamma_max": 8},
                  {"gamma": 6, "confidence_threshold": 0.5}],
          "lookahead": [{}, {"level": 2, "window": 1, "guess_set": 1}, {"level": 4, "window": 3, "guess_set": 2,
                                                                          "pool_from_prompt": True}],
          # the paper's switches (all on, tests/test_paper_defaults.py) at a CPU-sized window: its W 20 / N 7 window
          # makes every draft forward ~140 tokens, minutes per prompt on two cores
          "ouroboros": [{"gamma": 4, "window": 4, "level": 4, "guess_set": 4}, {"gamma": 1, "level": 2, "window": 1, "guess_set": 1, "top_k_phrases": 1},
                        {"accelerated_drafting": False, "lengthening": False, "verified_phrases": False},
                        {"gamma": 6, "level": 3, "window": 4, "guess_set": 3, "warm_start": True}],
          "spectr": [{}, {"k": 1, "gamma": 1}, {"k": 2, "gamma": 6}],
          "medusa": [{}, {"tree": "chain"}, {"tree": "chain", "k": 1}],
          "firp": [{}, {"tree": "chain"}, {"k": 2}],
          "eagle3": [{}, {"mode": "chain"}],
          "dflash": [{}, {"block_size": 3}, {"num_speculative_tokens": 1}],
          "sdsat": [{}, {"variant": "fused"}, {"k": 1, "tree": "caterpillar"},
                    {"k": 8, "variant": "fused", "tree": "caterpillar"}, {"k": 7, "tree": "official"}]}


def _ids(tok, prompt):
    return prompt if isinstance(prompt, list) else tok(prompt)["input_ids"]


def _ar(cm, tok, ids, n, stop):
    return build_decoder("ar", cm, tok).generate(ids, n, stop)


def _build(method, cm, tok, seed=0, draft="self", **params):
    """A decoder; methods that need a draft get ``draft_for(draft, seed)``."""
    d = draft_for(draft, seed) if METHODS.get(method).needs_draft else None
    return build_decoder(method, cm, tok, d, **{**drafter_params(method, cm.model), **params})


def test_every_lossless_method_is_covered():
    assert {"ar", "hf_generate", "jacobi", "pld", "sps", "lookahead", "ouroboros", "spectr", "medusa",
            "firp", "sdsat"} <= set(LOSSLESS)


#: the forward every model of a seed's sweep runs (target, reference ``ar`` and drafts): seed 0 on transformers' (the
#: forward split models run), seeds 1 and 2 on the lean one (what ``forward_impl=auto`` runs on a CPU), so each
#: forward gets the whole sweep of methods, parameters, drafts and prompts
SEED_FORWARD = {0: "hf", 1: "lean", 2: "lean"}


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("prompt", [p if p == "short" else pytest.param(p, marks=pytest.mark.slow) for p in PROMPTS])
@pytest.mark.parametrize("method", [m for m in LOSSLESS if m != "ar"])
def test_lossless_equals_ar(method, prompt, seed, monkeypatch):
    monkeypatch.setattr(CachedModel, "default_forward_impl", SEED_FORWARD[seed])
    lm = tiny(seed)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS[prompt])
    stop = Stopper(lm.tokenizer)
    max_new = 37  # not a multiple of any block size below
    ref = _ar(cm, lm.tokenizer, ids, max_new, stop)
    assert len(ref.tokens) == max_new and ref.target_forwards == max_new
    drafts = DRAFTS if METHODS.get(method).needs_draft else ("self",)
    for params in PARAMS.get(method, [{}]):
        for draft in drafts:
            res = _build(method, cm, lm.tokenizer, seed, draft, **params).generate(ids, max_new, stop)
            assert res.tokens == ref.tokens, (method, params, draft)
            assert res.stop_reason == "length"
            assert sum(res.accepted) == len(res.tokens)
            if method in ("sps", "ouroboros", "spectr") and draft == "self":  # the target's own weights as the draft
                assert res.draft_accepted >= 0.9 * res.drafted > 0, (method, params)
                assert res.target_forwards < ref.target_forwards


class OracleJacobi(Jacobi):
    """Initial guesses = the true continuation with every `corrupt`-th token replaced: exercises multi-token
    fast-forwarding, partial acceptance and stationary tokens deterministically."""

    def __init__(self, *a, truth: list[int], corrupt: int = 3, **kw):
        super().__init__(*a, **kw)
        self.truth, self.corrupt = truth, corrupt

    def initial_guess(self, prompt, output, n, gen):
        start = len(output)
        guess = (self.truth[start : start + n] + [5] * n)[:n]
        return [g if (i + 1) % self.corrupt else 7 for i, g in enumerate(guess)]


@pytest.mark.parametrize("block_size", [4, 9, 16])
@pytest.mark.parametrize("corrupt", [2, 3, 100])
def test_jacobi_fast_forward_paths_stay_exact(block_size, corrupt):
    lm = tiny(1)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    ref = _ar(cm, lm.tokenizer, ids, 45, Stopper(lm.tokenizer))
    dec = OracleJacobi(cm, lm.tokenizer, block_size=block_size, truth=ref.tokens, corrupt=corrupt)
    res = dec.generate(ids, 45, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens
    assert res.target_forwards < ref.target_forwards  # good guesses must fast-forward
    assert res.extras["fast_forward"] > 1.0
    for traj in res.extras["trajectories"]:
        if traj["complete"]:
            assert traj["states"][-1] == traj["fixed_point"]
    fixed = [t for traj in res.extras["trajectories"] for t in traj["fixed_point"]]
    assert fixed == ref.tokens[1:]  # the first token comes from the prefill


class OraclePLD(PromptLookup):
    """Drafts = the true continuation with every `corrupt`-th token wrong: partial acceptance paths."""

    def __init__(self, *a, truth: list[int], prompt_len: int, corrupt: int, **kw):
        super().__init__(*a, **kw)
        self.truth, self.prompt_len, self.corrupt = truth, prompt_len, corrupt

    def propose(self, seq):
        start = seq.numel() - self.prompt_len
        d = self.truth[start : start + self.num_pred]
        return torch.tensor([t if (i + 1) % self.corrupt else 7 for i, t in enumerate(d)], dtype=torch.long)


@pytest.mark.parametrize("corrupt", [2, 4, 100])
def test_pld_draft_acceptance_paths_stay_exact(corrupt):
    lm = tiny(0)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    ref = _ar(cm, lm.tokenizer, ids, 33, Stopper(lm.tokenizer))
    dec = OraclePLD(cm, lm.tokenizer, num_pred=6, truth=ref.tokens, prompt_len=len(ids), corrupt=corrupt)
    res = dec.generate(ids, 33, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens
    assert res.extras["accepted_draft_tokens"] > 0
    assert res.target_forwards < ref.target_forwards


def test_lookup_finds_most_recent_longest_match():
    seq = torch.tensor([1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3])
    assert lookup(seq, 3, 1, 3).tolist() == [4, 5, 7]  # 2-gram [2, 3]: most recent earlier match at 5
    assert lookup(torch.tensor([1, 2, 3]), 2, 1, 5).tolist() == []


@pytest.mark.parametrize("method,params", [("jacobi", {"block_size": 8}), ("jacobi", {"block_size": 3}),
                                           ("pld", {}), ("hf_generate", {}), ("sps", {"gamma": 6}),
                                           ("sps", {"gamma": 2, "adaptive": True})])
@pytest.mark.parametrize("stop_at", [0, 4, 10])
def test_eos_inside_a_block(method, params, stop_at):
    lm = tiny(1)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    free = _ar(cm, lm.tokenizer, ids, 40, Stopper(lm.tokenizer)).tokens
    eos = free[stop_at]
    stop = Stopper(lm.tokenizer, eos_ids=[eos])
    ref = _ar(cm, lm.tokenizer, ids, 40, stop)
    assert ref.tokens == free[: free.index(eos) + 1] and ref.stop_reason == "eos"
    res = _build(method, cm, lm.tokenizer, 1, "self", **params).generate(ids, 40, stop)
    assert res.tokens == ref.tokens and res.stop_reason == "eos"


def test_oracle_jacobi_eos_inside_a_fast_forwarded_block():
    lm = tiny(1)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    free = _ar(cm, lm.tokenizer, ids, 40, Stopper(lm.tokenizer)).tokens
    stop = Stopper(lm.tokenizer, eos_ids=[free[11]])
    ref = _ar(cm, lm.tokenizer, ids, 40, stop)
    res = OracleJacobi(cm, lm.tokenizer, block_size=16, truth=free, corrupt=100).generate(ids, 40, stop)
    assert res.tokens == ref.tokens and res.stop_reason == "eos"


@pytest.mark.parametrize("method", ["jacobi", "pld", "hf_generate", "sps"])
def test_stop_strings_cut_every_method_at_the_same_token(method):
    lm = tiny(0)
    cm = CachedModel(lm.model)
    tok = lm.tokenizer
    ids = _ids(tok, PROMPTS["long"])
    free = _ar(cm, tok, ids, 30, Stopper(tok)).tokens
    piece = tok.decode(free[8:10])
    stop = Stopper(tok, stop_strings=[piece])
    ref = _ar(cm, tok, ids, 30, stop)
    assert ref.stop_reason == "stop_string" and len(ref.tokens) <= 10
    res = _build(method, cm, tok).generate(ids, 30, stop)
    assert res.tokens == ref.tokens and res.stop_reason == "stop_string"
    assert piece not in stop.final_text(res.tokens)


@pytest.mark.parametrize("max_new", [1, 2, 17])
def test_max_new_tokens_respected(max_new):
    lm = tiny(2)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    ref = _ar(cm, lm.tokenizer, ids, max_new, Stopper(lm.tokenizer))
    for method in LOSSLESS:
        res = _build(method, cm, lm.tokenizer, 2).generate(ids, max_new, Stopper(lm.tokenizer))
        assert res.tokens == ref.tokens and len(res.tokens) == max_new


def test_ar_equals_hf_generate_greedy_on_real_eos():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    tok = lm.tokenizer
    ids = _ids(tok, PROMPTS["code"])
    stop = Stopper(tok, eos_ids=[tok.eos_token_id])
    a = _ar(cm, tok, ids, 25, stop)
    h = build_decoder("hf_generate", cm, tok).generate(ids, 25, stop)
    assert a.tokens == h.tokens


def test_sampling_is_seeded_and_methods_stay_in_distribution_support():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    s = SamplingConfig(temperature=0.8, top_k=20, top_p=0.9, seed=3)
    for method in ("ar", "jacobi", "pld", "sps"):
        dec = _build(method, cm, lm.tokenizer, 0, "noisy")
        a = dec.generate(ids, 20, Stopper(lm.tokenizer), s).tokens
        b = dec.generate(ids, 20, Stopper(lm.tokenizer), s).tokens
        assert a == b, method  # same seed, same tokens
        c = dec.generate(ids, 20, Stopper(lm.tokenizer), SamplingConfig(temperature=0.8, seed=4)).tokens
        assert len(c) == 20
    # top_k=1 sampling is greedy
    greedy = _ar(cm, lm.tokenizer, ids, 15, Stopper(lm.tokenizer)).tokens
    topk1 = build_decoder("jacobi", cm, lm.tokenizer).generate(
        ids, 15, Stopper(lm.tokenizer), SamplingConfig(temperature=1.0, top_k=1)).tokens
    assert topk1 == greedy


def test_greedy_forward_count_and_tokens_per_forward():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    res = _ar(cm, lm.tokenizer, [1, 2, 3], 10, Stopper(lm.tokenizer))
    assert res.target_forwards == 10 and res.tokens_per_forward == 1.0 and res.accepted == [1] * 10
    assert res.total_s >= res.prefill_s > 0
    assert torch.is_tensor(torch.tensor(res.tokens))


@pytest.mark.parametrize("block_size", [3, 8])
def test_jacobi_fast_forward_with_perfect_guesses_is_the_block_size(block_size):
    """Initial guesses = the true continuation: every block converges in one iteration committing all n tokens."""
    lm = tiny(1)
    cm = CachedModel(lm.model)
    ids = _ids(lm.tokenizer, PROMPTS["code"])
    n_new = 1 + 4 * block_size  # the prefill's token, then 4 whole blocks
    ref = _ar(cm, lm.tokenizer, ids, n_new, Stopper(lm.tokenizer))
    res = OracleJacobi(cm, lm.tokenizer, block_size=block_size, truth=ref.tokens, corrupt=10**6).generate(
        ids, n_new, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens
    assert res.extras["fast_forward"] == block_size and res.extras["jacobi_iterations"] == 4
    assert res.extras["stationary_tokens"] == 0 and res.extras["stationary_per_block"] == 0
    assert res.target_forwards == 5
