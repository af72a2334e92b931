"""Speed with and without repetitive generations (the CLLM authors' speed script drops them), on hand-made
records."""

from __future__ import annotations

import pytest

from pardec.metrics.speed import (
    REPEAT_RUN,
    is_repetitive,
    nonrepetitive_speed,
    record_is_repetitive,
    speed_summary,
)


def _rec(id_, tokens, wall, forwards, repeat=0):
    return {"id": id_, "repeat": repeat, "tokens": tokens, "n_tokens": len(tokens), "wall_s": wall,
            "target_forwards": forwards}


def test_a_token_ten_times_in_a_row_is_repetitive():
    assert REPEAT_RUN == 10  # cllm/utils.py detect_repetitive_patterns(..., repeat_ngram_size=10)
    assert is_repetitive([1, 2] + [3] * 10 + [4])
    assert not is_repetitive([1, 2] + [3] * 9 + [4] + [3] * 9)
    assert not is_repetitive([1, 2] * 20)  # a repeated 2-gram is not a run of one token (the official rule)
    assert not is_repetitive([])
    assert record_is_repetitive({"tokens": [0] * 12, "turn_tokens": [[1, 2], [5] * 10]})
    assert not record_is_repetitive({"tokens": [5] * 10, "turn_tokens": [[5] * 5, [5] * 5]})  # runs per turn


def test_speed_without_repetitive_generations_drops_those_prompts_from_both_roles():
    method = [_rec("p1", [1, 2, 3, 4], 1.0, 2),
              _rec("p2", [5] * 10, 1.0, 2),              # repetitive: dropped with the baseline's p2
              _rec("p3", [7] * 9 + [8], 2.0, 5)]         # 9 in a row: kept
    baseline = [_rec("p1", [1, 2, 3, 4], 2.0, 4), _rec("p2", [5] * 10, 5.0, 10), _rec("p3", [7] * 9 + [8], 4.0, 10)]
    full = speed_summary(method, baseline)
    assert full["tokens_per_s"] == pytest.approx(24 / 4)          # (4 + 10 + 10) tokens / (1 + 1 + 2) s = 6
    assert full["speedup"] == pytest.approx(6 / (24 / 11))        # baseline 24 tokens / 11 s: 2.75
    got = nonrepetitive_speed(method, baseline)
    assert got["n_repetitive"] == 1 and got["repetitive_run"] == 10
    assert got["tokens_per_s_nonrepetitive"] == pytest.approx(14 / 3)           # (4 + 10) / (1 + 2)
    assert got["baseline_tokens_per_s_nonrepetitive"] == pytest.approx(14 / 6)  # (4 + 10) / (2 + 4)
    assert got["speedup_nonrepetitive"] == pytest.approx(2.0)
    assert got["speedup_median_nonrepetitive"] == pytest.approx(2.0)            # p1: 4 / 2, p3: 5 / 2.5
    assert got["tokens_per_forward_nonrepetitive"] == pytest.approx(14 / 7)
    only = nonrepetitive_speed([method[1]], [baseline[1]])
    assert only["n_repetitive"] == 1 and only["speedup_nonrepetitive"] is None
