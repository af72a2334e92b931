"""Chi-square goodness of fit for the distribution tests (no scipy: torch's regularised gamma)."""

from __future__ import annotations

from collections import Counter

import torch


def chi_square_p(observed: Counter, expected_probs: dict, n: int, min_expected: float = 5.0) -> tuple[float, int]:
    """p-value of Pearson's chi-square test of ``observed`` counts (over ``n`` draws) against ``expected_probs``.

    Cells with expected count < ``min_expected`` are pooled into one cell (together with any observed outcome
    that has no expected probability, which a correct sampler never produces). Returns (p, degrees of freedom).
    """
    obs, exp = [], []
    pooled_o = pooled_e = 0.0
    for key, pr in expected_probs.items():
        e = pr * n
        if e < min_expected:
            pooled_o += observed.get(key, 0)
            pooled_e += e
        else:
            obs.append(observed.get(key, 0))
            exp.append(e)
    pooled_o += sum(c for k, c in observed.items() if k not in expected_probs)
    if pooled_e > 0 or pooled_o > 0:
        if pooled_e < 1e-9 and pooled_o > 0:
            return 0.0, len(obs)  # an impossible outcome was observed
        obs.append(pooled_o)
        exp.append(max(pooled_e, 1e-9))
    o, e = torch.tensor(obs, dtype=torch.float64), torch.tensor(exp, dtype=torch.float64)
    stat = float(((o - e) ** 2 / e).sum())
    dof = len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2)))
    return p, dof
