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

* :func:`~pardec.decoding.kseq.verify_tree_iid`: a tree of i.i.d. draft sequences (SpecTr's K-SEQ), in
  :mod:`pardec.decoding.kseq`.

Lossy rules of particular papers (typical acceptance, joint-likelihood thresholds, BiLD rollback) live with
their methods and declare ``exactness = "approximate"``.

``p`` is always :func:`~pardec.decoding.sampling.warp` of the target's logits with the run's sampling settings,
and ``q`` must be the warped draft distribution the draft tokens were actually sampled from.

Host syncs: each rule reads its result back once (one ``tolist`` per call), greedy or sampled, chain or tree.
Every test of a call is made at once on the device: the uniforms in one draw, the first rejection by a cumulative
product (chains) or, in trees, the acceptance test of every child of every node (siblings in order, as the rule
says; the tests of nodes off the accepted path are drawn and thrown away, which leaves the path's law unchanged),
the accepted path as the deepest node whose ancestors all passed, and the last token sampled on the device from
the distribution left at the path's end. Tokens are drawn with :func:`~pardec.decoding.sampling.sample`
(an inverse transform on the device: no host read, one random number per draw).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pardec.config import SamplingConfig
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree import Tree, TreeBuffers

_EPS = 1e-12


def _normalised(r: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """``r / sum(r)`` per row, or ``fallback`` where the row's mass is ~0 (a rejection of probability 0 led there)."""
    s = r.sum(-1, keepdim=True)
    return torch.where(s > _EPS, r / s.clamp_min(_EPS), fallback)


def verify_chain(
    draft: torch.Tensor | list[int],
    logits: torch.Tensor,
    s: SamplingConfig,
    gen: torch.Generator | None,
    q: torch.Tensor | None = None,
) -> list[int]:
    """Verify a chain draft against the target's logits; return the committed tokens (1..k+1 of them).

    draft:  [k] drafted tokens d_1..d_k (any device; moved to the logits')
    logits: [k+1, V] target logits; row i is the target's distribution for the position of d_{i+1}
            (row k: the bonus position)
    q:      [k, V] the draft's (warped) distributions the tokens were sampled from; None = deterministic draft

    One host read: [accepted count, the draft, the target's token].
    """
    return verify_chain_reading(draft, logits, s, gen, q)[0]


def verify_chain_reading(draft: torch.Tensor | list[int], logits: torch.Tensor, s: SamplingConfig,
                         gen: torch.Generator | None, q: torch.Tensor | None = None,
                         extra: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """:func:`verify_chain`, and ``extra`` (1-D ids the caller needs on the host too, e.g. Jacobi's next guesses)
    read back in the same host read: (committed tokens, ``extra``'s values)."""
    dev = logits.device
    draft = torch.as_tensor(draft, dtype=torch.long).reshape(-1).to(dev)
    k = draft.numel()
    if logits.shape[0] != k + 1:
        raise ValueError(f"verify_chain: {k} draft tokens need {k + 1} logit rows, got {logits.shape[0]}")
    more = [] if extra is None else [extra.reshape(-1).to(dev, torch.long)]
    m = 0 if extra is None else more[0].numel()
    if s.greedy:
        pred = logits.argmax(-1)  # [k+1]
        n = (pred[:k] == draft).long().cumprod(0).sum().view(1)  # the longest matching prefix
        got = torch.cat([n, pred, *more]).tolist()
        return got[1 : got[0] + 2], got[len(got) - m:]
    probs = warp(logits, s)  # [k+1, V]
    vocab = probs.shape[-1]
    p_d = probs[torch.arange(k, device=dev), draft]  # [k] p_i(d_i)
    u = torch.rand(k, generator=gen, device=dev)
    if q is None:
        ok = u < p_d
    else:
        q = q.to(dev, probs.dtype)
        ok = u * q[torch.arange(k, device=dev), draft] < p_d
    n = ok.long().cumprod(0).sum().view(1)  # [1] accepted drafts: the first rejection's index, or k
    p_n = probs.index_select(0, n)  # [1, V] the target's row there (row k: the bonus position)
    if q is None:  # p without the rejected token (none at the bonus position)
        d_n = torch.cat([draft, draft.new_full((1,), -1)]).index_select(0, n)
        r = p_n.masked_fill(torch.arange(vocab, device=dev) == d_n[:, None], 0.0)
    else:  # max(0, p - q) (q = 0 at the bonus position: p)
        r = (p_n - torch.cat([q, q.new_zeros(1, vocab)]).index_select(0, n)).clamp(min=0.0)
    token = sample(_normalised(r, p_n), gen)[0]  # [1]
    got = torch.cat([n, draft, token, *more]).tolist()
    return got[1 : 1 + got[0]] + [got[1 + k]], got[len(got) - m:]


@dataclass
class TreeVerdict:
    path: list[int]  # accepted node indices, root (0) first: what the cache keeps
    tokens: list[int]  # committed tokens: the accepted nodes' labels + one token from the target
    extra: list[int] = field(default_factory=list)  # the caller's ``extra`` ids, read in the same host read


def _accepted_path(buf: TreeBuffers, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``ok`` [N] bool: the node passed its parent's test (the root True; at most one child of a node passes).
    Returns (end [1]: the deepest node whose every ancestor passed, the path to it as an [N] bool mask)."""
    on_path = ~(buf.attend & ~ok).any(-1)  # [N] the node and all its ancestors passed
    end = torch.where(on_path, buf.depth, -1).argmax().view(1)
    return end, buf.attend.index_select(0, end)[0]


Extra = torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None


def read_verdict(tree: Tree, mask: torch.Tensor, token: torch.Tensor, labels: torch.Tensor,
                 extra: Extra = None) -> TreeVerdict:
    """The one host read of a tree verification: the path mask, the token (and the labels when they live on the
    device only), and ``extra`` (1-D ids the caller needs on the host too, e.g. lookahead's next window guesses; or
    a callable that makes them from the committed token, still on the device: ``extra(token)``)."""
    if callable(extra):
        extra = extra(token.reshape(1))
    n = len(tree)
    on_host = not isinstance(tree.labels, torch.Tensor)
    m = 0 if extra is None else extra.numel()
    got = torch.cat([mask.long(), token.reshape(1)] + ([] if extra is None else [extra.reshape(-1).to(mask.device)])
                    + ([] if on_host else [labels])).tolist()
    path = [i for i in range(n) if got[i]]
    labs = tree.labels if on_host else got[n + 1 + m :]
    return TreeVerdict(path, [int(labs[i]) for i in path[1:]] + [got[n]], got[n + 1 : n + 1 + m])


def _check_rows(name: str, tree: Tree, logits: torch.Tensor) -> None:
    if logits.shape[0] != len(tree):
        raise ValueError(f"{name}: a tree of {len(tree)} nodes needs {len(tree)} logit rows, got {logits.shape[0]}")


def _greedy_tree(tree: Tree, logits: torch.Tensor, extra: Extra = None) -> TreeVerdict:
    buf, labels = tree.on(logits.device), tree.label_tensor(logits.device)
    pred = logits.argmax(-1)  # [N]
    ok = labels == pred.index_select(0, buf.parent)
    ok[0].fill_(True)  # (a fill kernel: `ok[0] = True` uploads a host scalar, a sync on CUDA)
    end, mask = _accepted_path(buf, ok)
    return read_verdict(tree, mask, pred.index_select(0, end), labels, extra)


def verify_tree(
    tree: Tree,
    logits: torch.Tensor,
    s: SamplingConfig,
    gen: torch.Generator | None,
    q: dict[int, torch.Tensor] | None = None,
    extra: Extra = None,
) -> TreeVerdict:
    """Verify a tree of drafted tokens against the target's logits [N, V] (row i: after node i).

    q: node -> the (warped) draft distribution [V] its children were drawn from, without replacement; nodes
       not in ``q`` have deterministic children.
    extra: 1-D ids read back in the same host read (``TreeVerdict.extra``), or ``extra(token)`` making them from
       the committed token [1] on the device (:func:`read_verdict`).

    One host read. Deterministic children are tested in closed form (rejecting ``x_1..x_{j-1}`` leaves ``p``
    without them, so ``x_j`` passes with ``p(x_j) / (1 - p(x_1) - ... - p(x_{j-1}))``); the children of nodes in
    ``q`` go through the recursion sibling by sibling, for all such nodes at once.
    """
    _check_rows("verify_tree", tree, logits)
    if s.greedy:
        return _greedy_tree(tree, logits, extra)
    dev = logits.device
    buf, labels = tree.on(dev), tree.label_tensor(dev)
    probs = warp(logits, s)  # [N, V]
    n_inner, width = buf.kids.shape
    ok = torch.zeros(len(tree), dtype=torch.bool, device=dev)
    ok[0].fill_(True)  # (a fill kernel: `ok[0] = True` uploads a host scalar, a sync on CUDA)
    q = {i: dist for i, dist in q.items() if 0 <= i < len(tree) and tree.children[i]} if q else {}
    inner = tree.inner if q else []  # (a tree built on the device has deterministic children: no q, no host lists)
    stoch = [r for r, i in enumerate(inner) if i in q]  # rows (of buf.inner) whose children were drawn from q
    final_s = None
    if n_inner:
        u = torch.rand(n_inner, width, generator=gen, device=dev)
        x = labels.clamp(min=0)[buf.kids]  # [I, C] the children's tokens (padding: token 0, masked by kid_ok)
        # deterministic rows, in closed form
        px = probs[buf.inner[:, None], x] * buf.kid_ok  # [I, C] p(x_j)
        left = probs.sum(-1).index_select(0, buf.inner)[:, None] - (px.cumsum(1) - px)  # mass not yet rejected
        acc = buf.kid_ok & (u * left < px)  # [I, C]
        if stoch:
            rows = torch.tensor(stoch, device=dev)  # (one small copy; only with q)
            p = probs.index_select(0, buf.inner.index_select(0, rows))  # [S, V]
            qs = torch.stack([q[inner[r]] for r in stoch]).to(dev, probs.dtype)
            xs, valid, us = x.index_select(0, rows), buf.kid_ok.index_select(0, rows), u.index_select(0, rows)
            cols = []
            for j in range(max(len(tree.children[inner[r]]) for r in stoch)):
                xj, vj = xs[:, j : j + 1], valid[:, j : j + 1]
                cols.append(vj & (us[:, j : j + 1] * qs.gather(1, xj) < p.gather(1, xj)))
                p = torch.where(vj, _normalised((p - qs).clamp(min=0.0), p), p)  # p_{j+1}
                qz = qs.scatter(1, xj, 0.0)
                qs = torch.where(vj, _normalised(qz, qz), qs)  # q_{j+1}: q_j without x_j
            acc_s = torch.cat(cols, 1)
            acc[rows, : acc_s.shape[1]] = acc_s
            acc[rows, acc_s.shape[1] :] = torch.zeros((), dtype=torch.bool, device=acc.device)
            final_s = p  # [S, V] what is left after every child is rejected
        first = acc & (acc.long().cumsum(1) == 1)  # [I, C] the first accepted child of each node
        ok = first[buf.slot[:, 0], buf.slot[:, 1]]
        ok[0].fill_(True)  # (a fill kernel: `ok[0] = True` uploads a host scalar, a sync on CUDA)
    end, mask = _accepted_path(buf, ok)
    # the distribution left at the end: p there, without its deterministic children (all rejected), or the last
    # p_j of the recursion for a node in q
    p_end = probs.index_select(0, end)  # [1, V]
    if n_inner:
        r_end = buf.row.index_select(0, end).clamp(min=0)
        kids_ok = buf.kid_ok.index_select(0, r_end) & (buf.row.index_select(0, end) >= 0)[:, None]  # [1, C]
        keep = torch.ones_like(p_end).scatter_reduce(1, x.index_select(0, r_end), (~kids_ok).to(p_end.dtype),
                                                     reduce="amin")
        dist = _normalised(p_end * keep, p_end)
    else:
        dist = p_end
    if final_s is not None:
        srow = torch.full((len(tree) + 1,), -1, dtype=torch.long)
        srow[[inner[r] for r in stoch]] = torch.arange(len(stoch))
        pick = srow.to(dev).index_select(0, end) + 1  # 0: dist above, 1 + i: the i-th node in q
        dist = torch.cat([dist, final_s]).index_select(0, pick)
    return read_verdict(tree, mask, sample(dist, gen)[0], labels, extra)
