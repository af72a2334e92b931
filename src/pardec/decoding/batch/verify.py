"""Verification of a batch of chains in one target forward and one host read: row ``b``'s draft is
``draft[b, :ks[b]]`` (the rest of the row is padding), checked against its logits ``[b, :ks[b] + 1]`` exactly as
:func:`pardec.decoding.verify.verify_chain_reading` checks one chain (greedy: the longest prefix the target's argmax
agrees with, then its next token; sampled: Leviathan et al.'s rule against ``q`` or, without ``q``, a deterministic
draft's, then a token from the residual), so each row's output follows the target's distribution whatever its
neighbours."""

from __future__ import annotations

import torch

from pardec.config import SamplingConfig
from pardec.decoding.sampling import sample, warp
from pardec.decoding.verify import _normalised
from pardec.models.cache import to_device


def verify_rows(draft: torch.Tensor, ks: list[int], logits: torch.Tensor, s: SamplingConfig,
                gen: torch.Generator | None, q: torch.Tensor | None = None, extra: torch.Tensor | None = None
                ) -> tuple[list[list[int]], list[list[int]]]:
    """(committed tokens per row: accepted draft tokens + one of the target's; ``extra``'s rows). ``draft`` [n, K],
    ``logits`` [n, K+1, V], ``q`` [n, K, V] the draft's distributions (None: a deterministic draft); ``extra``
    [n, X] ids the caller needs on the host too (Jacobi's next guesses), read back in the same host read."""
    n, k = draft.shape
    if logits.shape[:2] != (n, k + 1) or len(ks) != n or any(not 0 <= x <= k for x in ks):
        raise ValueError(f"verify_rows: a draft {tuple(draft.shape)} with lengths {ks} needs logits [{n}, {k + 1}, V]; "
                         f"got {tuple(logits.shape)}")
    dev = logits.device
    draft = to_device(draft, dev)
    more = [] if extra is None else [to_device(extra, dev).long()]
    x = 0 if extra is None else extra.shape[1]
    valid = torch.arange(k, device=dev)[None] < to_device(torch.tensor(ks, dtype=torch.long), dev)[:, None]
    if s.greedy:
        pred = logits.argmax(-1)  # [n, K+1]
        m = ((pred[:, :k] == draft) & valid).long().cumprod(1).sum(1)
        got = torch.cat([m[:, None], pred, *more], 1).tolist()
        return [g[1 : g[0] + 2] for g in got], [g[len(g) - x :] for g in got]
    probs = warp(logits, s)  # [n, K+1, V]
    vocab = probs.shape[-1]
    d = draft.clamp(min=0)
    p_d = probs[:, :k].gather(2, d[..., None])[..., 0]  # [n, K]
    u = torch.rand(n, k, generator=gen, device=dev)
    ok = u < p_d if q is None else u * q.to(dev, probs.dtype).gather(2, d[..., None])[..., 0] < p_d
    m = (ok & valid).long().cumprod(1).sum(1)  # [n] the first rejection, or the row's draft length
    rows = torch.arange(n, device=dev)
    p_n = probs[rows, m]  # [n, V] the target's row there (the bonus row when every draft token was accepted)
    if q is None:  # p without the rejected token (none at the bonus position)
        d_n = torch.cat([torch.where(valid, draft, -1), draft.new_full((n, 1), -1)], 1)[rows, m]
        r = p_n.masked_fill(torch.arange(vocab, device=dev)[None] == d_n[:, None], 0.0)
    else:  # max(0, p - q), q = 0 at the bonus position
        q_ext = torch.cat([q.to(dev, probs.dtype) * valid[..., None], probs.new_zeros(n, 1, vocab)], 1)
        r = (p_n - q_ext[rows, m]).clamp(min=0.0)
    token = sample(_normalised(r, p_n), gen)[:, 0]
    got = torch.cat([m[:, None], draft, token[:, None], *more], 1).tolist()
    return [g[1 : 1 + g[0]] + [g[1 + k]] for g in got], [g[len(g) - x :] for g in got]
