"""Losses (CLLM, SDSAT Eq. 9): zeros, hand-computed values, masks, stop-gradient, normalisation under accumulation."""

from __future__ import annotations

import math

import pytest
import torch

from pardec.training.losses import ar_loss, consistency_loss, sdsat_loss, token_divergence, total_loss

# target p = (1/2, 1/2), student q = (3/4, 1/4)
P, Q = (0.5, 0.5), (0.75, 0.25)


def _kl(a, b) -> float:
    return sum(x * math.log(x / y) for x, y in zip(a, b))


M = tuple(0.5 * x + 0.5 * y for x, y in zip(P, Q))
EXPECTED = {"fkl": _kl(P, Q), "rkl": _kl(Q, P), "jsd": 0.5 * _kl(P, M) + 0.5 * _kl(Q, M), "tvd": 0.25}


def _logits(probs) -> torch.Tensor:
    return torch.tensor(probs).log()[None, None]  # [1, 1, 2]


@pytest.mark.parametrize("distance", ["fkl", "rkl", "jsd", "tvd"])
def test_known_values_on_two_token_vocab(distance):
    got = token_divergence(_logits(Q), _logits(P), distance, beta=0.5)
    assert got.shape == (1, 1)
    assert got.item() == pytest.approx(EXPECTED[distance], rel=1e-5)
    assert EXPECTED["fkl"] == pytest.approx(0.5 * math.log(4 / 3))  # the hand computation itself


def test_jsd_endpoints_are_the_kls():
    s, t = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    torch.testing.assert_close(token_divergence(s, t, "jsd", 0.0), token_divergence(s, t, "fkl"))
    torch.testing.assert_close(token_divergence(s, t, "jsd", 1.0), token_divergence(s, t, "rkl"))


@pytest.mark.parametrize("distance", ["fkl", "rkl", "jsd", "tvd"])
def test_zero_for_identical_logits(distance):
    x = torch.randn(3, 4, 11)
    mask = torch.ones(3, 4, dtype=torch.bool)
    assert consistency_loss(x, x.clone(), mask, distance).item() == pytest.approx(0.0, abs=1e-6)


def test_masked_positions_do_not_count():
    s, t = torch.randn(2, 3, 5), torch.randn(2, 3, 5)
    mask = torch.tensor([[True, False, True], [False, False, True]])
    base = consistency_loss(s, t, mask)
    s2 = s.clone()
    s2[~mask] += 100 * torch.randn_like(s2[~mask])
    torch.testing.assert_close(consistency_loss(s2, t, mask), base)
    per_tok = token_divergence(s, t)
    torch.testing.assert_close(base, per_tok[mask].mean())
    assert consistency_loss(s, t, torch.zeros(2, 3, dtype=torch.bool)).item() == 0.0


def test_no_gradient_through_the_target():
    s = torch.randn(2, 3, 5, requires_grad=True)
    t = torch.randn(2, 3, 5, requires_grad=True)
    for d in ("fkl", "rkl", "jsd"):
        consistency_loss(s, t, torch.ones(2, 3, dtype=torch.bool), d).backward()
    assert s.grad is not None and s.grad.abs().sum() > 0
    assert t.grad is None


def test_ar_loss_known_values_and_prompt_mask():
    third = math.log(3.0)
    logits = torch.tensor([[[0.0, third], [third, 0.0], [5.0, -5.0]]])  # [1, 3, 2]
    # position 0 predicts token 0 (p = 1/4), position 1 predicts token 1 (p = 1/4); the last is unused
    assert ar_loss(logits, torch.tensor([[-100, 0, 1]])).item() == pytest.approx(math.log(4))
    assert ar_loss(logits, torch.tensor([[-100, -100, 0]])).item() == pytest.approx(math.log(4 / 3))
    assert ar_loss(logits, torch.tensor([[-100, -100, -100]])).item() == 0.0


def test_label_smoothed_ar_loss_is_the_official_trainers():
    """CLLM's official trainer smooths its AR loss with transformers' LabelSmoother(epsilon=0.1); pardec's AR loss
    (ar_loss, and ce_sum that the trainer sums) with label_smoothing=0.1 gives the same value."""
    from transformers.trainer_pt_utils import LabelSmoother

    from pardec.training.losses import ce_sum

    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.randint(0, 11, (2, 6))
    labels[0, :2] = -100  # prompt
    want = LabelSmoother(epsilon=0.1)({"logits": logits}, labels, shift_labels=True)
    assert ar_loss(logits, labels, label_smoothing=0.1).item() == pytest.approx(want.item(), rel=1e-5)
    shifted, targets = logits[:, :-1], labels[:, 1:]
    total, n = ce_sum(shifted, targets.clamp(min=0), targets != -100, 0.1)
    assert (total / n).item() == pytest.approx(want.item(), rel=1e-5)
    assert ar_loss(logits, labels).item() != pytest.approx(want.item(), rel=1e-3)  # epsilon 0: the plain NLL


def test_total_is_consistency_plus_weighted_ar():
    assert total_loss(torch.tensor(1.5), torch.tensor(0.25), 10.0).item() == pytest.approx(4.0)


