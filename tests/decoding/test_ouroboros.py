"""Ouroboros: oracle phrases that force lengthening (a fully matched phrase, phrases past the budget, EOS inside
a phrase), the harvest of verified phrases, each ablation flag changing what it should and nothing else, and
bad input. Exactness against ``ar`` and the chi-square test are in test_lossless / test_distribution."""

from __future__ import annotations

import pytest

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.ngram import NGramPool
from pardec.decoding.ouroboros import Ouroboros
from tests.conftest import draft_for
from tests.decoding.chainlm import ChainLM
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
    # App. C: generated tokens / target forwards, the prefill included. max_new 3: prefill (1 token) + one round of
    # 1 draft token + the target's (2 tokens); max_new 10: prefill + 3 + 3 + 1 + a last round of 1 + 1
    want = {3: 3 / 2, 10: 10 / 3}
    if max_new in want:
        assert res.target_forwards == round(max_new / want[max_new])
        assert res.extras["block_efficiency"] == pytest.approx(want[max_new])
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


def _pred(dec_level: int, pred: list[int], phrase_harvest: str, draft: list[int], accepted: int) -> NGramPool:
    """The pool after harvesting a rejected draft: ``pred[j]`` is the target's argmax at node j (node j >= 1 holds
    ``draft[j-1]``)."""
    dec = Ouroboros.__new__(Ouroboros)
    dec.level, dec.phrase_harvest = dec_level, phrase_harvest
    pool = NGramPool(dec_level, 5)
    dec.harvest(pool, draft, pred, accepted)
    return pool


def test_harvest_stores_the_targets_full_length_phrases():
    """Official ``add_extra_ngram`` (level 4: phrases of 3). draft 10..15, draft[1] = 11 rejected (the target said 20).
    Key 11: the target's tokens after it, 12 13 14, agree with the draft -> (12, 13, 14). Key 12: 13, 14, then 25
    where the draft had 15: the correction ends the phrase at full length -> (13, 14, 25). Key 13: 14, 25 (stops at
    the correction, 2 tokens: dropped); key 14: 25 (dropped); key 15: 16, the token after the draft (dropped)."""
    draft, pred = [10, 11, 12, 13, 14, 15], [10, 20, 12, 13, 14, 25, 16]
    pool = _pred(4, pred, "target", draft, accepted=1)
    assert pool.get(11) == [(12, 13, 14)] and pool.get(12) == [(13, 14, 25)] and len(pool) == 2
    # pardec's earlier rule keeps only the run of confirmed draft tokens 12 13 14 (after 11)
    runs = _pred(4, pred, "confirmed_runs", draft, accepted=1)
    assert runs.get(11) == [(12, 13, 14)] and len(runs) == 1


def test_harvest_rules_differ_on_a_short_confirmed_run():
    """Target confirms 13 after 12 and 14 after 13, then says 99 where the draft had 15. confirmed_runs: the run
    (13, 14) keyed by 12. target: key 12 -> 13, 14, 99 (the correction completes a full-length phrase); key 11 ->
    99 at once (dropped); key 13 -> 14, 99 (dropped); key 14 -> 99; key 15 -> 0 (after the draft; dropped)."""
    draft, pred = [10, 11, 12, 13, 14, 15], [10, 99, 99, 13, 14, 99, 0]
    assert _pred(4, pred, "confirmed_runs", draft, 1).get(12) == [(13, 14)]
    target = _pred(4, pred, "target", draft, 1)
    assert target.get(12) == [(13, 14, 99)] and len(target) == 1


def test_pool_replace_keeps_the_recency_position():
    pool = NGramPool(4, 3)
    for cont in [(1, 1, 1), (4, 9, 9), (2, 2, 2)]:
        pool.add(3, cont)
    assert pool.replace(3, (4, 9, 9), (4, 5, 10))
    assert pool.get(3) == [(2, 2, 2), (4, 5, 10), (1, 1, 1)]  # newest first: the corrected phrase kept its place
    assert pool.replace(3, (1, 1, 1), (2, 2, 2))  # becomes a phrase already there: one copy, at the old one's place
    assert pool.get(3) == [(4, 5, 10), (2, 2, 2)]
    assert not pool.replace(3, (7, 7, 7), (8, 8, 8)) and not pool.replace(5, (4, 5, 10), (1, 2, 3))
    assert pool.get(3) == [(4, 5, 10), (2, 2, 2)] and 5 not in pool


def _chain(v: int, table: dict[int, int]) -> ChainLM:
    return ChainLM(v, {a: {b: 1.0} for a, b in table.items()})


