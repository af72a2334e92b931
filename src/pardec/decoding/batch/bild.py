"""``bild`` over a batch: each row's draft chain grown while the draft is confident, every row at once, and rolled
back by the target as batch-1 ``bild`` rolls one back (:mod:`pardec.decoding.bild`).

Each round the draft model (its own ragged cache, caught up with what it lacks of each row) drafts for every row
together, one draft forward per step: a row's chain ends where its draft's confidence falls below
``fallback_threshold`` (the unsure token dropped, or kept as the chain's last under ``variant=mjsd``) or after
``max_draft`` tokens (fewer where the row has less room); the steps go on while any row still drafts. The
confidence is read back once per draft step for the whole batch (batch-1 reads it once per draft step too); the
target verifies every row's chain in one forward and one host read: a row keeps the prefix before its first token
whose cross-entropy under the target exceeds ``rollback_threshold``, then the target's token there. Greedy: each
row's output is batch-1 ``bild``'s on its prompt, token for token; sampled: the same law per row. ``bild`` is
``approximate``: its accepted drafts need not be the target's choice."""

from __future__ import annotations

import torch

from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.batch.methods import catch_up_rows
from pardec.decoding.bild import check_bild, surviving, warping
from pardec.decoding.drafting import confidence
from pardec.decoding.sampling import sample, select, warp
from pardec.models.cache import to_device


@register_batched("bild")
class BatchedBiLD(BatchedMethod):
    """``fallback_threshold``, ``rollback_threshold``, ``max_draft``, ``variant``: as batch-1 ``bild``'s."""

    def __init__(self, target, tokenizer=None, draft=None, fallback_threshold: float = 0.9,
                 rollback_threshold: float = 2.0, max_draft: int = 10, variant: str = "bild"):
        super().__init__(target, tokenizer, draft)
        check_bild(fallback_threshold, rollback_threshold, max_draft, variant)
        self.fallback, self.rollback, self.max_draft = fallback_threshold, rollback_threshold, max_draft
        self.variant = variant

    def _chains(self, rows: list[Row], ks: list[int]) -> tuple[torch.Tensor, list[int], list[int], int]:
        """Every row's chain: (tokens [n, steps] on the draft's device, each row's chain length, the rows' lengths
        the draft held before the chain, the chain tokens fed to the draft)."""
        warped = warping(self.variant, self.s)
        logits, fed = catch_up_rows(self.draft, rows)
        drafting, lens, cols = [k > 0 for k in ks], [0] * len(rows), []
        for j in range(max(ks)):
            unsure = (confidence(logits, warped) < self.fallback).tolist()  # one read per draft step
            cols.append(logits.argmax(-1) if self.s.greedy else sample(warp(logits, self.s), self.gen)[:, 0])
            for b, u in enumerate(unsure):
                if drafting[b]:
                    lens[b] = j + (1 if not u or self.variant == "mjsd" else 0)
                    drafting[b] = not u and j + 1 < ks[b]
            if not any(drafting):
                return torch.stack(cols, 1), lens, fed, j
            logits = self.draft.forward(cols[-1][:, None])[:, 0]
        raise AssertionError("unreachable: every row stops drafting by its max_draft")

    def _rule(self, draft: torch.Tensor, ks: list[int], logits: torch.Tensor) -> list[list[int]]:
        """Each row's surviving prefix and the target's token after it (one host read)."""
        n, k = draft.shape
        dev = logits.device
        valid = torch.arange(k, device=dev)[None] < to_device(torch.tensor(ks, dtype=torch.long), dev)[:, None]
        cut = surviving(draft, logits, self.rollback, warping(self.variant, self.s), valid)
        token = select(logits[torch.arange(n, device=dev), cut], self.s, self.gen)
        got = torch.cat([cut[:, None], to_device(draft, dev), token[:, None]], 1).tolist()
        return [g[1 : 1 + g[0]] + [g[-1]] for g in got]

    def round(self, rows: list[Row]) -> None:
        ks = [min(self.max_draft, r.out.room - 1) for r in rows]  # the target adds one token of its own
        if max(ks) == 0:
            self.verify(rows, torch.zeros(len(rows), 0, dtype=torch.long), ks, rule=self._rule)
            return
        toks, lens, fed, steps = self._chains(rows, ks)
        acc = self.verify(rows, toks[:, : max(lens)], lens, rule=self._rule).tokens
        # the draft holds each row's old sequence + the first `steps` drafted tokens: keep what the new one shares
        self.draft.set_lengths([f + min(len(a) - 1, steps) for f, a in zip(fed, acc)])
