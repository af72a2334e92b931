"""Verification rules shared by every draft-and-verify method: one target forward scores a draft shape
(a chain or a :class:`~pardec.decoding.tree.Tree`); these functions decide what is committed.

Exact rules (the output follows the target's warped distribution; greedy = the target's argmax):

* :func:`verify_chain`: a chain ``d_1..d_k``. Greedy: the longest prefix equal to the target's argmax, plus the
  target's next token. Sampling, with the draft's distributions ``q`` (speculative sampling, Leviathan et al. /
  Chen et al.): accept ``d_i`` with probability ``min(1, p(d_i) / q(d_i))``; on the first rejection sample from
  ``norm(max(0, p - q))``; if all are accepted sample a bonus token from ``p``. Without ``q`` the draft is
  deterministic (a one-hot proposal: accept with ``p(d_i)``, else sample from ``p`` without ``d_i``).
* :func:`verify_tree`: a tree. Greedy: the longest root-to-node path whose every token is the target's argmax
  (unique, since siblings carry distinct tokens). Sampling: recursive rejection over siblings: at a node the
  children are tried in order; child ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, on
  rejection ``p_{j+1} = norm(max(0, p_j - q_j))`` and ``q_{j+1} = norm(q_j without x_j)``; the first accepted
  child is descended into, and when every child is rejected the token is sampled from the last ``p_j``. This is
  exact when the children of a node were drawn from ``q`` *without replacement* (a chain is the one-child case);
  with no ``q`` for a node its children are deterministic candidates (one-hot proposals: ``p_{j+1}`` is ``p_j``
  without ``x_j``), e.g. n-gram or top-k candidates.

* :func:`verify_tree_iid`: a tree built from ``k`` draft sequences drawn i.i.d. from ``q`` (SpecTr, Sun et al.
  2023). Sampling: at each node the ``m`` draws of the sequences through it (repeats included, in draw order) go
  through :func:`kseq` (the paper's k-sequential draft selection): draw ``X_i`` is accepted with probability
  ``min(1, p(X_i) / (g q(X_i)))``; when all are rejected the token comes from the residual
  ``norm(p - min(q, p / g) * sum_{i<m} (1 - beta)^i)`` with ``beta = sum_x min(q(x), p(x) / g)``, which makes the
  output exactly ``p`` for any ``g`` in ``[1, m]`` with ``g >= sum_{i<m} (1 - beta(g))^i``; the smallest such ``g``
  (found by bisection) accepts most. ``m = 1`` is speculative sampling. Greedy: as :func:`verify_tree`.

Lossy rules of particular papers (typical acceptance, joint-likelihood thresholds, BiLD rollback) live with
their methods and declare ``exactness = "approximate"``.

``p`` is always :func:`~pardec.decoding.sampling.warp` of the target's logits with the run's sampling settings,
and ``q`` must be the warped draft distribution the draft tokens were actually sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pardec.config import SamplingConfig
from pardec.decoding.sampling import warp
from pardec.decoding.tree import Tree

_EPS = 1e-12


def _sample(p: torch.Tensor, gen: torch.Generator | None) -> int:
    return int(torch.multinomial(p / p.sum(), 1, generator=gen))


def _uniform(gen: torch.Generator | None, device: torch.device) -> float:
    return float(torch.rand((), generator=gen, device=device))


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: int) -> torch.Tensor:
    """The target distribution left after rejecting ``x`` proposed from ``q`` (one-hot when ``q`` is None)."""
    if q is None:
        r = p.clone()
        r[x] = 0.0
    else:
        r = (p - q).clamp(min=0.0)
    s = r.sum()
    # s == 0 needs p <= q everywhere, i.e. p == q, under which a rejection has probability 0
    return r / s if s > _EPS else p


def verify_chain(
    draft: torch.Tensor | list[int],
    logits: torch.Tensor,
    s: SamplingConfig,
    gen: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> list[int]:
    """Verify a chain draft against the target's logits; return the committed tokens (1..k+1 of them).

    draft:  [k] drafted tokens d_1..d_k
    logits: [k+1, V] target logits; row i is the target's distribution for the position of d_{i+1}
            (row k: the bonus position)
    q:      [k, V] the draft's (warped) distributions the tokens were sampled from; None = deterministic draft
    """
    draft = torch.as_tensor(draft, dtype=torch.long).reshape(-1)
    k = draft.numel()
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify_chain: {k} draft tokens need {k + 1} logit rows, got {logits.shape[0]}")
    if s.greedy:
        pred = logits.argmax(-1).cpu()
        mism = (pred[:k] != draft.cpu()).nonzero()
        a = int(mism[0]) if mism.numel() else k
        return pred[: a + 1].tolist()
    probs = warp(logits, s)
    out: list[int] = []
    for i in range(k):
        d, p = int(draft[i]), probs[i]
        qi = None if q is None else q[i].to(p.device, p.dtype)
        if qi is None:
            ok = _uniform(gen, p.device) < float(p[d])
        else:
            ok = _uniform(gen, p.device) * float(qi[d]) < float(p[d])
        if ok:
            out.append(d)
            continue
        out.append(_sample(_residual(p, qi, d), gen))
        return out
    out.append(_sample(probs[k], gen))
    return out


@dataclass
class TreeVerdict:
    path: list[int]  # accepted node indices, root (0) first: what the cache keeps
    tokens: list[int]  # committed tokens: the accepted nodes' labels + one token from the target


def verify_tree(
    tree: Tree,
    logits: torch.Tensor,
    s: SamplingConfig,
    gen: torch.Generator | None,
    q: dict[int, torch.Tensor] | None = None,
) -> TreeVerdict:
    """Verify a tree of drafted tokens against the target's logits [N, V] (row i: after node i).

    q: node -> the (warped) draft distribution [V] its children were drawn from, without replacement; nodes
       not in ``q`` have deterministic children.
    """
    if logits.shape[0] != len(tree):
        raise ValueError(f"verify_tree: a tree of {len(tree)} nodes needs {len(tree)} logit rows, "
                         f"got {logits.shape[0]}")
    path = [0]
    if s.greedy:
        pred = logits.argmax(-1).tolist()
        while True:
            nxt = next((c for c in tree.children[path[-1]] if tree.labels[c] == pred[path[-1]]), None)
            if nxt is None:
                return TreeVerdict(path, [tree.labels[n] for n in path[1:]] + [pred[path[-1]]])
            path.append(nxt)
    probs = warp(logits, s)
    while True:
        node = path[-1]
        p = probs[node]
        qn = None if q is None or node not in q else q[node].to(p.device, p.dtype).clone()
        nxt = None
        for c in tree.children[node]:
            x = tree.labels[c]
            if qn is None:
                ok = _uniform(gen, p.device) < float(p[x])
            else:
                ok = _uniform(gen, p.device) * float(qn[x]) < float(p[x])
            if ok:
                nxt = c
                break
            p = _residual(p, qn, x)
            if qn is not None:  # the next sibling was drawn from q without x
                qn[x] = 0.0
                qn = qn / qn.sum() if qn.sum() > _EPS else qn
        if nxt is None:
            return TreeVerdict(path, [tree.labels[n] for n in path[1:]] + [_sample(p, gen)])
        path.append(nxt)


def _kseq_factor(p: torch.Tensor, q: torch.Tensor, g: float, m: int) -> tuple[float, float]:
    """(beta(g), sum_{i<m} (1 - beta)^i) of K-SEQ with division factor ``g`` and ``m`` draws."""
    beta = float(torch.minimum(q, p / g).sum())
    return beta, sum((1.0 - beta) ** i for i in range(m))


def kseq_factor(p: torch.Tensor, q: torch.Tensor, m: int, iters: int = 40) -> float:
    """The smallest division factor ``g`` in ``[1, m]`` with ``g >= sum_{i<m} (1 - beta(g))^i`` (K-SEQ stays exact
    for every such ``g``; the smallest accepts most). ``g - sum`` increases with ``g``: bisection, returning the
    upper end so the condition holds."""
    lo, hi = 1.0, float(m)
    if _kseq_factor(p, q, lo, m)[1] <= lo + 1e-6:  # beta(1) = 1 - (rounding): q == p, every draw is accepted
        return lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if _kseq_factor(p, q, mid, m)[1] <= mid:
            hi = mid
        else:
            lo = mid
    return hi


def kseq(draws: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator | None
         ) -> tuple[int | None, torch.Tensor]:
    """K-SEQ selection among ``draws`` (i.i.d. samples from ``q``, in draw order) for target ``p``.

    Returns (index of the accepted draw, None) or (None, the residual distribution to sample from)."""
    m = len(draws)
    g = kseq_factor(p, q, m)
    for i, x in enumerate(draws):
        if _uniform(gen, p.device) * g * float(q[x]) < float(p[x]):
            return i, None
    return None, kseq_residual(p, q, g, m)


def kseq_residual(p: torch.Tensor, q: torch.Tensor, g: float, m: int) -> torch.Tensor:
    """K-SEQ's distribution after ``m`` rejected draws: ``norm(p - min(q, p / g) * sum_{i<m} (1 - beta)^i)``."""
    _, total = _kseq_factor(p, q, g, m)
    r = (p - torch.minimum(q, p / g) * total).clamp(min=0.0)
    s = r.sum()
    # s == 0 means every draw is accepted with probability 1: the residual is never used
    return r / s if s > _EPS else p


