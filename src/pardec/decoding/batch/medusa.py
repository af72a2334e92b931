"""``medusa`` and ``firp`` over a batch (:class:`BatchedTreeDrafter`, batch-1's :class:`~pardec.decoding.heads.
TreeDrafter`): every row's candidate tree (one shape, the method's rank tree; each row's own tokens, the top-ranked
of its own draft distributions) verified in one target forward for every row, the tree rule applied to every row at
once (:func:`~pardec.decoding.batch.verify.verify_trees`), each row's cache compacted to its accepted path
(:meth:`~pardec.models.ragged.RaggedKV.keep_rows`), and the next drafts made from each row's last accepted node, as
batch-1 makes them (:mod:`pardec.decoding.heads`): ``medusa``'s heads on its final hidden state; ``firp``'s pseudo
states (:mod:`pardec.decoding.batch.firp`). A row's tree is not cut to the room it has left (batch-1 cuts it): tokens
past the limit are dropped by the row's output, which then ends. Greedy: every row's output equals its batch-1 ``ar``
output; sampled: the target's distribution, per row."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from pardec.config import ConfigError
from pardec.decoding.base import check_range
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.batch.verify import verify_trees
from pardec.decoding.heads import check_typical, typical_accept
from pardec.decoding.sampling import select
from pardec.decoding.tree_search import RankTree, resolve_tree
from pardec.models.cache import to_device
from pardec.models.drafters import check_int8_weights, load_drafter, place, read_meta


class BatchedTreeDrafter(BatchedMethod):
    """The shared loop; a subclass says which hidden states the target's forward captures (:attr:`capture`) and how
    a row's drafts come from them (:meth:`_drafts`)."""

    kind: ClassVar[str] = ""

    def __init__(self, target, tokenizer=None, draft=None, path: str | None = None, tree: str = "chain",
                 k: int | None = None, int8_weights: str | None = "per_token"):
        super().__init__(target, tokenizer, draft)
        check_int8_weights(int8_weights)
        if path is None:
            raise ConfigError(f"method {self.kind!r} needs trained {self.kind} weights: method.path=<dir> "
                              f"(or zoo:{self.kind})")
        meta = read_meta(path, "method.path")
        if meta.get("kind") != self.kind:
            raise ConfigError(f"method.path={path!r} holds {meta.get('kind')!r} weights; this method needs "
                              f"{self.kind!r}")
        if k is not None:
            check_range("k", k, 1, int(meta["k"]))
        self.k = k or int(meta["k"])
        self.tree_name, paths = resolve_tree(tree, [Path(path) / "trees"], int(meta["k"]))
        self.ranks, self.at, self.need = RankTree(paths).cut(self.k, "cpu")
        self.drafter, _ = load_drafter(path, target.model.config, self.kind, key="method.path")
        self.drafter = place(self.drafter, target.model, target.device, int8_weights)
        self.drafts: torch.Tensor | None = None  # [rows, k, V]: each row's drafts after its last accepted node

    @property
    def capture(self) -> tuple[int, ...]:
        """The layers whose entering hidden states (the final norm's output for ``num_hidden_layers``) the drafts
        are made from."""
        raise NotImplementedError

    def _drafts(self, first: int, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, k, V] of rows ``first ..`` from the captured states of their last cached position
        [n, len(capture) * H] (the cache holds exactly each row's committed tokens but the last)."""
        raise NotImplementedError

    def _verify(self, rows: list[Row], buf, labels: torch.Tensor, logits: torch.Tensor
                ) -> list[tuple[list[int], list[int]]]:
        """Every row's (accepted path, committed tokens): the shared tree rule, one host read."""
        return verify_trees(buf, labels, logits, self.s, self.gen)

    def admit(self, row: Row) -> None:
        logits, hidden = self.target.add(row.prompt, hidden_layer=self.capture)
        drafts = self._drafts(self.target.rows - 1, hidden[-1:])[0]
        if self.drafts is None:
            self.drafts = drafts.new_zeros(self.target.max_rows, *drafts.shape)
        self.drafts[self.target.rows - 1] = drafts
        row.last = int(select(logits, self.s, self.gen))  # (the admission's one host read)
        row.out.commit([row.last])

    def drop(self, b: int) -> None:
        super().drop(b)
        if b < self.target.rows:  # the last row took its place
            self.drafts[b] = self.drafts[self.target.rows]

    def round(self, rows: list[Row]) -> None:
        n, dev = len(rows), self.target.device
        buf = self.ranks.on(dev)
        at = to_device(self.at, dev)
        if len(self.ranks) > 1:
            top = self.drafts[:n].topk(min(self.need, self.drafts.shape[-1]), dim=-1).indices  # [n, k, need]
            cands = top[:, at[0], at[1]]  # [n, N - 1]
        else:
            cands = torch.zeros(n, 0, dtype=torch.long, device=dev)
        last = to_device(torch.tensor([[r.last] for r in rows], dtype=torch.long), dev)
        base = list(self.target.lengths)
        logits, hidden = self.target.forward(torch.cat([last, cands], 1), depths=buf.depth, attend=buf.attend,
                                             hidden_layer=self.capture)
        labels = torch.cat([torch.full((n, 1), -1, dtype=torch.long, device=dev), cands], 1)
        verdicts = self._verify(rows, buf, labels, logits)
        self.target.keep_rows(base, [path for path, _ in verdicts])
        ends = to_device(torch.tensor([path[-1] for path, _ in verdicts]), dev)
        self.drafts[:n] = self._drafts(0, hidden[torch.arange(n, device=dev), ends])
        for r, (_, tokens) in zip(rows, verdicts):
            r.commit(tokens, len(self.ranks) - 1)


@register_batched("medusa")
class BatchedMedusa(BatchedTreeDrafter):
    """``path``, ``tree``, ``k``, ``int8_weights``: as batch-1 ``medusa``'s."""

    kind = "medusa"

    @property
    def capture(self) -> tuple[int, ...]:
        return (int(self.target.model.config.num_hidden_layers),)  # the final norm's output: what the heads read

    def _drafts(self, first: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.drafter(hidden)[..., : self.k, :]  # [n, k, V]


@register_batched("medusa_typical")
class BatchedMedusaTypical(BatchedMedusa):
    """``posterior_threshold``, ``posterior_alpha``, ``next_token`` and the rest: as batch-1 ``medusa_typical``'s.
    Greedy: the shared tree rule (exact); sampled: Medusa's typical acceptance row by row
    (:func:`~pardec.decoding.heads.typical_accept` on each row's tree, one host read per row)."""

    def __init__(self, target, tokenizer=None, draft=None, path: str | None = None, tree: str = "chain",
                 k: int | None = None, posterior_threshold: float = 0.09, posterior_alpha: float = 0.3,
                 next_token: str = "greedy", int8_weights: str | None = "per_token"):
        check_typical(posterior_threshold, posterior_alpha, next_token)
        super().__init__(target, tokenizer, draft, path, tree, k, int8_weights)
        self.threshold, self.alpha, self.next_token = posterior_threshold, posterior_alpha, next_token

    def _verify(self, rows, buf, labels, logits):
        if self.s.greedy:
            return super()._verify(rows, buf, labels, logits)
        out = []
        for b, r in enumerate(rows):  # a row's tree as batch-1 cuts it to the room left (a lossy rule: it matters)
            v = typical_accept(self.ranks.relabel(labels[b]), logits[b], self.s, self.gen, self.threshold,
                               self.alpha, self.next_token, depth=min(self.k, r.out.room - 1))
            out.append((v.path, v.tokens))
        return out
