"""Decode-only tokens/s (pardec.metrics.speed.decode_tokens_per_s): prefill and its token left out."""

from __future__ import annotations

from pardec.metrics.speed import decode_tokens_per_s, speed_summary, tokens_per_s


def _rec(i, n, wall, prefill, turns=None, repeat=0):
    r = {"id": i, "repeat": repeat, "n_tokens": n, "wall_s": wall, "prefill_s": prefill, "target_forwards": n}
    if turns:
        r["turn_tokens"] = turns
    return r


def test_decode_speed_leaves_prefill_and_its_token_out():
    rows = [_rec(0, 11, 3.0, 1.0), _rec(1, 21, 5.0, 1.0)]
    assert tokens_per_s(rows) == 32 / 8.0
    assert decode_tokens_per_s(rows) == (10 + 20) / (2.0 + 4.0)
    two_turns = [_rec(0, 12, 4.0, 2.0, turns=[[1] * 6, [2] * 6])]  # a prefill (and its token) per turn
    assert decode_tokens_per_s(two_turns) == 10 / 2.0
    assert decode_tokens_per_s([_rec(0, 1, 1.0, 1.0)]) is None  # nothing but prefill


def test_speed_summary_reports_decode_speed_and_its_ratio():
    method = [_rec(0, 11, 2.0, 1.0)]  # 10 tokens in 1 s of decoding
    base = [_rec(0, 11, 6.0, 1.0)]  # 10 tokens in 5 s
    s = speed_summary(method, base)
    assert s["decode_tokens_per_s"] == 10.0 and s["baseline_decode_tokens_per_s"] == 2.0
    assert s["decode_speedup"] == 5.0 and s["speedup"] == 3.0  # end to end: 5.5 vs 11/6 tokens/s
