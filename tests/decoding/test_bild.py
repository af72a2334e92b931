"""BiLD: fallback and rollback on hand-set logits (stub models whose next token depends on the last one), for the BiLD
paper's variant (default) and MJSD's (warped distributions, the unsure token kept for the target)."""

from __future__ import annotations

import math

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import build_decoder
from pardec.decoding.bild import rollback_point
from tests.decoding.stubs import TableLM

V = 8
PROMPT = [7]
# the draft: confident after 0 and 1, unsure after 2 (max 0.5)
DRAFT = {0: {1: 0.95, 2: 0.05}, 1: {2: 0.95, 3: 0.05}, 2: {3: 0.5, 4: 0.5}, 4: {5: 0.95, 6: 0.05}}
# the target: starts with 0, agrees on 1 (p 0.9), finds 2 after 1 unlikely (p 0.05: 3.0 nats), prefers 4
TARGET = {7: {0: 1.0}, 0: {1: 0.9, 5: 0.1}, 1: {2: 0.05, 4: 0.95}, 2: {3: 1.0}, 3: {6: 1.0}, 4: {5: 1.0},
          5: {6: 1.0}, 6: {6: 1.0}}


def run(max_new: int, sampling=None, **params):
    target, draft = TableLM(V, TARGET), TableLM(V, DRAFT)
    res = build_decoder("bild", target, None, draft, **params).generate(PROMPT, max_new, sampling=sampling)
    return res, target, draft


def test_rollback_point_by_hand():
    logits = torch.log(torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.2, 0.3, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]) + 1e-30)
    # -log p: 0.105 (token 0 in row 0), 1.204 (token 1 in row 1)
    assert rollback_point(torch.tensor([0, 1]), logits, 2.0) == 2
    assert rollback_point(torch.tensor([0, 1]), logits, 1.0) == 1  # 1.204 > 1
    assert rollback_point(torch.tensor([1, 1]), logits, 2.0) == 0  # -log 0.1 = 2.30 > 2
    assert rollback_point(torch.tensor([0, 1]), logits, -math.log(0.3)) == 2  # equal is not "exceeds"
    assert rollback_point(torch.tensor([], dtype=torch.long), logits[:1], 2.0) == 0


def test_fallback_then_rollback():
    res, target, _ = run(5)
    # round 1: the draft proposes 1, 2 and falls back at the unsure position; the target checks [last=0, 1, 2]:
    # 1 survives (0.105 nats), 2 is rolled back (3.0 > 2) and the target puts its own argmax 4 there.
    # round 2 (room for one draft token): the draft proposes 5, the target agrees (0 nats) and adds 6
    assert res.tokens == [0, 1, 4, 5, 6]
    assert target.calls[1:] == [[0, 1, 2], [4, 5]]
    assert res.target_forwards == 3 and res.accepted == [1, 2, 2]
    assert (res.drafted, res.draft_accepted) == (3, 2)
    assert res.extras["fallback_rate"] == 0.5 and res.extras["rollback_rate"] == 0.5
    assert target.tokens == [7, 0, 1, 4, 5]  # the cache never holds a rolled-back token


def test_no_rollback_under_a_looser_threshold():
    res, target, _ = run(5, rollback_threshold=3.5)  # 3.0 nats now passes
    # both draft tokens, then the target's token where the draft was unsure (3); then one plain target step
    assert res.tokens == [0, 1, 2, 3, 6] and target.calls[1] == [0, 1, 2]
    assert res.extras["rollback_rate"] == 0.0 and res.extras["fallback_rate"] == 0.5
    assert target.tokens == [7, 0, 1, 2, 3]


def test_max_draft_caps_the_draft_without_a_fallback():
    res, target, _ = run(3, max_draft=1, rollback_threshold=3.5)
    assert target.calls[1] == [0, 1]  # one draft token, then the target
    assert res.tokens == [0, 1, 4] and res.extras["fallback_rate"] == 0.0


def test_an_always_unsure_draft_leaves_the_target_decoding_alone():
    res, target, _ = run(6, fallback_threshold=0.99)
    ar = build_decoder("ar", TableLM(V, TARGET)).generate(PROMPT, 6)
    assert res.tokens == ar.tokens and res.drafted == 0 and res.target_forwards == ar.target_forwards


def test_sampling_takes_the_target_token_from_its_distribution():
    counts = torch.zeros(V)
    for seed in range(200):
        res, _, _ = run(3, sampling=SamplingConfig(temperature=1.0, seed=seed), rollback_threshold=1e-6,
                        fallback_threshold=0.0, max_draft=1)
        # every draft token is rolled back: token 2 is the target's own sample after 0 (1: 0.9, 5: 0.1)
        counts[res.tokens[1]] += 1
    assert counts[1] + counts[5] == 200 and 150 <= counts[1] <= 195


