"""Training losses as pure functions of logits, labels and masks: CLLM (paper Eqs. 4-6) and SDSAT (Eq. 9).

CLLM:

* consistency (Eqs. 4 and 5): a distance between the *target* distribution (the model's own logits on the
  fixed point, global, or on the next Jacobi state, local; always stop-gradient) and the *student*
  distribution (the model's logits on a Jacobi state), per block position;
* AR (Eq. 6): next-token negative log-likelihood of the teacher's answer (prompt positions masked), label-smoothed
  as the official trainer does (``label_smoothing`` epsilon: ``(1 - eps) * NLL + eps * mean_v(-log q_v)``,
  transformers' ``LabelSmoother``; ``cllm/cllm_trainer_global.py``: ``LabelSmoother(epsilon=0.1)``);
* total = consistency + ``ar_weight`` * AR.

SDSAT (paper Eq. 9, :func:`sdsat_loss`): ``0.5 * (f_plain + w * f_masked)``, next-token cross-entropies of the
plain rows (ordinary tokens) and of the adaptive-token positions of the masked rows.

Distances, per position, with ``p`` = target and ``q`` = student (trl's ``generalized_jsd_loss`` convention):

* ``fkl``: KL(p || q) (the CLLM repo minimises the soft cross-entropy -sum p log q = KL(p||q) + H(p): same gradient);
* ``rkl``: KL(q || p);
* ``jsd``: generalised JSD with mixture m = beta p + (1 - beta) q: beta KL(p || m) + (1 - beta) KL(q || m);
  beta = 0 is fkl and beta = 1 is rkl (as in trl).

Every loss is a sum over the valid positions divided by a normaliser: by default their count (mean over valid
tokens), or a fixed ``num_items`` (the count over a whole gradient-accumulation window, so that micro-batches
sum to exactly the loss of one big batch).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

DISTANCES = ("fkl", "rkl", "jsd", "tvd")  # tvd: total variation 0.5 * sum |p - q| (DistillSpec)
IGNORE_INDEX = -100


def token_divergence(
    student_logits: torch.Tensor, target_logits: torch.Tensor, distance: str = "fkl", beta: float = 0.5
) -> torch.Tensor:
    """Per-position divergence [...] between logits [..., V]; no gradient flows into ``target_logits``."""
    if distance not in DISTANCES:
        raise ValueError(f"distance={distance!r} is not valid; choose one of: {', '.join(DISTANCES)}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"jsd beta={beta!r} is out of range: it must be in [0, 1]")
    logq = F.log_softmax(student_logits.float(), dim=-1)
    logp = F.log_softmax(target_logits.detach().float(), dim=-1)
    if distance == "jsd" and beta == 0.0:
        distance = "fkl"
    if distance == "jsd" and beta == 1.0:
        distance = "rkl"
    if distance == "tvd":
        return 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    if distance == "fkl":
        return _kl(logp, logq)
    if distance == "rkl":
        return _kl(logq, logp)
    logm = torch.logsumexp(torch.stack([logp + math.log(beta), logq + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(logp, logm) + (1.0 - beta) * _kl(logq, logm)


def _kl(loga: torch.Tensor, logb: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim, from log-probabilities [..., V] -> [...]."""
    return F.kl_div(logb, loga, reduction="none", log_target=True).sum(-1)


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of ``values`` where ``mask``, number of such positions); both 0-dim tensors."""
    mask = mask.to(values.device, torch.bool)
    return values.masked_fill(~mask, 0.0).sum(), mask.sum()


def _normalise(total: torch.Tensor, count: torch.Tensor, num_items: torch.Tensor | int | None) -> torch.Tensor:
    denom = count if num_items is None else torch.as_tensor(num_items, device=total.device)
    return total / denom.clamp(min=1).to(total.dtype)


def consistency_loss(
    student_logits: torch.Tensor,
    target_logits: torch.Tensor,
    mask: torch.Tensor,
    distance: str = "fkl",
    beta: float = 0.5,
    num_items: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Consistency loss (Eq. 4 global / Eq. 5 local).

    student_logits: [B, T, V] logits on the Jacobi state (gradient flows);
    target_logits:  [B, T, V] logits on the fixed point (global) or the next state (local); detached here;
    mask:           [B, T] bool, True at block positions that count (not padding, not past EOS).
    Returns the masked sum divided by ``num_items`` (default: the mask's count); 0 when nothing is valid.
    """
    per_token = token_divergence(student_logits, target_logits, distance, beta)
    return _normalise(*masked_sum(per_token, mask), num_items)


