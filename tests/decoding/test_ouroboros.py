"""Ouroboros: oracle phrases that force lengthening (a fully matched phrase, phrases past the budget, EOS inside
a phrase), the harvest of verified phrases, each ablation flag changing what it should and nothing else, and
bad input. Exactness against ``ar`` and the chi-square test are in test_lossless / test_distribution."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.ouroboros import Ouroboros
from tests.conftest import draft_for
from tests.decoding.conftest import TracksOutput

SMALL = {"window": 3, "guess_set": 3, "level": 4}


class OracleOuroboros(TracksOutput, Ouroboros):
    """Lengthening phrases from the true continuation after the draft: the full match, and a wrong one."""

    def __init__(self, *a, truth: list[int], **kw):
        super().__init__(*a, **kw)
        self.truth = truth

    def phrases_for(self, draft, room):
        if not self.lengthening or room <= 0:
            return []
        i = len(self.out_tokens) + len(draft)
        good = tuple(self.truth[i : i + self.level - 1][:room])
        return [tuple(t + 1 for t in good), good] if good else []


def _ar(cm, tok, ids, n, stop):
    return build_decoder("ar", cm, tok).generate(ids, n, stop)


@pytest.mark.parametrize("max_new", [3, 10, 29])
def test_fully_matched_phrase_extends_the_draft(setup, max_new):
    lm, cm, ids = setup
    stop = Stopper(lm.tokenizer)
    ref = _ar(cm, lm.tokenizer, ids, max_new, stop)
    dec = OracleOuroboros(cm, lm.tokenizer, draft_for("self"), truth=ref.tokens + [0] * 16, gamma=3, **SMALL)
    res = dec.generate(ids, max_new, stop)
    assert res.tokens == ref.tokens and res.stop_reason == "length"
    # a full round: 3 draft tokens + a 3-token phrase + the target's own token (the official code's off-by-one
    # dropped that last one when the phrase matched fully)
    full = [a for a in res.accepted[1:-1]]
    assert all(a == 3 + 3 + 1 for a in full)
    if max_new >= 10:
        assert res.extras["accepted_from_phrases"] > 0 and res.extras["block_efficiency"] > 3


def test_eos_inside_a_phrase(setup):
    lm, cm, ids = setup
    ref = _ar(cm, lm.tokenizer, ids, 16, Stopper(lm.tokenizer))
    stop = Stopper(lm.tokenizer, eos_ids={ref.tokens[5]})  # inside the first round's phrase
    want = _ar(cm, lm.tokenizer, ids, 16, stop)
    res = OracleOuroboros(cm, lm.tokenizer, draft_for("self"), truth=ref.tokens + [0] * 16, gamma=2,
                          **SMALL).generate(ids, 16, stop)
    assert res.tokens == want.tokens and res.stop_reason == "eos"


def test_harvest_of_the_rejected_suffix():
    dec = Ouroboros.__new__(Ouroboros)
    from pardec.decoding.ngram import NGramPool

    dec.pool = NGramPool(4, 5)
    draft = [10, 11, 12, 13, 14, 15]  # node j holds draft[j-1]
    logits = torch.zeros(7, 100)
    pred = [10, 99, 99, 13, 14, 99, 0]  # target's argmax after each node: confirms 13 after 12, 14 after 13
    logits[torch.arange(7), torch.tensor(pred)] = 1.0
    dec._harvest_rejected(draft, logits, accepted=1)  # draft[1] (node 2) was rejected
    assert dec.pool.get(12) == [(13, 14)] and len(dec.pool) == 1


def _run(cm, tok, ids, n, **params):
    dec = build_decoder("ouroboros", cm, tok, draft_for("noisy"), **{**SMALL, **params})
    return dec, dec.generate(ids, n, Stopper(tok))


def test_accelerated_drafting_flag(setup):
    lm, cm, ids = setup
    ids = lm.tokenizer("one two three four five six seven eight. " * 5)["input_ids"]
    _, on = _run(cm, lm.tokenizer, ids, 40, gamma=6)
    _, off = _run(cm, lm.tokenizer, ids, 40, gamma=6, accelerated_drafting=False)
    assert on.tokens == off.tokens  # output unchanged
    assert off.draft_forwards == off.drafted  # token by token
    assert on.draft_forwards < on.drafted  # phrases: several draft tokens per draft forward


def test_lengthening_flag(setup):
    lm, cm, ids = setup
    ref = _ar(cm, lm.tokenizer, ids, 20, Stopper(lm.tokenizer))
    on = OracleOuroboros(cm, lm.tokenizer, draft_for("self"), truth=ref.tokens + [0] * 16, gamma=2, **SMALL)
    off = OracleOuroboros(cm, lm.tokenizer, draft_for("self"), truth=ref.tokens + [0] * 16, gamma=2,
                          lengthening=False, **SMALL)
    r_on, r_off = on.generate(ids, 20, Stopper(lm.tokenizer)), off.generate(ids, 20, Stopper(lm.tokenizer))
    assert r_on.tokens == r_off.tokens == ref.tokens
    assert r_on.extras["accepted_from_phrases"] > 0 == r_off.extras["accepted_from_phrases"]
    assert r_off.target_forwards > r_on.target_forwards


def test_verified_phrases_flag(setup, monkeypatch):
    lm, cm, ids = setup
    calls = {True: 0, False: 0}
    for flag in (True, False):
        original = Ouroboros._harvest_rejected

        def counting(self, *a, _flag=flag, _orig=original):
            calls[_flag] += 1
            return _orig(self, *a)

        monkeypatch.setattr(Ouroboros, "_harvest_rejected", counting)
        _, r = _run(cm, lm.tokenizer, ids, 30, gamma=4, verified_phrases=flag)
        monkeypatch.undo()
        assert r.drafted > r.draft_accepted  # some drafts were rejected
    assert calls[True] > 0 and calls[False] == 0


def test_warm_start_keeps_the_pool_across_prompts(setup):
    lm, cm, ids = setup
    warm, r1 = _run(cm, lm.tokenizer, ids, 20, warm_start=True)
    size = len(warm.pool)
    assert size > 0
    seen = []
    original = warm.phrases_for
    warm.phrases_for = lambda draft, room: seen.append(len(warm.pool)) or original(draft, room)
    r2 = warm.generate(ids, 20, Stopper(lm.tokenizer))
    assert seen[0] >= size  # the first round of the second prompt already sees the first prompt's pool
    assert r2.tokens == r1.tokens
    cold, _ = _run(cm, lm.tokenizer, ids, 20)
    seen.clear()
    original = cold.phrases_for
    cold.phrases_for = lambda draft, room: seen.append(len(cold.pool)) or original(draft, room)
    cold.generate(ids, 20, Stopper(lm.tokenizer))
    assert seen[0] < size or size == 0  # cleared at the start: only this round's harvest


@pytest.mark.parametrize("params, match", [
    ({"gamma": 0}, r"method.gamma=0 is out of range: it must be an integer in \[1, 64\]"),
    ({"level": 40}, r"method.level=40 is out of range"),
    ({"window": -1}, r"method.window=-1 is out of range"),
    ({"guess_set": 0}, r"method.guess_set=0 is out of range"),
    ({"top_k_phrases": 99}, r"method.top_k_phrases=99 is out of range"),
    ({"top_k_phrases": 0}, r"method.top_k_phrases=0 with method.lengthening=true"),
])
def test_out_of_range(setup, params, match):
    with pytest.raises(ConfigError, match=match):
        build_decoder("ouroboros", setup[1], None, draft_for("self"), **params)


def test_needs_a_draft(setup):
    with pytest.raises(ConfigError, match="method 'ouroboros' needs a draft model: pass draft=<name>"):
        build_decoder("ouroboros", setup[1], None)
