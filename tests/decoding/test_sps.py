"""`sps` specifics: adaptive gamma, draft-forward accounting, draft-cache resynchronisation, bad parameters."""

from __future__ import annotations

import pytest

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from tests.conftest import draft_for, tiny

PROMPT = [1, 504, 1812, 77, 900]


def _sps(draft: str, **params):
    lm = tiny(0)
    return build_decoder("sps", CachedModel(lm.model), lm.tokenizer, draft_for(draft, 0), **params), lm


def test_adaptive_gamma_grows_on_full_acceptance_and_shrinks_on_rejection():
    dec, lm = _sps("self", gamma=2, adaptive=True, gamma_max=6)
    res = dec.generate(PROMPT, 40, Stopper(lm.tokenizer))
    assert res.extras["mean_gamma"] > 3  # every draft accepted: 2, 3, 4, 5, 6, 6, ...
    dec, lm = _sps("random", gamma=5, adaptive=True, gamma_min=1)
    res = dec.generate(PROMPT, 40, Stopper(lm.tokenizer))
    assert res.extras["mean_gamma"] < 2.5  # a random draft is rejected: 5, 4, 3, 2, 1, 1, ...


def test_draft_forwards_and_acceptance_are_counted():
    dec, lm = _sps("self", gamma=4)
    res = dec.generate(PROMPT, 21, Stopper(lm.tokenizer))
    # 20 tokens after the prefill's first one, 5 per round (4 drafted + 1 from the target): 4 rounds
    assert res.target_forwards == 1 + 4 and res.accepted == [1, 5, 5, 5, 5]
    assert res.drafted == res.draft_accepted == 16
    assert res.draft_forwards == 4 * 4  # per round: one catch-up forward + 3 single-token steps
    assert 0 < res.draft_s < res.total_s
    assert res.extras["draft_acceptance"] == 1.0


def test_draft_cache_resynchronises_with_the_committed_sequence():
    dec, lm = _sps("noisy", gamma=6)
    res = dec.generate(PROMPT, 30, Stopper(lm.tokenizer))  # greedy: the noisy draft's argmax is often wrong
    committed = PROMPT + res.tokens
    held = dec.draft.tokens
    # the draft cache holds a prefix of the committed sequence plus at most gamma - 1 drafted tokens of the
    # last round (rejected ones are cut at the next round's sync)
    common = next((i for i, (a, b) in enumerate(zip(held, committed)) if a != b), min(len(held), len(committed)))
    assert common >= len(PROMPT) and len(held) - common <= 5
    assert 0 < res.draft_accepted < res.drafted


@pytest.mark.parametrize("params,needle", [
    ({"gamma": 0}, "method.gamma=0 is out of range"),
    ({"gamma_max": 0}, "method.gamma_max=0 is out of range"),
    ({"gamma": 20, "adaptive": True}, "must lie in [gamma_min, gamma_max]"),
])
def test_bad_parameters_fail_clearly(params, needle):
    with pytest.raises(ConfigError) as e:
        _sps("self", **params)
    assert needle in str(e.value)


def test_sps_without_a_draft_fails_clearly():
    lm = tiny(0)
    with pytest.raises(ConfigError, match="needs a draft model: pass draft=<name>"):
        build_decoder("sps", CachedModel(lm.model), lm.tokenizer)
