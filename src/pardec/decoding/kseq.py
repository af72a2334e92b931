"""SpecTr's verification (Sun et al. 2023): a tree built from ``k`` draft sequences drawn i.i.d. from ``q``.

:func:`verify_tree_iid`: sampling: at each node the ``m`` draws of the sequences through it (repeats included, in
draw order) go through :func:`kseq` (the paper's k-sequential draft selection): draw ``X_i`` is accepted with
probability ``min(1, p(X_i) / (g q(X_i)))``; when all are rejected the token comes from the residual
``norm(p - min(q, p / g) * sum_{i<m} (1 - beta)^i)`` with ``beta = sum_x min(q(x), p(x) / g)``, which makes the output
exactly ``p`` for any ``g`` in ``[1, m]`` with ``g >= sum_{i<m} (1 - beta(g))^i``; the smallest such ``g``
(:func:`kseq_factors`) accepts most. ``m = 1`` is speculative sampling. Greedy: as
:func:`~pardec.decoding.verify.verify_tree`. The shared rules, their host reads and their notation:
:mod:`pardec.decoding.verify`.
"""

from __future__ import annotations

import torch

from pardec.config import SamplingConfig
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree import Tree
from pardec.decoding.verify import (
    TreeVerdict,
    _accepted_path,
    _check_rows,
    _normalised,
    read_verdict,
    verify_tree,
)


