"""``sdsat``: both greedy variants token-exact with forced (oracle) drafts and with wrong ones, the exact number of
tokens per forward each variant reaches, the nucleus candidate tree, the fused variant's sampling distribution,
and its one-line errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from pardec.config import ConfigError, ModelConfig, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.sdsat import SDSAT
from pardec.models.cached import CachedModel
from tests.conftest import tiny
from tests.decoding.test_distribution import PROMPT, exact_joint, tiny_vocab
from tests.stats import chi_square_p

ADAPTIVE = 511  # a tiny random model's last id stands in for a trained adaptive token


def _setup(seed=0):
    lm = tiny(seed)
    cm = CachedModel(lm.model)
    ids = lm.tokenizer("def fibonacci(n):\n    return")["input_ids"]
    return lm, cm, ids


def _oracle(dec: SDSAT, ref: list[int], wrong_at: int | None = None):
    """Drafts = the reference continuation after the committed tokens (one-hot logits); ``wrong_at``: depth
    (1-based) whose draft is made wrong."""

    def draft_logits(rows, committed):
        k, v = rows.shape
        out = torch.full((k, v), -10.0)
        for j in range(k):
            i = len(committed) + j
            tok = ref[i] if i < len(ref) else 0
            if wrong_at == j + 1:
                tok = (tok + 1) % (v - 1)
            out[j, tok] = 10.0
        return out

    dec._draft_logits = draft_logits
    return dec


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("variant", ["two_step", "fused"])
def test_oracle_drafts_reach_the_most_tokens_per_forward(variant, k):
    lm, cm, ids = _setup()
    n = 40
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, n).tokens
    assert ADAPTIVE not in ref
    dec = _oracle(build_decoder("sdsat", cm, lm.tokenizer, k=k, variant=variant, adaptive_ids=[ADAPTIVE]), ref)
    res = dec.generate(ids, n)
    assert res.tokens == ref and res.stop_reason == "length"
    # prefill commits 1 token and drafts k; two-step: verify (k+1), draft (1), verify (k+1) ...; fused: k+1 each
    want, done, verify = [1], 1, True
    while done < n:
        step = min(k + 1 if verify or variant == "fused" else 1, n - done)
        want.append(step)
        done += step
        verify = variant == "fused" or not verify
    assert res.accepted == want
    assert cm.length == len(ids) + n - 1  # no adaptive token stayed in the cache
    assert ADAPTIVE not in cm.tokens


@pytest.mark.parametrize("variant", ["two_step", "fused"])
def test_a_wrong_draft_is_caught(variant):
    lm, cm, ids = _setup(1)
    n, k = 30, 4
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, n).tokens
    dec = _oracle(build_decoder("sdsat", cm, lm.tokenizer, k=k, variant=variant, adaptive_ids=[ADAPTIVE]), ref,
                  wrong_at=3)
    res = dec.generate(ids, n)
    assert res.tokens == ref
    # every verification accepts drafts 1-2 and commits the target's token in place of draft 3
    # (a rejection leaves the fused variant no drafts either: verifying forwards alternate with drafting ones)
    assert set(res.accepted[1:-1:2]) == {3} and set(res.accepted[2:-1:2]) == {1}
    assert res.draft_accepted == 2 * res.extras["verifications"]


def test_nucleus_tree():
    lm, cm, _ = _setup()
    dec = build_decoder("sdsat", cm, lm.tokenizer, k=3, top_k=3, top_p=0.9, adaptive_ids=[ADAPTIVE])
    drafts = torch.full((3, 8), -30.0)
    drafts[0, [4, 2, 6]] = torch.tensor([2.0, 1.5, 1.0]).log()  # probs ~ .44 .33 .22: 3 in the nucleus
    drafts[1, 5] = 0.0  # one certain token
    drafts[2, [1, 7]] = torch.tensor([0.95, 0.05]).log()  # the 2nd is outside top_p 0.9
    tree, anchor = dec.candidates(drafts, SamplingConfig(temperature=1.0))
    assert tree.parents == [-1, 0, 0, 0, 1, 4] and tree.labels == [-1, 4, 2, 6, 5, 1]
    assert anchor == 5 and tree.label_path(anchor) == (4, 5, 1)
    greedy, a = dec.candidates(drafts, SamplingConfig())
    assert greedy.labels == [-1, 4, 5, 1] and a == 3  # greedy: the main chain only


@pytest.mark.slow  # a chi-square test over many decodes
def test_fused_sampling_follows_the_target_distribution():
    target = tiny_vocab(0)
    dec = build_decoder("sdsat", CachedModel(target), None, k=2, variant="fused", top_k=3, adaptive_ids=[15])
    s0 = SamplingConfig(temperature=1.0)
    obs: Counter = Counter()
    drafted = accepted = 0
    n = 1200
    for i in range(n):
        res = dec.generate(PROMPT, 3, Stopper(), SamplingConfig(temperature=1.0, seed=1000 + i))
        obs[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.drafted, accepted + res.draft_accepted
    p, dof = chi_square_p(obs, exact_joint(target, s0), n)
    assert dof >= 8 and p > 1e-3, (p, dof)
    assert drafted > 0 and 0 < accepted < drafted


def test_errors_are_one_line(tmp_path):
    lm, cm, _ = _setup()
    for params, part in [({"k": 0}, "method.k=0 is out of range"),
                         ({"variant": "tree"}, "method.variant='tree' must be one of 'two_step', 'fused'"),
                         ({"top_p": 0.0}, "method.top_p=0.0 is out of range"),
                         ({"adaptive_ids": []}, "method.adaptive_ids=[] is not valid"),
                         ({"k": 4, "adaptive_ids": [500, 501, 502]}, "method.k=4 is out of range"),
                         ({"adaptive_ids": [10**6]}, "outside the model's vocabulary")]:
        with pytest.raises(ConfigError, match="^[^\n]*$") as e:
            build_decoder("sdsat", cm, lm.tokenizer, **params)
        assert part in str(e.value)
    with pytest.raises(ConfigError, match="has no SDSAT adaptive token.*python -m train \\+experiment=sdsat_smollm2"):
        build_decoder("sdsat", cm, lm.tokenizer)
    # before the model loads: a local model whose config.json has no `sdsat` entry
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    local = ModelConfig(name="plain", source="local", path=str(tmp_path))
    with pytest.raises(ConfigError, match="model 'plain' .* has no SDSAT adaptive token"):
        SDSAT.check_model(local, {})
    SDSAT.check_model(local, {"adaptive_ids": [3]})  # given explicitly: fine
    (tmp_path / "config.json").write_text(json.dumps({"sdsat": {"schema_version": 1, "adaptive_ids": [7], "max_span": 5}}))
    SDSAT.check_model(local, {})