def verify_tree_iid(
    tree: Tree,
    logits: torch.Tensor,
    s: SamplingConfig,
    gen: torch.Generator | None,
    q: dict[int, torch.Tensor],
    draws: dict[int, list[int]],
) -> TreeVerdict:
    """Verify a tree of i.i.d. draft sequences (see the module doc): ``q[node]`` is the warped draft distribution
    the sequences through ``node`` drew their next token from and ``draws[node]`` those tokens, one per sequence,
    in draw order (a leaf has none). Greedy decoding ignores both (:func:`verify_tree`)."""
    if s.greedy:
        return verify_tree(tree, logits, s, gen)
    if logits.shape[0] != len(tree):
        raise ValueError(f"verify_tree_iid: a tree of {len(tree)} nodes needs {len(tree)} logit rows, "
                         f"got {logits.shape[0]}")
    probs = warp(logits, s)
    path = [0]
    while True:
        node = path[-1]
        p = probs[node]
        drawn = draws.get(node) or []
        if not drawn:
            return TreeVerdict(path, [tree.labels[n] for n in path[1:]] + [_sample(p, gen)])
        i, residual = kseq(drawn, p, q[node].to(p.device, p.dtype), gen)
        if i is None:
            return TreeVerdict(path, [tree.labels[n] for n in path[1:]] + [_sample(residual, gen)])
        path.append(next(c for c in tree.children[node] if tree.labels[c] == drawn[i]))
