"""The unbiased pass@k estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on Code"."""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn without replacement from ``n`` passes.

    ``n`` samples were generated for a problem and ``c`` of them passed. The estimate is
    ``1 - C(n-c, k) / C(n, k)``, computed as ``1 - prod_{i=n-c+1}^{n} (1 - k/i)``: no huge binomials,
    no overflow, exact 0/1 at the ends.
    """
    for name, v in (("n", n), ("c", c), ("k", k)):
        if int(v) != v or v < 0:
            raise ValueError(f"pass_at_k: {name}={v!r} must be a non-negative integer")
    if k < 1:
        raise ValueError(f"pass_at_k: k={k} must be >= 1")
    if k > n:
        raise ValueError(f"pass_at_k: k={k} exceeds the number of samples n={n}; generate at least k samples")
    if c > n:
        raise ValueError(f"pass_at_k: c={c} passing samples exceeds n={n} samples")
    if n - c < k:  # every draw of k samples contains a passing one
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def mean_pass_at_k(n_per_problem: Sequence[int], c_per_problem: Sequence[int], k: int) -> float:
    """pass@k averaged over problems (each with its own ``n`` and ``c``)."""
    if len(n_per_problem) != len(c_per_problem) or not n_per_problem:
        raise ValueError(f"mean_pass_at_k: need equally many n and c values, at least one; got "
                         f"{len(n_per_problem)} and {len(c_per_problem)}")
    return sum(pass_at_k(n, c, k) for n, c in zip(n_per_problem, c_per_problem)) / len(n_per_problem)
