"""pardec.evaluation.summary: pass@k over repeats and the progress bar's running speed, on hand-made records."""

from __future__ import annotations

import pytest

from pardec.evaluation import pass_at_k_summary, running_speed


def test_pass_at_k_averages_the_unbiased_estimator_over_prompts():
    rows = [{"id": "a", "score": {"pass": 1.0}}, {"id": "a", "score": {"pass": 0.0}},
            {"id": "b", "score": {"pass": 0.0}}, {"id": "b", "score": {"pass": None}}]
    assert pass_at_k_summary(rows, 2) == {"pass@1": pytest.approx(0.25), "pass@2": pytest.approx(0.5)}
    assert set(pass_at_k_summary(rows, 10)) == {"pass@1", "pass@2", "pass@5", "pass@10"}
    assert pass_at_k_summary(rows, 10)["pass@5"] is None  # no prompt has 5 samples


def test_running_speed_leaves_out_failed_records():
    def rec(role, n, wall, **extra):
        return {"role": role, "n_tokens": n, "wall_s": wall, "prefill_s": 0.0, "target_forwards": n, **extra}

    assert running_speed([rec("method", 10, 1.0)], "method") == ""  # no baseline yet
    records = [rec("baseline", 10, 1.0), rec("method", 20, 1.0), rec("method", 0, 9.0, error="NaN")]
    assert running_speed(records, "method") == "20.0 tok/s, x2.00"
