"""SpecTr: the k-sequential selection (K-SEQ) is exact by its formula and by sampling, and the decoder samples
the target's distribution with k = 4 (k = 2 runs in test_distribution; greedy exactness in test_lossless)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.kseq import kseq, kseq_factors, kseq_residuals
from pardec.models.cached import CachedModel
from tests.decoding.test_distribution import PROMPT, SETTINGS, N, exact_joint, tiny_vocab
from tests.stats import chi_square_p


def kseq_factor(p: torch.Tensor, q: torch.Tensor, m: int) -> float:
    """:func:`kseq_factors` of one node, read back."""
    return float(kseq_factors(p[None], q[None], m)[0])


def kseq_residual(p: torch.Tensor, q: torch.Tensor, g: float, m: int) -> torch.Tensor:
    """:func:`kseq_residuals` of one node."""
    return kseq_residuals(p[None], q[None], torch.tensor([g], device=p.device), m)[0]


def _kseq_factor(p: torch.Tensor, q: torch.Tensor, g: float, m: int) -> tuple[float, float]:
    """(beta(g), sum_{i<m} (1 - beta)^i) of K-SEQ with division factor ``g`` and ``m`` draws, by the definition."""
    beta = float(torch.minimum(q.double(), p.double() / g).sum())
    return beta, sum((1.0 - beta) ** i for i in range(m))


def _pq(seed: int, v: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(v, generator=g) * 2, -1)
    return p, q


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_kseq_output_distribution_is_the_target_by_its_formula(seed, m):
    p, q = _pq(seed)
    g = kseq_factor(p, q, m)
    beta, total = _kseq_factor(p, q, g, m)
    assert 1.0 <= g <= m and g >= total - 1e-9  # the exactness condition
    if m == 1:
        assert g == 1.0  # one draft: plain speculative sampling
    accepted = torch.minimum(q, p / g) * total  # P(some draw is accepted and equals x)
    out = accepted + (1 - beta) ** m * kseq_residual(p, q, g, m)
    assert torch.allclose(out, p, atol=1e-5)
    # a smaller factor would break the condition (the solve found the smallest, to its tolerance)
    if g > 1.0 + 1e-6:
        assert _kseq_factor(p, q, g - 1e-4, m)[1] > g - 1e-4


def test_kseq_factor_is_one_when_draft_equals_target():
    p, _ = _pq(0)
    assert kseq_factor(p, p.clone(), 4) == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("m", [2, 4])
def test_kseq_samples_the_target(m):
    p, q = _pq(3, v=5)
    gen = torch.Generator().manual_seed(m)
    obs: Counter = Counter()
    n = 4000
    for _ in range(n):
        draws = torch.multinomial(q, m, replacement=True, generator=gen).tolist()
        i, residual = kseq(draws, p, q, gen)
        x = draws[i] if i is not None else int(torch.multinomial(residual, 1, generator=gen))
        obs[(x,)] += 1
    pval, dof = chi_square_p(obs, {(x,): float(p[x]) for x in range(5)}, n)
    assert dof >= 3 and pval > 1e-3, pval


@pytest.mark.stat  # a chi-square test over many decodes
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_spectr_k4_samples_the_target_distribution(setting):
    s0 = SETTINGS[setting]
    target = tiny_vocab(0)
    dec = build_decoder("spectr", CachedModel(target, forward_impl="lean"), None,
                        CachedModel(tiny_vocab(1), name="draft", forward_impl="lean"), k=4, gamma=2)
    obs: Counter = Counter()
    drafted = accepted = 0
    for i in range(N):
        s = SamplingConfig(temperature=s0.temperature, top_k=s0.top_k, top_p=s0.top_p, seed=2000 + i)
        res = dec.generate(PROMPT, 3, Stopper(), s)
        obs[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.drafted, accepted + res.draft_accepted
    p, dof = chi_square_p(obs, exact_joint(target, s0), N)
    assert dof >= 8 and p > 1e-3, (setting, p)
    assert 0 < accepted < drafted


@pytest.mark.slow  # many decodes per k
def test_more_draft_sequences_accept_more():
    """k i.i.d. drafts accept at least as much as one on average (SpecTr's point), on the tiny-vocabulary pair."""
    target = CachedModel(tiny_vocab(0), forward_impl="lean")
    rates = {}
    for k in (1, 4):
        dec = build_decoder("spectr", target, None, CachedModel(tiny_vocab(1), name="draft", forward_impl="lean"), k=k,
                            gamma=3)
        acc = drafted = 0
        for i in range(150):
            res = dec.generate(PROMPT, 8, Stopper(), SamplingConfig(temperature=1.0, seed=i))
            acc, drafted = acc + res.draft_accepted, drafted + res.drafted
        rates[k] = acc / drafted
    assert rates[4] > rates[1], rates


def test_bad_k_is_named():
    with pytest.raises(ConfigError, match=r"method.k=0 is out of range: it must be an integer in \[1, 64\]"):
        build_decoder("spectr", CachedModel(tiny_vocab(0)), None, CachedModel(tiny_vocab(1)), k=0)
