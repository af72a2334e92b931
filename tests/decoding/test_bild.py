"""BiLD: fallback and rollback on hand-set logits (stub models whose next token depends on the last one)."""

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


@pytest.mark.parametrize("params,needle", [
    ({"fallback_threshold": 1.5}, "method.fallback_threshold=1.5 is out of range: it must be a number in [0.0, 1.0]"),
    ({"rollback_threshold": 0.0}, "method.rollback_threshold=0.0 is out of range"),
    ({"max_draft": 0}, "method.max_draft=0 is out of range: it must be an integer in [1, 256]"),
])
def test_bad_thresholds_are_named(params, needle):
    with pytest.raises(ConfigError) as e:
        build_decoder("bild", TableLM(V, TARGET), None, TableLM(V, DRAFT), **params)
    assert needle in str(e.value)
