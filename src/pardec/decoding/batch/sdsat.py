"""``sdsat`` over a batch: its chain candidates (greedy decoding, the paper's greedy decoder: the main chain alone;
or sampling with ``tree=caterpillar top_k=1``, the argmax chain) and the nucleus trees of sampled decoding.

As batch-1 ``sdsat`` (:mod:`pardec.decoding.sdsat`), the target drafts for itself: a row's forward holds its last
token, its drafts (when it has some) and ``k`` adaptive tokens after them (always when it has no drafts, and in every
forward of ``variant=fused``), laid out per row and padded to the widest row; the drafts are verified as a chain,
the adaptive tokens never stay in the cache, and their logits (the adaptive ids excluded) give the row's next
drafts, which it keeps only if it accepted all of its drafts (they were computed after them). One target forward
and one host read per round for every row: the next drafts ride on the verification's read. Greedy: each row's
output equals its batch-1 ``ar`` output; sampled: the target's distribution per row.

Sampled nucleus trees (``tree=official``, a tree file, or the caterpillar with ``top_k > 1``): each row keeps the
host values batch-1 builds its candidates from (each depth's ranked tokens inside the nucleus,
:meth:`~pardec.decoding.sdsat.SDSAT.candidate_lists`), builds batch-1's tree from them with the adaptive chain after
its main chain, and every row's tree goes through one target forward padded to the largest
(:func:`~pardec.decoding.batch.verify.padded_trees`); each row's tree is verified by the shared tree rule and its
next lists ride on that read (one host read per row, as batched sampled ``lookahead`` and ``medusa_typical``)."""

from __future__ import annotations

import torch

from pardec.config import SamplingConfig
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.sampling import select
from pardec.decoding.sdsat import (
    SDSAT,
    adaptive_chain,
    adaptive_of,
    unflatten_lists,
    with_chain,
    without_adaptive,
)
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree
from pardec.models.cache import to_device


@register_batched("sdsat")
class BatchedSDSAT(BatchedMethod):
    """``k``, ``variant``, ``top_k``, ``top_p``, ``tree``, ``adaptive_ids``: as batch-1 ``sdsat``'s."""

    def __init__(self, target, tokenizer=None, draft=None, k: int = 5, variant: str = "two_step", top_k: int = 10,
                 top_p: float = 0.95, tree: str = "official", adaptive_ids: list | None = None):
        super().__init__(target, tokenizer, draft)
        # batch-1's rules (its checks; the candidate lists and trees of sampled decoding)
        self.single = SDSAT(None, k=k, variant=variant, top_k=top_k, top_p=top_p, tree=tree, adaptive_ids=adaptive_ids)
        self.k, self.fused, self.tree, self.top_k = k, variant == "fused", tree, top_k
        self.trees = False  # sampled nucleus trees (set by start)
        self.adaptive = adaptive_of(target.model.config, target.name, adaptive_ids, k)
        self.index = to_device(torch.tensor(self.adaptive, dtype=torch.long), target.device)

    def start(self, s: SamplingConfig, gen: torch.Generator | None) -> None:
        super().start(s, gen)
        self.trees = not s.greedy and not (str(self.tree) == "caterpillar" and self.top_k <= 1)

    def _drafts(self, rows: torch.Tensor) -> torch.Tensor:
        """The next drafts [..., k] from adaptive rows' logits [..., k, V]: each depth's most likely token."""
        return without_adaptive(rows, self.index).argmax(-1)

    def admit(self, row: Row) -> None:
        n = len(row.prompt)
        logits = self.target.add(row.prompt + adaptive_chain(self.adaptive, self.k), logits_from=n - 1)
        self.target.set_lengths(self.target.lengths[:-1] + [n])  # the adaptive tokens never stay
        first = select(logits[:1], self.s, self.gen)
        if self.trees:  # the next candidates' values
            lists = self.single.candidate_lists(without_adaptive(logits[1:], self.index), self.s)
            got = torch.cat([first, lists.reshape(-1)]).tolist()  # one read
            row.state["lists"] = unflatten_lists(got[1:], lists.shape)
        else:
            got = torch.cat([first, self._drafts(logits[1:])]).tolist()  # one read
            row.state["drafts"] = got[1:]
        row.last = got[0]
        row.out.commit([row.last])

    def round(self, rows: list[Row]) -> None:
        if self.trees:
            self._round_trees(rows)
            return
        seqs, depths, adapts = [], [], []
        for r in rows:
            drafts = r.state["drafts"]
            depth = min(self.k, r.out.room - 1) if drafts is not None else 0
            n_adapt = self.k if (depth == 0 or self.fused) and r.out.room > depth + 1 else 0
            seqs.append((drafts or [])[:depth] + adaptive_chain(self.adaptive, n_adapt))
            depths.append(depth)
            adapts.append(n_adapt)
        width = max(map(len, seqs))
        draft = torch.tensor([q + [0] * (width - len(q)) for q in seqs], dtype=torch.long).reshape(len(rows), width)
        # each row's adaptive rows sit after its own drafts: logits columns 1 + depth .. depth + k
        at = torch.tensor([[min(1 + d + j, width) for j in range(self.k)] for d in depths], dtype=torch.long)

        def nxt(logits: torch.Tensor) -> torch.Tensor:
            idx = to_device(at, logits.device)[..., None].expand(-1, -1, logits.shape[-1])
            return self._drafts(logits.gather(1, idx))

        acc, more, _ = self.verify(rows, draft, depths, extra=nxt)  # adaptive tokens: padding to the chain rule
        for r, a, d, n_adapt, x in zip(rows, acc, depths, adapts, more):
            r.state["drafts"] = x if n_adapt and len(a) - 1 == d else None


    def _round_trees(self, rows: list[Row]) -> None:
        """Sampled nucleus trees: each row's tree (and adaptive chain) in one target forward, verified row by row."""
        made = []
        for r in rows:
            lists = r.state["lists"]
            depth = min(self.k, r.out.room - 1) if lists is not None else 0
            tree, anchor = (self.single.tree_from_lists([part[:depth] for part in lists], self.s) if depth > 0
                            else (Tree.chain([]), 0))
            n_adapt = self.k if (depth == 0 or self.fused) and r.out.room > depth + 1 else 0
            full = with_chain(tree, anchor, adaptive_chain(self.adaptive, n_adapt)) if n_adapt else tree
            made.append((tree, anchor, depth, n_adapt, full))
        _, _, base, logits = self.forward_trees(rows, [m[4] for m in made])
        verdicts = []
        for b, (r, (tree, anchor, _, n_adapt, _)) in enumerate(zip(rows, made)):
            lists = None  # the next candidates: used only if the whole main chain is accepted (read all the same)
            if n_adapt:
                adaptive = logits[b, len(tree) : len(tree) + n_adapt]
                lists = self.single.candidate_lists(without_adaptive(adaptive, self.index), self.s)
            v = verify_tree(tree, logits[b, : len(tree)], self.s, self.gen,
                            extra=None if lists is None else lists.reshape(-1))  # the row's one host read
            r.state["lists"] = (unflatten_lists(v.extra, lists.shape) if lists is not None and v.path[-1] == anchor
                                else None)
            verdicts.append(v)
        self.target.keep_rows(base, [v.path for v in verdicts])
        for r, v, m in zip(rows, verdicts, made):
            r.commit(v.tokens, m[2])
