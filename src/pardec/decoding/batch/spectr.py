"""``spectr`` over a batch: every request's ``k`` i.i.d. draft sequences grown in ``k`` rows of its own in the draft
model's ragged cache (``batch_size * k`` rows: row ``b * k + j`` is request ``b``'s sequence ``j``), every request's
trie verified in one target forward.

A round, as batch-1 ``spectr`` runs it for one request (:mod:`pardec.decoding.spectr`):

1. each draft row is fed what it lacks of its request's committed sequence (one forward for all rows), then the
   ``k * n`` rows draw ``gamma`` tokens side by side, one draft forward per step; within a request, rows with the
   same prefix draw from the distribution of the first of them (the canonical row), so the draws through a prefix
   are i.i.d. from the ``q`` verification is told. Greedy: each request's first sequence is the draft's greedy chain
   and the others are drawn at temperature 1 with the uniforms batch-1 draws (a generator seeded with the run's seed
   every round: the same uniforms for every request), so each request drafts what batch-1 drafts. One host read of
   every request's sequences.
2. each request's sequences merged into a trie, the tries padded to one size (padding nodes hang from the root, see
   only it and themselves, and are never accepted) and verified in one target forward under each row's own mask.
   Greedy: the shared tree rule for every row in one host read (:func:`~pardec.decoding.batch.verify.verify_trees`):
   every row's output equals its batch-1 ``ar`` output. Sampled: the paper's k-sequential selection node by node
   (:func:`~pardec.decoding.kseq.verify_tree_iid`) on each row's trie, one host read per row (as sampled
   ``medusa_typical``); each row follows the target's distribution.
3. the target's cache compacted to each row's accepted path; each draft row keeps what its sequence shares with the
   committed tokens, and is fed the rest next round.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from pardec.decoding.base import check_range
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.batch.methods import catch_up_rows
from pardec.decoding.batch.verify import verify_trees
from pardec.decoding.kseq import verify_tree_iid
from pardec.decoding.sampling import sample, sample_at, warp
from pardec.decoding.spectr import iid_inputs, on_nodes
from pardec.decoding.tree import Tree


@register_batched("spectr")
class BatchedSpecTr(BatchedMethod):
    """``k``, ``gamma``: as batch-1 ``spectr``'s."""

    def __init__(self, target, tokenizer=None, draft=None, k: int = 4, gamma: int = 4):
        super().__init__(target, tokenizer, draft)
        check_range("k", k, 1, 64)
        check_range("gamma", gamma, 1, 64)
        self.k, self.gamma = k, gamma

    @classmethod
    def draft_rows(cls, batch_size: int, params: dict[str, Any]) -> int:
        return batch_size * params.get("k", inspect.signature(cls.__init__).parameters["k"].default)

    def admit(self, row: Row) -> None:
        super().admit(row)  # the draft's first row of the request holds its prompt
        first = self.draft.rows - 1
        for _ in range(self.k - 1):
            self.draft.clone_row(first)

    def drop(self, b: int) -> None:
        self.target.drop(b)
        for j in reversed(range(self.k)):  # the last request's rows move into b's, in order
            self.draft.drop(b * self.k + j)

    def _draft(self, rows: list[Row], m: int) -> tuple[list[list[list[int]]], list[torch.Tensor], list[int]]:
        """Every request's ``k`` sequences of ``m`` tokens: (their tokens [n][k][m] on the host, the distribution
        each row drew from at each step [m] x [n, k, V], the length each draft row held before drafting)."""
        n, k = len(rows), self.k
        logits, fed = catch_up_rows(self.draft, [r for r in rows for _ in range(k)])
        vocab = logits.shape[-1]
        logits = logits.view(n, k, vocab)
        dev = logits.device
        greedy = self.s.greedy
        gen = torch.Generator(device=dev).manual_seed(self.s.seed) if greedy else self.gen
        toks = torch.zeros(n, k, m, dtype=torch.long, device=dev)
        qs: list[torch.Tensor] = []
        for step in range(m):
            if step:  # the first row sharing each row's prefix stands for it
                same = (toks[:, :, None, :step] == toks[:, None, :, :step]).all(-1)  # [n, k, k]
                logits = logits.gather(1, same.int().argmax(2)[..., None].expand(n, k, vocab))
            if greedy:
                q = torch.softmax(logits.float(), -1)  # rows 2..k at temperature 1; row 1 is the greedy chain
                x = logits[:, 0].argmax(-1)[:, None]
                if k > 1:  # batch-1's uniforms, the same for every request
                    u = torch.rand(k - 1, 1, generator=gen, dtype=torch.float64, device=dev)
                    x = torch.cat([x, sample_at(q[:, 1:], u.expand(n, k - 1, 1))[..., 0]], 1)
            else:
                q = warp(logits, self.s)
                x = sample(q, gen)[..., 0]
            toks[:, :, step] = x
            qs.append(q)
            if step < m - 1:
                logits = self.draft.forward(x.reshape(n * k, 1))[:, 0].view(n, k, vocab)
        return toks.tolist(), qs, fed  # the round's one draft read

    def round(self, rows: list[Row]) -> None:
        n, k = len(rows), self.k
        ns = [max(0, min(self.gamma, r.out.room - 1)) for r in rows]  # the target adds one token of its own
        m = max(ns)
        if m == 0:
            self.verify(rows, torch.zeros(n, 0, dtype=torch.long), ns)
            return
        seqs, qs, fed = self._draft(rows, m)
        trees = [Tree.from_paths([s[:nb] for s in seq]) for seq, nb in zip(seqs, ns)]
        buf, labels, base, logits = self.forward_trees(rows, trees, self.gamma)
        if self.s.greedy:
            verdicts = verify_trees(buf, labels, logits, self.s, self.gen)
        else:
            verdicts = []
            for b, (t, seq) in enumerate(zip(trees, seqs)):
                inputs = on_nodes(t, *iid_inputs(seq, ns[b], [x[b] for x in qs], greedy=False))
                v = verify_tree_iid(t, logits[b, : len(t)], self.s, self.gen, **inputs)
                verdicts.append((v.path, v.tokens))
        self.target.keep_rows(base, [path for path, _ in verdicts])
        keep = []
        for b, (_, tokens) in enumerate(verdicts):
            for s in seqs[b]:  # a draft row fed its sequence's first m - 1 tokens: it keeps what they share
                same = next((i for i, (x, y) in enumerate(zip(s[: m - 1], tokens)) if x != y),
                            min(m - 1, len(tokens)))
                keep.append(fed[b * k] + same)
        self.draft.set_lengths(keep)
        for r, (_, tokens), nb in zip(rows, verdicts, ns):
            r.commit(tokens, nb)