@pytest.mark.parametrize("refine", [True, False])
def test_refine_replaces_a_partly_confirmed_phrase_by_the_targets_version(refine):
    """Target and draft: 1 -> 2 -> 3 -> 4 -> 5 -> 6 -> 7, and 9 -> 10. gamma 1, level 4, K 1; the pool holds (4, 9, 9)
    after 3. Prefill: 2. Round 1: the draft says 3; the tree 2 -> 3 -> 4 -> 9 -> 9; the target accepts 3 and 4, then
    says 5 (not 9): commits 3 4 5. Its argmax after 3 (the draft) is 4, after 3 4 is 5, after 3 4 9 is 10: the pool's
    phrase becomes (4, 5, 10). Round 2: draft 6, no phrase after 6, commits 6 7."""
    table = {1: 2, 2: 3, 3: 4, 4: 5, 5: 6, 6: 7, 7: 8, 9: 10}
    dec = Ouroboros(_chain(16, table), None, _chain(16, table), gamma=1, level=4, window=1, guess_set=2,
                    top_k_phrases=1, accelerated_drafting=False, refine_phrases=refine)
    dec.pool.add(3, (4, 9, 9))
    res = dec.generate([1], 6)
    assert res.tokens == [2, 3, 4, 5, 6, 7] and res.target_forwards == 3 and res.accepted == [1, 3, 2]
    assert dec.pool.get(3) == ([(4, 5, 10)] if refine else [(4, 9, 9)])
    assert res.extras["phrases_refined"] == (1 if refine else 0)
    assert res.extras["block_efficiency"] == 6 / 3  # App. C: 6 tokens in 3 target forwards (prefill included)


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
        original = Ouroboros.harvest

        def counting(self, *a, _flag=flag, _orig=original):
            calls[_flag] += 1
            return _orig(self, *a)

        monkeypatch.setattr(Ouroboros, "harvest", counting)
        _, r = _run(cm, lm.tokenizer, ids, 30, gamma=4, verified_phrases=flag)
        monkeypatch.undo()
        assert r.drafted > r.draft_accepted  # some drafts were rejected
    assert calls[True] > 0 and calls[False] == 0


def test_the_papers_full_method_is_the_default():
    """Table 4's last row: every component on, warm start included; the HumanEval Yi setting (gamma 12, W 20, G 20,
    N 7, K 3); the target's phrases harvested and refined."""
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(Ouroboros.__init__).parameters.items()
                if p.default is not inspect.Parameter.empty and k not in ("tokenizer", "draft")}
    assert defaults == {"gamma": 12, "window": 20, "guess_set": 20, "level": 7, "top_k_phrases": 3,
                        "accelerated_drafting": True, "lengthening": True, "verified_phrases": True,
                        "phrase_harvest": "target", "refine_phrases": True, "warm_start": True}


def test_warm_start_keeps_the_pool_across_prompts(setup):
    lm, cm, ids = setup
    warm, r1 = _run(cm, lm.tokenizer, ids, 20)  # warm_start is the default
    size = len(warm.pool)
    assert size > 0
    seen = []
    original = warm.phrases_for
    warm.phrases_for = lambda draft, room: seen.append(len(warm.pool)) or original(draft, room)
    r2 = warm.generate(ids, 20, Stopper(lm.tokenizer))
    assert seen[0] >= size  # the first round of the second prompt already sees the first prompt's pool
    assert r2.tokens == r1.tokens
    cold, _ = _run(cm, lm.tokenizer, ids, 20, warm_start=False)
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
    ({"phrase_harvest": "runs"}, r"method.phrase_harvest='runs' is not one of target, confirmed_runs"),
])
def test_out_of_range(setup, params, match):
    with pytest.raises(ConfigError, match=match):
        build_decoder("ouroboros", setup[1], None, draft_for("self"), **params)


def test_needs_a_draft(setup):
    with pytest.raises(ConfigError, match="method 'ouroboros' needs a draft model: pass draft=<name>"):
        build_decoder("ouroboros", setup[1], None)


@pytest.mark.parametrize("method, params, match", [
    ("ouroboros", {"phrase_harvest": "runs"}, r"method.phrase_harvest='runs' is not one of target, confirmed_runs"),
    ("ouroboros", {"refine_phrases": "yes"}, r"method.refine_phrases='yes' must be bool"),
    ("lookahead", {"pool_from_output": 1.5}, r"method.pool_from_output=1.5 must be bool"),
])
def test_new_options_are_checked_before_any_model_loads(method, params, match):
    from pardec.evaluation.spec import check_method

    with pytest.raises(ConfigError, match=match):
        check_method(method, params, draft=None)
