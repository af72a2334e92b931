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
from pardec.decoding.tree import Tree, TreeBuffers, device_buffers
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


def verify_trees(buf: TreeBuffers, labels: torch.Tensor, logits: torch.Tensor, s: SamplingConfig,
                 gen: torch.Generator | None) -> list[tuple[list[int], list[int]]]:
    """A tree per row, its nodes' tokens ``labels`` [n, N] (the root's unused) and deterministic children (top-k
    candidates: no ``q``), verified against ``logits`` [n, N, V] as :func:`pardec.decoding.verify.verify_tree`
    verifies one: greedy, the deepest path whose every token is the target's argmax; sampled, each node's children
    tried in order, child ``x_j`` accepted with ``p(x_j) / (1 - p(x_1) - ... - p(x_{j-1}))``, then a token from
    ``p`` without the rejected children at the path's end. ``buf``: one shape for every row (:meth:`Tree.on`'s
    buffers) or one per row (:func:`~pardec.decoding.tree.device_buffers`: a leading row dimension, the trees of
    one size). One host read for every row. Returns per row (the accepted path's nodes, root first; the committed
    tokens)."""
    n, size = labels.shape
    dev = logits.device
    labels = to_device(labels, dev)
    if buf.parent.dim() == 1:  # one shape: every buffer seen per row
        buf = buf.map(lambda t: t[None].expand(n, *t.shape))
    rows = torch.arange(n, device=dev)
    by_row = rows[:, None]
    if s.greedy:
        pred = logits.argmax(-1)  # [n, N]
        ok = labels == pred.gather(1, buf.parent)
    else:
        probs = warp(logits, s)  # [n, N, V]
        n_inner, width = buf.kids.shape[1:]
        inner = probs[by_row, buf.inner]  # [n, I, V]
        x = labels.clamp(min=0).gather(1, buf.kids.reshape(n, -1)).reshape(n, n_inner, width)  # [n, I, C]
        px = inner.gather(2, x) * buf.kid_ok  # p(x_j) (padding: token 0, masked by kid_ok)
        left = inner.sum(-1)[..., None] - (px.cumsum(2) - px)  # the mass not yet rejected
        acc = buf.kid_ok & (torch.rand(px.shape, generator=gen, device=dev) * left < px)
        first = acc & (acc.long().cumsum(2) == 1)  # each node's first accepted child
        ok = first[by_row, buf.slot[..., 0], buf.slot[..., 1]] if n_inner else torch.zeros_like(labels, dtype=torch.bool)
    ok[:, :1] = True  # the root (a fill kernel: an int index would upload a host scalar, a sync on CUDA)
    on_path = ~(buf.attend & ~ok[:, None, :]).any(-1)  # [n, N] the node and all its ancestors passed
    end = torch.where(on_path, buf.depth, -1).argmax(1)  # [n] the deepest such node
    mask = buf.attend[rows, end]  # [n, N] the path to it
    if s.greedy:
        token = pred[rows, end]
    else:
        p_end = probs[rows, end]  # [n, V]
        r_end = buf.row[rows, end]  # [n] its row among the inner nodes (-1: a leaf)
        if n_inner:
            at = r_end.clamp(min=0)
            rejected = buf.kid_ok[rows, at] & (r_end >= 0)[:, None]  # [n, C] its children, all rejected
            keep = torch.ones_like(p_end).scatter_reduce(1, x[rows, at], (~rejected).to(p_end.dtype), reduce="amin")
            p_end = _normalised(p_end * keep, p_end)
        token = sample(p_end, gen)[:, 0]
    got = torch.cat([mask.long(), token[:, None], labels], 1).tolist()
    out = []
    for g in got:
        path = [i for i in range(size) if g[i]]
        out.append((path, [g[size + 1 + i] for i in path[1:]] + [g[size]]))
    return out


def padded_trees(trees: list[Tree], device: torch.device, max_depth: int) -> tuple[TreeBuffers, torch.Tensor]:
    """One tree per row, of different sizes, as trees of the largest size: each tree's nodes first (their indices
    unchanged), then padding nodes under the root that see only it and themselves and carry label -1 (never
    accepted: no token equals it). Returns the per-row buffers (:func:`~pardec.decoding.tree.device_buffers`, made
    from one upload) and the labels [n, N] (-1 at the root and the padding; a forward feeds 0 there)."""
    size = max(map(len, trees))
    parent, depth, rank, labels = [], [], [], []
    for t in trees:
        kids = t.children
        pad = size - len(t)
        parent.append([0] + t.parents[1:] + [0] * pad)
        depth.append(t.depth.tolist() + [1] * pad)
        rank.append([0] + [kids[p].index(i) for i, p in enumerate(t.parents) if i]
                    + list(range(len(kids[0]), len(kids[0]) + pad)))
        labels.append([-1] + [int(x) for x in t.labels[1:]] + [-1] * pad)
    width = max(max(r) for r in rank) + 1
    parent_t, depth_t, rank_t, labels_t = to_device(torch.tensor([parent, depth, rank, labels], dtype=torch.long),
                                                    device).unbind(0)
    return device_buffers(parent_t, depth_t, rank_t, width, max(max_depth, 1)), labels_t