@pytest.mark.parametrize("distance", ["fkl", "jsd"])
def test_micro_batches_with_num_items_equal_one_big_batch(distance):
    torch.manual_seed(0)
    s = torch.randn(4, 5, 9, requires_grad=True)
    t = torch.randn(4, 5, 9)
    mask = torch.rand(4, 5) < 0.6
    labels = torch.randint(9, (4, 5)).masked_fill(torch.rand(4, 5) < 0.4, -100)

    def loss(lo, hi, n_c=None, n_a=None):
        return total_loss(consistency_loss(s[lo:hi], t[lo:hi], mask[lo:hi], distance, num_items=n_c),
                          ar_loss(s[lo:hi], labels[lo:hi], num_items=n_a))

    big = loss(0, 4)
    (g_big,) = torch.autograd.grad(big, s)
    n_c, n_a = mask.sum(), (labels[:, 1:] != -100).sum()
    parts = [loss(0, 1, n_c, n_a), loss(1, 4, n_c, n_a)]
    (g_acc,) = torch.autograd.grad(sum(parts), s)
    torch.testing.assert_close(sum(parts), big)
    torch.testing.assert_close(g_acc, g_big)
    # without the fixed normaliser, the mean of micro-batch means is not the big-batch mean
    naive = (loss(0, 1) + loss(1, 4)) / 2
    assert not torch.allclose(naive, big)


# ------------------------------------------------------------------------------------------- SDSAT (Eq. 9)
def _sdsat_case(seed: int = 0):
    """B = 2 records, T = 4, V = 5: logits [4, 4, 5] (rows 0-1 plain, 2-3 masked), targets, masks."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 4, 5, generator=g)
    targets = torch.tensor([[1, 2, 3, 0], [4, 0, 2, 0]])
    plain = torch.tensor([[True, True, True, False], [False, True, True, False]])  # row 1: prompt / padding out
    masked = torch.tensor([[False, True, False, False], [False, True, True, False]])
    return logits, targets, plain, masked


def _ce(row: torch.Tensor, target: int) -> float:
    return float(-row.log_softmax(-1)[target])


def test_sdsat_loss_matches_a_hand_computation():
    logits, targets, plain, masked = _sdsat_case()
    out = sdsat_loss(logits, targets, plain, masked, w=0.5)
    p_terms = [_ce(logits[b, t], int(targets[b, t])) for b in range(2) for t in range(4) if plain[b, t]]
    m_terms = [_ce(logits[2 + b, t], int(targets[b, t])) for b in range(2) for t in range(4) if masked[b, t]]
    f_p, f_m = sum(p_terms) / 5, sum(m_terms) / 3
    assert out.plain.item() == pytest.approx(f_p, rel=1e-5) and out.masked.item() == pytest.approx(f_m, rel=1e-5)
    assert out.total.item() == pytest.approx(0.5 * (f_p + 0.5 * f_m), rel=1e-5)
    assert out.sums.tolist() == pytest.approx([sum(p_terms), 5, sum(m_terms), 3], rel=1e-5)
    window = sdsat_loss(logits, targets, plain, masked, w=0.5, num_items=torch.tensor([10, 12]))  # a bigger window
    assert window.plain.item() == pytest.approx(sum(p_terms) / 10, rel=1e-5)
    assert window.masked.item() == pytest.approx(sum(m_terms) / 12, rel=1e-5)


def test_sdsat_loss_ignores_what_it_must():
    logits, targets, plain, masked = _sdsat_case()
    out = sdsat_loss(logits, targets, plain, masked)
    ordinary = logits.clone()  # masked rows, ordinary (non-adaptive) positions: no effect on the loss at all
    ordinary[2:][~masked] = torch.randn(int((~masked).sum()), 5) * 10
    again = sdsat_loss(ordinary, targets, plain, masked)
    torch.testing.assert_close(again.total, out.total)
    anything = logits.clone()  # masked rows changed anywhere: f_plain stays, f_masked moves
    anything[2:] = torch.randn(2, 4, 5) * 10
    moved = sdsat_loss(anything, targets, plain, masked)
    torch.testing.assert_close(moved.plain, out.plain)
    assert abs(moved.masked.item() - out.masked.item()) > 1e-3
    leaf = logits.clone().requires_grad_(True)  # gradients reach exactly the counted positions
    sdsat_loss(leaf, targets, plain, masked).total.backward()
    touched = leaf.grad.abs().sum(-1) > 0
    assert torch.equal(touched, torch.cat([plain, masked]))


def test_sdsat_loss_without_masked_positions_is_half_the_plain_loss():
    logits, targets, plain, _ = _sdsat_case()
    out = sdsat_loss(logits.requires_grad_(True), targets, plain, torch.zeros_like(plain))
    assert out.masked.item() == 0.0 and math.isfinite(out.total.item())
    assert out.total.item() == pytest.approx(0.5 * out.plain.item())
    out.total.backward()
    assert torch.isfinite(logits.grad).all()
    nothing = sdsat_loss(logits, targets, torch.zeros_like(plain), torch.zeros_like(plain))
    assert nothing.total.item() == 0.0 and nothing.total.requires_grad  # still backward-able
    with pytest.raises(ValueError, match="expected 2 x 2"):
        sdsat_loss(logits[:3], targets, plain, plain)