# The variants on hand-set tables, greedy decoding with top-p 0.8 (top-k off), fallback 0.9, rollback 2 nats.
# draft after 0: 1 .85, 2 .15 (plain max .85 < .9: unsure; top-p .8 keeps 1 alone: 1.0, sure)
# draft after 1: 3 .6, 4 .4 (unsure either way: top-p .8 keeps both, 4 having .6 before it)
# target after 0: 1 .9, 5 .1; after 1: 4 .7, 3 .3 (top-p .8 keeps both); after 3: 6; after 4: 5
V_DRAFT = {0: {1: 0.85, 2: 0.15}, 1: {3: 0.6, 4: 0.4}}
V_TARGET = {7: {0: 1.0}, 0: {1: 0.9, 5: 0.1}, 1: {4: 0.7, 3: 0.3}, 3: {6: 1.0}, 4: {5: 1.0}}
TOP_P = SamplingConfig(temperature=0.0, top_p=0.8)


def test_bild_variant_falls_back_before_the_unsure_token():
    target = TableLM(V, V_TARGET)
    res = build_decoder("bild", target, None, TableLM(V, V_DRAFT)).generate(PROMPT, 4, sampling=TOP_P)
    # unsure after 0 (.85) and after 1 (.6): the draft proposes nothing and the target decodes alone: 1, 4, 5
    assert res.tokens == [0, 1, 4, 5] and res.drafted == 0 and res.target_forwards == 4
    assert target.calls[1:] == [[0], [1], [4]]


def test_mjsd_variant_warps_and_keeps_the_unsure_token_for_the_target():
    target = TableLM(V, V_TARGET)
    res = build_decoder("bild", target, None, TableLM(V, V_DRAFT), variant="mjsd").generate(PROMPT, 4, sampling=TOP_P)
    # round 1: after 0 the warped draft is sure (1.0): 1; after 1 it is unsure (.6) but drafts its argmax 3 and stops.
    # The target checks [0, 1, 3]: warped p(1 | 0) = 1 (top-p .8 drops 5): 0 nats; p(3 | 1) = .3: 1.20 nats < 2: both
    # kept, then the target's 6 after 3
    assert target.calls[1] == [0, 1, 3]
    assert res.tokens == [0, 1, 3, 6] and res.target_forwards == 2 and res.accepted == [1, 3]
    assert (res.drafted, res.draft_accepted) == (2, 2) and res.extras["fallback_rate"] == 1.0


def test_rollback_point_on_warped_distributions_by_hand():
    logits = torch.log(torch.tensor([[0.85, 0.15, 0.0, 0.0], [0.5, 0.3, 0.2, 0.0]]) + 1e-30)
    # token 1 in row 0: plain -log .15 = 1.90 nats (kept under 2); top-p .8 drops it (.85 before it): infinite
    assert rollback_point(torch.tensor([1]), logits[:1], 2.0) == 1
    assert rollback_point(torch.tensor([1]), logits[:1], 2.0, SamplingConfig(temperature=1.0, top_p=0.8)) == 0
    # token 1 in row 1: plain -log .3 = 1.20 > 1 (rolled back); top-k 2 renormalises it to .3 / .8: 0.98 < 1 (kept)
    assert rollback_point(torch.tensor([0, 1]), logits, 1.0) == 1
    assert rollback_point(torch.tensor([0, 1]), logits, 1.0, SamplingConfig(temperature=1.0, top_k=2)) == 2


@pytest.mark.parametrize("params,needle", [
    ({"fallback_threshold": 1.5}, "method.fallback_threshold=1.5 is out of range: it must be a number in [0.0, 1.0]"),
    ({"rollback_threshold": 0.0}, "method.rollback_threshold=0.0 is out of range"),
    ({"max_draft": 0}, "method.max_draft=0 is out of range: it must be an integer in [1, 256]"),
    ({"variant": "kim"}, "method.variant='kim' must be one of 'bild', 'mjsd'"),
])
def test_bad_thresholds_are_named(params, needle):
    with pytest.raises(ConfigError) as e:
        build_decoder("bild", TableLM(V, TARGET), None, TableLM(V, DRAFT), **params)
    assert needle in str(e.value)


def test_a_bad_variant_is_refused_before_any_model_loads():
    from pardec.decoding.bild import BigLittleDecoder
    from pardec.evaluation.spec import check_method

    with pytest.raises(ConfigError, match="method.variant='MJSD' must be one of 'bild', 'mjsd'"):
        check_method("bild", {"variant": "MJSD"}, None)
    with pytest.raises(ConfigError, match="method.variant='MJSD' is not valid; choose one of: bild, mjsd"):
        BigLittleDecoder(None, variant="MJSD")  # the decoder's own check