def ar_token_nll(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float = 0.0,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token NLL: logits [B, T, V] at positions 0..T-1 predict labels [B, T] at 1..T (label-smoothed by
    ``label_smoothing``: module docstring).

    Returns (nll [B, T-1], valid [B, T-1] bool); labels equal to -100 (prompt, padding) are not valid.
    """
    shift_labels = labels[:, 1:].to(logits.device)
    valid = shift_labels != IGNORE_INDEX
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, shift_labels.clamp(min=0)[..., None])[..., 0]
    if label_smoothing:
        nll = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    return nll.masked_fill(~valid, 0.0), valid


def ar_loss(logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor | int | None = None,
            label_smoothing: float = 0.0) -> torch.Tensor:
    """AR loss (Eq. 6): mean next-token NLL over label positions (or sum / ``num_items``). Shapes as ar_token_nll."""
    return _normalise(*masked_sum(*ar_token_nll(logits, labels, label_smoothing)), num_items)


def total_loss(consistency: torch.Tensor, ar: torch.Tensor, ar_weight: float = 10.0) -> torch.Tensor:
    """CLLM objective: consistency + ``ar_weight`` * AR."""
    return consistency + ar_weight * ar


# ------------------------------------------------------------------------------------------- SDSAT (Eq. 9)
class SDSATLoss(NamedTuple):
    total: torch.Tensor  # 0.5 * (plain + w * masked): what is minimised
    plain: torch.Tensor  # f_plain: CE over the plain rows' label positions (sum / normaliser)
    masked: torch.Tensor  # f_masked: CE over the masked rows' adaptive-token positions (sum / normaliser)
    sums: torch.Tensor  # [4] detached float64: plain CE sum, plain count, masked CE sum, masked count


def ce_sum(logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, label_smoothing: float = 0.0,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed CE of ``logits`` [R, T, V] against ``targets`` [R, T] where ``mask`` [R, T], count): only the
    selected positions go through the log-softmax (``label_smoothing``: as :func:`ar_token_nll`'s)."""
    mask = mask.to(logits.device, torch.bool)
    picked = logits[mask].float()  # [N, V]
    if not picked.numel():  # nothing counts: 0, still attached to the graph (one finite logit times 0)
        return logits.flatten()[:1].float().sum() * 0.0, mask.sum()
    ce = F.cross_entropy(picked, targets.to(logits.device)[mask], reduction="sum", label_smoothing=label_smoothing)
    return ce.float(), mask.sum()


def sdsat_loss(
    logits: torch.Tensor,
    targets: torch.Tensor,
    plain_mask: torch.Tensor,
    masked_mask: torch.Tensor,
    w: float = 1.0,
    num_items: torch.Tensor | None = None,
) -> SDSATLoss:
    """SDSAT's improved loss (paper Eq. 9): ``0.5 * (f_plain + w * f_masked)``.

    logits:      [2B, T, V]: rows ``0..B-1`` are the plain sequences, rows ``B..2B-1`` the masked versions of the
                 same records (the same row order);
    targets:     [B, T]: the token position ``t`` predicts, ``ids[t + 1]`` of the plain sequence (shared by both
                 rows of a record: a masked position is trained to predict the plain next token);
    plain_mask:  [B, T] bool: the plain rows' label positions (``t + 1 >= start``, not padding);
    masked_mask: [B, T] bool: the masked rows' positions whose input is an adaptive token.
    ``num_items``: [2] (plain count, masked count) over the whole gradient-accumulation window (default: this
    batch's counts), so micro-batches sum to the loss of one big batch.

    Ordinary positions of the masked rows count for nothing (the ordinary-token loss comes from the plain rows
    only), and the masked rows never reach ``f_plain``. An empty set gives a 0 term, never NaN.
    """
    bsz = targets.shape[0]
    if logits.shape[0] != 2 * bsz:
        raise ValueError(f"sdsat_loss: logits have {logits.shape[0]} rows; expected 2 x {bsz} (plain + masked)")
    p_sum, p_cnt = ce_sum(logits[:bsz], targets, plain_mask)
    m_sum, m_cnt = ce_sum(logits[bsz:], targets, masked_mask)
    counts = torch.stack([p_cnt, m_cnt]) if num_items is None else torch.as_tensor(num_items)
    norm = counts.to(p_sum.device).clamp(min=1).to(p_sum.dtype)
    plain, masked = p_sum / norm[0], m_sum / norm[1]
    sums = torch.stack([p_sum.detach(), p_cnt.to(p_sum), m_sum.detach(), m_cnt.to(p_sum)]).double().cpu()
    return SDSATLoss(0.5 * (plain + w * masked), plain, masked, sums)
