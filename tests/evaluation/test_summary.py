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


def test_near_ties_are_divergences_within_a_few_ulps_of_the_runs_dtype():
    from pardec.evaluation import NEAR_TIE_ULPS, divergences, is_near_tie, near_tie_bound

    assert NEAR_TIE_ULPS == 4
    assert near_tie_bound(20.0, "bf16") == 0.5  # 20 lies in [16, 32): one bf16 ulp there is 2**4 * 2**-7
    assert near_tie_bound(-20.0, "bf16") == 0.5 and near_tie_bound(16.0, "bf16") == 0.5
    assert near_tie_bound(15.9, "bf16") == 0.25
    assert near_tie_bound(20.0, "fp16") == 0.5 / 8 and near_tie_bound(20.0, "fp32") == 4 * 2.0**-19
    assert near_tie_bound(20.0, "int8") == 0.5  # int8 activations: 8 bits relative, as bf16

    def rec(margin, top=20.0, equal=False):
        return {"equal_to_baseline": equal, "divergence_margin": margin,
                "divergence_top": None if margin is None else [[1, top], [2, top - margin]]}

    rows = [rec(0.0), rec(0.375), rec(0.5), rec(3.0), rec(None), rec(None, equal=True), {"equal_to_baseline": None}]
    assert [is_near_tie(r, "bf16") for r in rows[:5]] == [True, True, False, False, None]
    assert divergences(rows, "bf16") == {"n_divergences": 5, "n_near_ties": 2}
    assert divergences(rows, "fp32") == {"n_divergences": 5, "n_near_ties": 1}  # only the exact tie
    sampled = [{"equal_to_baseline": False, "divergence_margin": None, "divergence_top": None}]
    assert divergences(sampled, "bf16") == {"n_divergences": 1, "n_near_ties": None}  # no margin read: unknown
    assert divergences([], "bf16") == {"n_divergences": 0, "n_near_ties": 0}


def test_fp32_on_a_gpu_with_tf32_gets_the_tf32_near_tie_bound():
    from pardec.evaluation.summary import matmul_precision, near_tie_bound

    assert matmul_precision("fp32", True, "cuda:0") == "tf32"
    assert matmul_precision("fp32", False, "cuda:0") == "fp32" == matmul_precision("fp32", True, "cpu")
    assert matmul_precision("bf16", True, "cuda:0") == "bf16"
    assert near_tie_bound(20.0, "tf32") == near_tie_bound(20.0, "fp16") > 1000 * near_tie_bound(20.0, "fp32")
