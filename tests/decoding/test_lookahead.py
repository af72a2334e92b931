"""Lookahead decoding's parts: the n-gram pool (LRU, per-key cap), the window (mask, positions, harvest, shift),
and greedy exactness with oracle candidates that force multi-token acceptance, full matches, phrases past the
budget and EOS inside a phrase."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.lookahead import Lookahead
from pardec.decoding.ngram import LookaheadWindow, NGramPool
from pardec.decoding.tree import Tree
from tests.decoding.conftest import TracksOutput


def test_pool_keeps_at_most_g_per_key_least_recently_used_out():
    pool = NGramPool(n=3, max_per_key=2)
    pool.add(1, [2, 3])
    pool.add(1, [4, 5])
    pool.add(1, [2, 3])  # refreshed: now the most recent
    pool.add(1, [6, 7])  # evicts (4, 5), the least recently used
    assert pool.get(1) == [(6, 7), (2, 3)] and pool.get(1, 1) == [(6, 7)]
    pool.add(9, [1, 2, 3, 4])  # cut to n - 1 tokens
    assert pool.get(9) == [(1, 2)] and len(pool) == 3 and 9 in pool and 5 not in pool
    pool.add_sequence([5, 6, 7, 8])
    assert pool.get(5) == [(6, 7)] and pool.get(6) == [(7, 8)] and pool.get(7) == []
    with pytest.raises(ValueError, match="n >= 2"):
        NGramPool(n=1, max_per_key=3)


def test_window_mask_positions_harvest_and_shift():
    fills = iter(range(100, 200))
    win = LookaheadWindow(width=3, n=3, fill=lambda k: [next(fills) for _ in range(k)])
    assert win.levels == [[100, 101, 102]]
    toks, pos, att = win.inputs(root_pos=10)
    assert toks == [100, 101, 102] and pos == [11, 12, 13] and att.equal(torch.ones(3, 3, dtype=torch.bool).tril())
    pool = NGramPool(n=3, max_per_key=4)
    assert win.update([1, 2, 3], pool, advance=1) == 0  # filling: no n-gram yet
    assert win.levels == [[101, 102, 103], [2, 3, 104]]  # one column behind the root dropped, refilled
    toks, pos, att = win.inputs(root_pos=11)
    assert pos == [12, 13, 14, 13, 14, 15]
    # level 1, column j sees level 0 up to column j and itself
    assert att[3].tolist() == [True, False, False, True, False, False]
    assert att[5].tolist() == [True, True, True, False, False, True]
    assert win.update([7, 8, 9], pool, advance=1) == 3  # full: one n-gram per column, level 0 first
    assert pool.get(101) == [(2, 7)] and pool.get(103) == [(104, 9)]
    assert win.levels == [[2, 3, 104], [7, 8, 9]]  # the oldest level dropped, positions still line up
    win.update([4, 5, 6], pool, advance=3)  # three tokens committed: two more columns fall behind the root
    assert win.levels[0][0] == 9 and win.levels[1][0] == 6 and len(win.levels[1]) == 3


class OracleLookahead(TracksOutput, Lookahead):
    """Candidates from the true continuation: a half-corrupted copy, a wrong token, and the full match."""

    def __init__(self, *a, truth: list[int], **kw):
        super().__init__(*a, **kw)
        self.truth = truth

    def candidates(self, pool, last, room):
        i = len(self.out_tokens)
        good = self.truth[i : i + self.level - 1][:room]
        half = good[: len(good) // 2] + [t + 1 for t in good[len(good) // 2 :]]
        return Tree.from_paths([p for p in (half, [good[0] + 1] if good else [], good) if p])


@pytest.mark.parametrize("level", [2, 3, 5])
@pytest.mark.parametrize("max_new", [1, 2, 9, 23])
def test_oracle_candidates_commit_level_tokens_per_step_and_equal_ar(setup, level, max_new):
    lm, cm, ids = setup
    stop = Stopper(lm.tokenizer)
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, max_new, stop)
    dec = OracleLookahead(cm, lm.tokenizer, truth=ref.tokens + [0] * 8, level=level, window=2, guess_set=3)
    res = dec.generate(ids, max_new, stop)
    assert res.tokens == ref.tokens and res.stop_reason == "length"
    # every step accepts the full phrase (level - 1 tokens) plus the target's own token, cut at the budget
    steps = -(-(max_new - 1) // level)
    assert res.target_forwards == 1 + steps and sum(res.accepted) == max_new
    assert all(a == level for a in res.accepted[1:-1])  # every full step: level - 1 phrase tokens + one


def test_eos_inside_a_phrase_stops_there(setup):
    lm, cm, ids = setup
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, 12, Stopper(lm.tokenizer))
    eos = ref.tokens[6]
    stop = Stopper(lm.tokenizer, eos_ids={eos})
    want = build_decoder("ar", cm, lm.tokenizer).generate(ids, 12, stop)
    res = OracleLookahead(cm, lm.tokenizer, truth=ref.tokens + [0] * 8, level=5, window=2, guess_set=3).generate(ids, 12, stop)
    assert res.tokens == want.tokens and res.stop_reason == want.stop_reason == "eos"
    assert res.tokens[-1] == eos


@pytest.mark.parametrize("params, match", [
    ({"level": 1}, r"method.level=1 is out of range: it must be an integer in \[2, 16\]"),
    ({"window": 0}, r"method.window=0 is out of range"),
    ({"guess_set": 500}, r"method.guess_set=500 is out of range"),
])
def test_out_of_range_parameters(setup, params, match):
    with pytest.raises(ConfigError, match=match):
        build_decoder("lookahead", setup[1], None, **params)


def test_real_pool_on_a_repetitive_prompt_accepts_several_tokens(setup):
    lm, cm, _ = setup
    ids = lm.tokenizer("one two three four five six seven eight. " * 6)["input_ids"]
    stop = Stopper(lm.tokenizer)
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, 30, stop)
    res = build_decoder("lookahead", cm, lm.tokenizer, level=4, window=4, guess_set=4,
                        pool_from_prompt=True).generate(ids, 30, stop)
    assert res.tokens == ref.tokens
    assert 0 <= res.extras["pool_hit_rate"] <= res.extras["pool_lookup_rate"] <= 1
    assert res.extras["pool_size"] > 0
