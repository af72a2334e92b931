"""Shared token-selection primitives: logit warping, greedy/sampled choice (verification: ``verify.py``).

Every decoder imports these; none re-implements them.
"""

from __future__ import annotations

import torch

from pardec.config import SamplingConfig


def warp(logits: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
    """Temperature, top-k, then top-p on logits [..., V]; returns probabilities (float32)."""
    logits = logits.float() / max(s.temperature, 1e-8)
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the mass strictly before it already reaches top_p (the top token always stays)
        drop_sorted = (sorted_p.cumsum(-1) - sorted_p) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def select(logits: torch.Tensor, s: SamplingConfig, gen: torch.Generator | None) -> torch.Tensor:
    """Next token(s) from logits [..., V]: argmax when greedy, else a seeded sample. Returns [...] long."""
    if s.greedy:
        return logits.argmax(-1)
    probs = warp(logits, s)
    return sample(probs, gen)[..., 0]


def sample(probs: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    """One draw from each row of ``probs`` [..., V] (non-negative, normalised or not): [..., 1] long, on their device.

    Inverse transform: one uniform per row against the row's cumulative sums in float64 (rounding shifts a
    token's probability by at most ~V x 1e-16 of the row's mass, and never onto a zero-probability token: its
    cumulative sum equals its predecessor's). No host read (no sync on a GPU), and one random number per draw:
    the exponential race that ``torch.multinomial`` runs needs one per vocabulary entry, ~1 ms a draw at 49k
    tokens on a CPU core."""
    return sample_at(probs, torch.rand(probs.shape[:-1] + (1,), generator=gen, dtype=torch.float64,
                                       device=probs.device))


def sample_at(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample`'s draw from each row of ``probs`` [..., V] at given uniforms ``u`` [..., 1] (float64 in
    [0, 1)): [..., 1] long. Rows that must draw as another decoder's rows draw (the same uniforms) use it."""
    cum = probs.double().cumsum(-1)
    return torch.searchsorted(cum, u * cum[..., -1:], right=True).clamp_(max=probs.shape[-1] - 1)


def sample_without_replacement(weights: torch.Tensor, n: int, gen: torch.Generator | None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` draws without replacement from each row of ``weights`` [..., V] (non-negative), in draw order: (indices
    [..., n], which of them are real draws [..., n] bool), on their device. ``torch.multinomial(weights, n,
    replacement=False)``'s own exponential race (the same use of the generator, the same draws), without its validity
    checks, and without the host read it needs to know how many weights are positive: when fewer than ``n`` are, the
    rest of the indices are zero-weight entries, flagged False, for the caller to drop after its own read."""
    race = torch.empty_like(weights).exponential_(generator=gen)
    drawn = torch.topk(weights / race, min(n, weights.shape[-1]), dim=-1).indices
    return drawn, weights.gather(-1, drawn) > 0


def make_generator(s: SamplingConfig, device: torch.device) -> torch.Generator | None:
    if s.greedy:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(s.seed)
    return g