def _geometric(beta: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``sum_{i<m} (1 - beta)^i`` (float64; ``m`` where ``beta`` is 0)."""
    b = beta.clamp(0.0, 1.0)
    safe = torch.where(b > 0, b, torch.ones_like(b))
    return torch.where(b > 0, -torch.expm1(m * torch.log1p(-safe)) / safe, m.to(b.dtype).expand_as(b))


def kseq_factors(p: torch.Tensor, q: torch.Tensor, m: torch.Tensor | int, rounds: int = 4, points: int = 1024
                 ) -> torch.Tensor:
    """K-SEQ's division factor for each row of ``p``, ``q`` [K, V] and draw count ``m`` [K]: the smallest ``g`` in
    ``[1, m]`` with ``g >= sum_{i<m} (1 - beta(g))^i``, ``beta(g) = sum_x min(q(x), p(x) / g)`` (exact output for
    every such ``g``; the smallest accepts most). Returns [K] float64 on the rows' device; no host sync.

    With ``G(g) = g beta(g) = sum_x min(g q(x), p(x))`` the condition reads ``G(g) >= 1 - (1 - beta(g))^m``: the left
    side grows with ``g`` and the right side falls, so the feasible ``g`` form an interval ``[g*, m]``. ``G`` is
    linear between consecutive sorted ratios ``p(x) / q(x)`` (``A + B g``: the tokens whose ratio is below ``g``
    give ``p``, the others ``g q``), so one sort and two cumulative sums evaluate the condition at every ratio
    at once: the first feasible one bounds the piece that holds ``g*``, where ``G`` is known in closed form.
    Inside it ``rounds`` multisections of ``points`` each (scalars per row, no vocabulary work) bracket ``g*``
    to ``points ** -rounds`` of the piece (2^-40 with the defaults) and return the bracket's feasible end.
    ``g = 1`` (plain speculative sampling) when the condition holds there up to 1e-6, as when ``q == p``."""
    p, q = p.double(), q.double()
    rows, vocab = p.shape
    m = torch.as_tensor(m, device=p.device).to(torch.float64).expand(rows)[:, None]  # [K, 1]
    ratio = torch.where(q > 0, p / q.clamp_min(1e-300), torch.full_like(p, float("inf")))
    r, order = ratio.sort(-1)  # ascending
    zero = p.new_zeros(rows, 1)
    a = torch.cat([zero, p.gather(-1, order).cumsum(-1)], -1)  # [K, V+1] A_k: p mass of the k smallest ratios
    b = q.sum(-1, keepdim=True) - torch.cat([zero, q.gather(-1, order).cumsum(-1)], -1)  # B_k: q mass of the rest
    # candidates c_0 = 1, c_k = clamp(r_k, 1, m), c_{V+1} = m; G is A_k + B_k g on [c_k, c_{k+1}]
    cand = torch.cat([torch.ones_like(zero), torch.minimum(r.clamp(min=1.0), m), m], -1)  # [K, V+2]
    a, b = torch.cat([a, a[:, -1:]], -1), torch.cat([b, b[:, -1:]], -1)

    def feasible(g, a_, b_):
        return g >= _geometric((a_ + b_ * g) / g, m)

    ok = feasible(cand, a, b)
    ok[:, 1:-1] = (ok[:, 1:-1] & (r > 1.0)) | (r >= m)  # a ratio below 1 stands for g = 1, one above m for g = m
    ok[:, 0] = _geometric(torch.minimum(p, q).sum(-1, keepdim=True), m)[:, 0] <= 1.0 + 1e-6  # g = 1, tolerance
    ok[:, -1].fill_(True)  # g = m always holds (each term <= 1); rounding must not say otherwise
    first = ok.long().argmax(-1, keepdim=True)  # [K, 1] the first feasible candidate
    piece = (first - 1).clamp(min=0)
    lo, hi = cand.gather(-1, piece), cand.gather(-1, first)
    a, b = a.gather(-1, piece), b.gather(-1, piece)
    steps = torch.arange(1, points + 1, device=p.device, dtype=torch.float64) / points  # [P]
    for _ in range(rounds):
        grid = lo + (hi - lo) * steps  # [K, P], the last one is hi
        good = feasible(grid, a, b)
        good[:, -1].fill_(True)
        f = good.long().argmax(-1, keepdim=True)
        lo = torch.where(f > 0, grid.gather(-1, (f - 1).clamp(min=0)), lo)
        hi = grid.gather(-1, f)
    return torch.where(first == 0, torch.ones_like(hi), hi)[:, 0]


def kseq_residuals(p: torch.Tensor, q: torch.Tensor, g: torch.Tensor, m: torch.Tensor | int) -> torch.Tensor:
    """K-SEQ's distribution after ``m`` rejected draws, per row of ``p``, ``q`` [K, V] with factors ``g`` [K]:
    ``norm(p - min(q, p / g) * sum_{i<m} (1 - beta)^i)`` (``p`` where that is ~0: every draw is then accepted)."""
    pd, qd, g = p.double(), q.double(), g.to(torch.float64)[:, None]
    m = torch.as_tensor(m, device=p.device).to(torch.float64).expand(p.shape[0])[:, None]
    low = torch.minimum(qd, pd / g)
    r = (pd - low * _geometric(low.sum(-1, keepdim=True), m)).clamp(min=0.0)
    return _normalised(r, pd).to(p.dtype)


def _kseq_first(p: torch.Tensor, q: torch.Tensor, draws: torch.Tensor, valid: torch.Tensor, m: torch.Tensor,
                gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """K-SEQ's tests for ``K`` nodes at once: ``draws`` [K, M] (``valid`` False on the padding). Returns (the first
    accepted draw as a [K, M] bool mask, the factors [K])."""
    g = kseq_factors(p, q, m)
    u = torch.rand(draws.shape, generator=gen, device=p.device)
    px, qx = p.gather(1, draws).double(), q.gather(1, draws).double()
    acc = valid & (u.double() * g[:, None] * qx < px)
    return acc & (acc.long().cumsum(1) == 1), g


def kseq(draws: list[int], p: torch.Tensor, q: torch.Tensor, gen: torch.Generator | None
         ) -> tuple[int | None, torch.Tensor | None]:
    """K-SEQ selection among ``draws`` (i.i.d. samples from ``q``, in draw order) for target ``p``, one node (one
    host read; :func:`verify_tree_iid` runs every node of a tree at once).

    Returns (index of the accepted draw, None) or (None, the residual distribution to sample from)."""
    m = len(draws)
    d = torch.tensor([draws], dtype=torch.long, device=p.device)
    first, g = _kseq_first(p[None], q[None], d, torch.ones_like(d, dtype=torch.bool), torch.tensor([m]), gen)
    got = torch.cat([first.any(1).long(), first.long().argmax(1)]).tolist()
    if got[0]:
        return got[1], None
    return None, kseq_residuals(p[None], q[None], g, m)[0]


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
    in draw order (a leaf has none). Greedy decoding ignores both (:func:`verify_tree`).

    One host read: K-SEQ runs at every node with draws at once (their factors, their tests, their residuals)."""
    if s.greedy:
        return verify_tree(tree, logits, s, gen)
    _check_rows("verify_tree_iid", tree, logits)
    dev, n = logits.device, len(tree)
    buf, labels = tree.on(dev), tree.label_tensor(dev)
    probs = warp(logits, s)
    nodes = [i for i in range(n) if draws.get(i)]  # K-SEQ nodes
    ok = torch.zeros(n, dtype=torch.bool, device=dev)
    ok[0].fill_(True)  # (a fill kernel: `ok[0] = True` uploads a host scalar, a sync on CUDA)
    if not nodes:
        end, mask = _accepted_path(buf, ok)
        return read_verdict(tree, mask, sample(probs.index_select(0, end), gen)[0], labels)
    width = max(len(draws[i]) for i in nodes)
    child = {(tree.parents[c], int(tree.labels[c])): c for c in range(1, n)}
    rows = []  # per node: draws, validity, child node of each draw (n: padding), m; packed for one copy
    for i in nodes:
        pad = width - len(draws[i])
        kids = []
        for x in draws[i]:
            if (i, int(x)) not in child:
                raise ValueError(f"verify_tree_iid: draw {x} at node {i} is not one of its children's labels")
            kids.append(child[(i, int(x))])
        rows.append([int(x) for x in draws[i]] + [0] * pad + [1] * len(draws[i]) + [0] * pad + kids + [n] * pad
                    + [len(draws[i]), i])
    krow = [-1] * n
    for r, i in enumerate(nodes):
        krow[i] = r
    packed = torch.tensor([v for row in rows for v in row] + krow, dtype=torch.long).to(dev)
    table = packed[: len(rows) * (3 * width + 2)].reshape(len(rows), 3 * width + 2)
    d, valid, kid = table[:, :width], table[:, width : 2 * width].bool(), table[:, 2 * width : 3 * width]
    m, at = table[:, -2], table[:, -1]
    p = probs.index_select(0, at)  # [K, V]
    qk = torch.stack([q[i] for i in nodes]).to(dev, probs.dtype)
    first, g = _kseq_first(p, qk, d, valid, m, gen)
    hit = torch.zeros(n + 1, dtype=torch.long, device=dev).index_add_(0, kid.reshape(-1), first.reshape(-1).long())
    ok = hit[:n] > 0
    ok[0].fill_(True)  # (a fill kernel: `ok[0] = True` uploads a host scalar, a sync on CUDA)
    end, mask = _accepted_path(buf, ok)
    # the distribution left at the end: the K-SEQ residual of a node whose draws were all rejected, p at a leaf
    pick = packed[len(rows) * (3 * width + 2) :].index_select(0, end) + 1
    dist = torch.cat([probs.index_select(0, end), kseq_residuals(p, qk, g, m)]).index_select(0, pick)
    return read_verdict(tree, mask, sample(dist, gen)[0], labels)
