"""Lookahead decoding's parts: the n-gram pool (LRU, per-key cap), the window (mask, positions, harvest, shift),
and greedy exactness with oracle candidates that force multi-token acceptance, full matches, phrases past the
budget and EOS inside a phrase."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.lookahead import Lookahead
from pardec.decoding.ngram import LookaheadWindow, NGramPool, lookahead_forward
from pardec.decoding.tree import Tree
from tests.decoding.chainlm import ChainLM
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


def test_window_layout_is_lades_fill_harvest_and_shift():
    """LADE's layout, W = 3, N = 4 (3 levels). Column 0 of level 0 is the root (not stored); column j of level l sits
    at root + l + j. The window starts as W + N - 3 = 4 guesses and fills one level per step, each level losing its
    first column; then every step harvests one n-gram per column (column 0 keyed by the root) and moves on by one."""
    fills = iter(range(100, 200))
    win = LookaheadWindow(width=3, n=4, fill=lambda k: [next(fills) for _ in range(k)])
    assert win.levels == [[100, 101, 102, 103]] and not win.full
    toks, pos, att = win.inputs(root_pos=10)
    assert toks == [100, 101, 102, 103] and pos == [11, 12, 13, 14]
    assert att.equal(torch.ones(4, 4, dtype=torch.bool).tril()) and win.top() == slice(0, 4)
    pool = NGramPool(n=4, max_per_key=4)
    assert win.update([1, 2, 3, 4], pool, root=50) == 0  # filling: level 1 = every output, level 0 loses 100
    assert win.levels == [[101, 102, 103], [1, 2, 3, 4]]
    toks, pos, att = win.inputs(root_pos=11)
    assert pos == [12, 13, 14, 12, 13, 14, 15]  # level 1, column j at root + 1 + j (column 0 sees the root only)
    assert att[3].tolist() == [False] * 3 + [True, False, False, False]
    assert att[5].tolist() == [True, True, False] + [False, False, True, False]
    assert win.top() == slice(3, 7)
    assert win.update([5, 6, 7, 8], pool, root=51) == 0  # level 2 = outputs but the first; the others lose one
    assert win.levels == [[102, 103], [2, 3, 4], [6, 7, 8]] and win.full and len(win) == 8
    toks, pos, att = win.inputs(root_pos=12)
    assert toks == [102, 103, 2, 3, 4, 6, 7, 8] and pos == [13, 14, 13, 14, 15, 14, 15, 16]
    # level 2, column 1 (at 15): level 0 up to column 1 (root, 102 at 13), level 1 column 1 (3 at 14), itself
    assert att[6].tolist() == [True, False, False, True, False, False, True, False]
    assert win.update([20, 21, 22], pool, root=60) == 3
    assert pool.get(60) == [(2, 6, 20)] and pool.get(102) == [(3, 7, 21)] and pool.get(103) == [(4, 8, 22)]
    assert win.levels == [[3, 4], [6, 7, 8], [20, 21, 22]]  # oldest level dropped, moved on by one position


def test_window_of_bigrams_reads_the_roots_output():
    """N = 2: the top level is level 0 itself, the root included: W n-grams, the first keyed by the root."""
    win = LookaheadWindow(width=3, n=2, fill=lambda k: [100 + i for i in range(k)])
    assert win.levels == [[100, 101]] and win.full and win.top_has_root
    pool = NGramPool(n=2, max_per_key=4)
    assert win.update([7, 8, 9], pool, root=5) == 3
    assert pool.get(5) == [(7,)] and pool.get(100) == [(8,)] and pool.get(101) == [(9,)]
    assert win.levels == [[8, 9]]
    # the forward returns the root's logits first: a table model, 5 -> 6, 8 -> 12, 9 -> 13
    lm = ChainLM(16, {5: {6: 1.0}, 8: {12: 1.0}, 9: {13: 1.0}})
    lm.prefill(torch.tensor([[1]]))
    tree_logits, top = lookahead_forward(lm, [5], Tree.chain([]), win)
    assert tree_logits.argmax(-1).tolist() == [6] and top.argmax(-1).tolist() == [6, 12, 13]


class SeesPool(Lookahead):
    def candidates(self, pool, last, room):
        self.pool = pool
        return super().candidates(pool, last, room)


@pytest.mark.parametrize("from_output", [False, True])
def test_output_ngrams_enter_the_pool_only_when_asked(from_output):
    """Target t -> t + 1; prompt [1] (so every window guess is 1); N = 3, W = 1. Prefill: 2. Step 1 (root 2): the
    window (one level, [1]) outputs 2; commits 3; level 1 = [2]. Step 2 (root 3): full; column 0 = (root 3, 2),
    output 3 -> n-gram (3, 2, 3); commits 4. LADE's default keeps only that. pool_from_output adds the n-grams ending
    in each committed token: (1, 2, 3) after step 1, (2, 3, 4) after step 2."""
    dec = SeesPool(ChainLM(16, {t: {t + 1: 1.0} for t in range(15)}), level=3, window=1, guess_set=4,
                   pool_from_output=from_output)
    res = dec.generate([1], 3)
    assert res.tokens == [2, 3, 4] and res.target_forwards == 3
    want = {3: [(2, 3)]} | ({1: [(2, 3)], 2: [(3, 4)]} if from_output else {})
    assert {k: dec.pool.get(k) for k in range(16) if k in dec.pool} == want
    assert res.extras["pool_size"] == len(want)


def test_lades_pool_flags_are_off_by_default():
    import inspect

    params = inspect.signature(Lookahead.__init__).parameters
    assert {k: params[k].default for k in ("level", "window", "guess_set", "pool_from_prompt", "pool_from_output")} \
        == {"level": 5, "window": 15, "guess_set": 15, "pool_from_prompt": False, "pool_from_output": False}


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
