"""`sps` specifics: adaptive gamma, drafts cut where the draft is unsure, draft-forward accounting, draft-cache resynchronisation, bad parameters."""

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


def test_an_unsure_draft_ends_the_round_at_the_token_it_is_unsure_of():
    plain, lm = _sps("random", gamma=5)
    res = plain.generate(PROMPT, 30, Stopper(lm.tokenizer))
    assert res.extras["mean_gamma"] > 4  # 5 a round (the last one cut to the room left)
    # an untrained draft over a 512-token vocabulary: no next token near probability 0.9, so every round drafts one
    unsure, lm = _sps("random", gamma=5, confidence_threshold=0.9)
    cut = unsure.generate(PROMPT, 30, Stopper(lm.tokenizer))
    assert cut.tokens == res.tokens
    assert cut.extras["mean_gamma"] == 1 and cut.drafted > 20
    assert cut.draft_forwards == cut.drafted  # each round: the catch-up forward, its one token, no further step
    sure, lm = _sps("self", gamma=4, confidence_threshold=1e-6)  # never unsure: the plain rounds
    assert sure.generate(PROMPT, 21, Stopper(lm.tokenizer)).accepted == [1, 5, 5, 5, 5]


@pytest.mark.parametrize("params,needle", [
    ({"gamma": 0}, "method.gamma=0 is out of range"),
    ({"confidence_threshold": 1.5}, "method.confidence_threshold=1.5 is out of range"),
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


# ------------------------------------------------------------------------------------------ gamma from measured costs
def _table(ms: dict[int, float]):
    from pardec.models.cost import CostTable

    return CostTable("tiny", "fp32", 100, ms, machine={"cpu": "test"})


def test_gamma_by_cost_picks_the_most_tokens_per_ms():
    dec, _ = _sps("self", gamma=3, gamma_by_cost=True, gamma_max=8)
    # 5 rows are cheaper than 3 or 4 (a padded forward), 6 rows and more dearer, 9+ not measured
    dec.target.cost = _table({1: 10.0, 2: 17.0, 3: 20.0, 4: 19.0, 5: 12.0, 6: 30.0, 8: 31.0})
    # almost every draft token accepted, a cheap draft: 4 drafts verified in a (padded) 5-row forward of 12 ms
    assert dec.gamma_for(accepted=1000, rejections=1, draft_ms=0.1, room=50) == 4
    # almost none accepted: a longer draft only adds cost
    assert dec.gamma_for(accepted=0, rejections=200, draft_ms=0.1, room=50) == 1
    # the acceptance is a ratio with a prior: 3 accepted, 1 rejection -> a = 4/6. By hand (every count of 2-5 rows
    # padded to the 12 ms 5-row forward): g = 3: (1 - a^4) / (1 - a) = 2.41 tokens in 12 + 3 x 2 ms = 0.134 / ms;
    # g = 4: 2.60 / 20 = 0.130; g = 2: 2.11 / 16 = 0.132; g = 1: 1.67 / 14 = 0.119
    assert dec.gamma_for(accepted=3, rejections=1, draft_ms=2.0, room=50) == 3
    # a dear draft: one token per round
    assert dec.gamma_for(accepted=1000, rejections=1, draft_ms=50.0, room=50) == 1
    # room and gamma_max cap it; counts past the table's largest are never chosen
    assert dec.gamma_for(accepted=1000, rejections=1, draft_ms=0.1, room=2) == 2
    dec.target.cost = _table({1: 10.0, 2: 11.0, 3: 11.5})
    assert dec.gamma_for(accepted=1000, rejections=1, draft_ms=0.1, room=50) == 2


def test_gamma_by_cost_keeps_the_output_and_follows_the_table():
    lm = tiny(0)
    ref = build_decoder("ar", CachedModel(lm.model), lm.tokenizer).generate(PROMPT, 40, Stopper(lm.tokenizer))
    for draft in ("self", "noisy", "random"):
        dec = build_decoder("sps", CachedModel(lm.model), lm.tokenizer, draft_for(draft, 0), gamma=2,
                            gamma_by_cost=True, gamma_max=8)
        # seconds, not ms: the tiny draft's measured ms per forward must not matter
        dec.target.cost = _table({1: 1e4, 2: 4e4, 3: 4e4, 4: 4e4, 5: 4e4, 6: 1.1e4, 7: 5e4, 8: 5e4})
        res = dec.generate(PROMPT, 40, Stopper(lm.tokenizer))
        assert res.tokens == ref.tokens, draft
        if draft == "self":  # every draft accepted: after the two rounds at gamma 2, the 6-row forward (gamma 5)
            assert res.accepted[1:4] == [3, 3, 6]


def test_gamma_by_cost_needs_a_cost_table_and_excludes_adaptive():
    dec, lm = _sps("self", gamma=3, gamma_by_cost=True)
    with pytest.raises(ConfigError, match="gamma_by_cost=true needs this machine's forward-cost table"):
        dec.generate(PROMPT, 8, Stopper(lm.tokenizer))
    with pytest.raises(ConfigError, match="pick one"):
        _sps("self", gamma=3, gamma_by_cost=True, adaptive=True)
    with pytest.raises(ConfigError, match=r"method.gamma=9 must lie in \[gamma_min, gamma_max\] = \[1, 8\] when "
                                          r"method.gamma_by_cost=true"):
        _sps("self", gamma=9, gamma_by_cost=True, gamma_max=8)
