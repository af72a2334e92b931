"""The unbiased pass@k estimator against its binomial definition."""

from __future__ import annotations

import math

import pytest

from pardec.metrics.passk import mean_pass_at_k, pass_at_k


@pytest.mark.parametrize("n, c, k", [(1, 0, 1), (1, 1, 1), (5, 2, 1), (5, 2, 3), (10, 3, 5), (20, 1, 10), (7, 7, 7),
                                     (200, 13, 100)])
def test_matches_the_binomial_definition(n, c, k):
    exact = 1.0 - math.comb(n - c, k) / math.comb(n, k)
    assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-12, abs=1e-12)


def test_edge_values():
    assert pass_at_k(10, 0, 5) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 6, 5) == 1.0  # only 4 failing samples: every draw of 5 holds a passing one
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = fraction correct


def test_numerically_stable_for_large_n():
    v = pass_at_k(100_000, 1, 50_000)
    assert v == pytest.approx(0.5) and 0.0 <= pass_at_k(100_000, 99_000, 10) <= 1.0


def test_monotone_in_k_and_c():
    assert pass_at_k(20, 3, 1) < pass_at_k(20, 3, 5) < pass_at_k(20, 3, 10)
    assert pass_at_k(20, 2, 5) < pass_at_k(20, 3, 5)


@pytest.mark.parametrize("n, c, k, match", [
    (5, 2, 6, "k=6 exceeds the number of samples n=5"),
    (5, 6, 1, "c=6"),
    (5, 2, 0, "k=0"),
    (5, -1, 1, "c=-1"),
    (5, 1.5, 1, "c=1.5"),
])
def test_bad_arguments_raise_naming_the_value(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_mean_over_problems():
    assert mean_pass_at_k([4, 4], [0, 4], 1) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="equally many"):
        mean_pass_at_k([4], [1, 2], 1)
