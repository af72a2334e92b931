"""CLLM losses as pure functions of logits, labels and masks (CLLM paper, Eqs. 4-6).

* consistency (Eqs. 4 and 5): a distance between the *target* distribution (the model's own logits on the
  fixed point, global, or on the next Jacobi state, local; always stop-gradient) and the *student*
  distribution (the model's logits on a Jacobi state), per block position;
* AR (Eq. 6): next-token negative log-likelihood of the teacher's answer (prompt positions masked);
* total = consistency + ``ar_weight`` * AR.

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

import torch
import torch.nn.functional as F

DISTANCES = ("fkl", "rkl", "jsd")
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


def ar_token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token NLL: logits [B, T, V] at positions 0..T-1 predict labels [B, T] at 1..T.

    Returns (nll [B, T-1], valid [B, T-1] bool); labels equal to -100 (prompt, padding) are not valid.
    """
    shift_labels = labels[:, 1:].to(logits.device)
    valid = shift_labels != IGNORE_INDEX
    logp = F.log_softmax(logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, shift_labels.clamp(min=0)[..., None])[..., 0]
    return nll.masked_fill(~valid, 0.0), valid


def ar_loss(logits: torch.Tensor, labels: torch.Tensor, num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """AR loss (Eq. 6): mean next-token NLL over label positions (or sum / ``num_items``). Shapes as ar_token_nll."""
    return _normalise(*masked_sum(*ar_token_nll(logits, labels)), num_items)


def total_loss(consistency: torch.Tensor, ar: torch.Tensor, ar_weight: float = 10.0) -> torch.Tensor:
    """CLLM objective: consistency + ``ar_weight`` * AR."""
    return consistency + ar_weight * ar
