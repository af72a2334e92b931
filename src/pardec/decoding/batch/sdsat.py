"""``sdsat`` over a batch, its chain candidates: greedy decoding (the paper's greedy decoder, the main chain alone),
or sampling with ``tree=caterpillar top_k=1`` (the argmax chain); the nucleus trees of sampled decoding are batch-1
only (refused before any model loads).

As batch-1 ``sdsat`` (:mod:`pardec.decoding.sdsat`), the target drafts for itself: a row's forward holds its last
token, its drafts (when it has some) and ``k`` adaptive tokens after them (always when it has no drafts, and in every
forward of ``variant=fused``), laid out per row and padded to the widest row; the drafts are verified as a chain,
the adaptive tokens never stay in the cache, and their logits (the adaptive ids excluded) give the row's next
drafts, which it keeps only if it accepted all of its drafts (they were computed after them). One target forward
and one host read per round for every row: the next drafts ride on the verification's read. Greedy: each row's
output equals its batch-1 ``ar`` output; sampled: the target's distribution per row."""

from __future__ import annotations

import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding.base import method_params
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.sampling import select
from pardec.decoding.sdsat import SDSAT, adaptive_chain, adaptive_of, without_adaptive
from pardec.models.cache import to_device


@register_batched("sdsat")
class BatchedSDSAT(BatchedMethod):
    """``k``, ``variant``, ``top_k``, ``top_p``, ``tree``, ``adaptive_ids``: as batch-1 ``sdsat``'s; sampled
    decoding takes the chain (``tree=caterpillar top_k=1``) only."""

    def __init__(self, target, tokenizer=None, draft=None, k: int = 5, variant: str = "two_step", top_k: int = 10,
                 top_p: float = 0.95, tree: str = "official", adaptive_ids: list | None = None):
        super().__init__(target, tokenizer, draft)
        SDSAT(None, k=k, variant=variant, top_k=top_k, top_p=top_p, tree=tree, adaptive_ids=adaptive_ids)  # checks
        self.k, self.fused, self.tree, self.top_k = k, variant == "fused", tree, top_k
        self.adaptive = adaptive_of(target.model.config, target.name, adaptive_ids, k)
        self.index = to_device(torch.tensor(self.adaptive, dtype=torch.long), target.device)

    @classmethod
    def check_options(cls, params: dict, sampling: SamplingConfig | None = None) -> None:
        p = {k: v.default for k, v in method_params(cls).items()} | params
        _check_chain(p["tree"], p["top_k"], sampling)

    @property
    def width(self) -> int:
        return 2 * self.k + 1

    def start(self, s: SamplingConfig, gen: torch.Generator | None) -> None:
        _check_chain(self.tree, self.top_k, s)
        super().start(s, gen)

    def _drafts(self, rows: torch.Tensor) -> torch.Tensor:
        """The next drafts [..., k] from adaptive rows' logits [..., k, V]: each depth's most likely token."""
        return without_adaptive(rows, self.index).argmax(-1)

    def admit(self, row: Row) -> None:
        n = len(row.prompt)
        logits = self.target.add(row.prompt + adaptive_chain(self.adaptive, self.k), logits_from=n - 1)
        self.target.set_lengths(self.target.lengths[:-1] + [n])  # the adaptive tokens never stay
        got = torch.cat([select(logits[:1], self.s, self.gen), self._drafts(logits[1:])]).tolist()  # one read
        row.last, row.state["drafts"] = got[0], got[1:]
        row.out.commit([row.last])

    def round(self, rows: list[Row]) -> None:
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


def _check_chain(tree: str, top_k: int, sampling: SamplingConfig | None) -> None:
    """Sampled decoding drafts a chain only with the caterpillar of one token per depth."""
    if sampling is not None and not sampling.greedy and not (str(tree) == "caterpillar" and top_k <= 1):
        raise ConfigError(f"method.tree={tree} with method.top_k={top_k} drafts a nucleus tree under sampling, which "
                          f"batched sdsat does not: it drafts chains (greedy, or method.tree=caterpillar "
                          f"method.top_k=1); use batch_size=1 for the tree")
