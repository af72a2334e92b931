"""``dflash`` over a batch: each row's block drafted in one drafter forward for every row at once, the drafter's
context (every draft layer's keys/values of the committed tokens' fused features) in a ragged cache of its own
(:class:`~pardec.models.ragged.RaggedKV`, a layer per draft layer), as batch-1 ``dflash`` keeps it
(:mod:`pardec.decoding.dflash`): a row's block ``[last, mask x (block_size - 1)]`` sits at positions
``length_b .. length_b + block_size - 1`` and sees the row's whole context and the whole block; slots ``1 .. n`` are
its drafts, verified as a chain; the features of ``last`` and the accepted drafts join the row's context (one
drafter pass for every row, each row its own count). Greedy: every row's output equals its batch-1 ``ar`` output;
sampled: speculative sampling against each slot's warped distribution, per row."""

from __future__ import annotations

import torch

from pardec.config import ConfigError
from pardec.decoding.base import check_range
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.dflash import block_shape, decoding_drafter, draft_vocab_of, load_dflash_for
from pardec.decoding.sampling import sample, select, warp
from pardec.models.cache import to_device
from pardec.models.drafters import check_int8_weights
from pardec.models.ragged import RaggedKV


@register_batched("dflash")
class BatchedDFlash(BatchedMethod):
    """``path``, ``block_size``, ``num_speculative_tokens``, ``int8_weights``, ``draft_vocab``: as batch-1
    ``dflash``'s (null: the drafter's trained block, ``block_size - 1`` drafts, its own vocabulary); ``compile`` and a
    ``tree`` other than ``chain``: batch-1 only (refused)."""

    def __init__(self, target, tokenizer=None, draft=None, path: str | None = None, block_size: int | None = None,
                 num_speculative_tokens: int | None = None, int8_weights: str | None = "per_token",
                 draft_vocab: str | None = None, compile: bool = False, tree: str = "chain"):
        if compile is not False:
            raise ConfigError(f"method.compile={str(compile).lower()} is batch-1 only: the compiled DFlash round "
                              f"runs one row (batch_size=1, or method.compile=false)")
        if tree != "chain":
            raise ConfigError(f"method.tree={tree!r} is batch-1 only: a batched DFlash verifies each row's block as a "
                              f"chain (batch_size=1, or method.tree=chain)")
        super().__init__(target, tokenizer, draft)
        check_int8_weights(int8_weights)
        vocab = draft_vocab_of(draft_vocab)
        if block_size is not None:
            check_range("block_size", block_size, 2, 1024)
        if num_speculative_tokens is not None:
            check_range("num_speculative_tokens", num_speculative_tokens, 1, 1023)
        if path is None:
            raise ConfigError("method 'dflash' needs a DFlash drafter: method.path=<dir or hub id> (or zoo:dflash)")
        cfg = target.model.config
        drafter = load_dflash_for(path, cfg)
        c = drafter.config
        self.block, self.n = block_shape(c, cfg, block_size, num_speculative_tokens)
        self.drafter = decoding_drafter(drafter, target.model, target.device, int8_weights, vocab)
        self.layers = tuple(int(i) for i in c.layer_ids)
        self.embed = target.model.model.embed_tokens
        self.context = RaggedKV(int(c.num_hidden_layers), target.max_rows, target.capacity, "dflash context")

    def _append(self, first: int, features: torch.Tensor, widths: list[int] | None = None) -> None:
        """Context entries of rows ``first ..`` for ``features`` [n, T, K * H_t] after each row's own."""
        n, t = features.shape[:2]
        w = self.context.window(first, n, t, features.device)
        for i, (k, v) in enumerate(self.drafter.context_kv(features, w.slots)):
            self.context.write(i, w, k, v)
        self.context.advance(w, widths)

    def admit(self, row: Row) -> None:
        logits, features = self.target.add(row.prompt, hidden_layer=self.layers)
        first = select(logits, self.s, self.gen)
        self._append(self.context.new_row(), features[None])
        row.last = int(first)  # (the admission's one host read)
        row.out.commit([row.last])

    def drop(self, b: int) -> None:
        super().drop(b)
        self.context.drop(b)

    def _propose(self, last: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every row's block after its ``last`` [n]: (drafts [n, k], their warped distributions [n, k, V] under
        sampling, else None)."""
        d, n, dev = self.drafter, last.shape[0], last.device
        every = torch.ones(self.block, self.block, dtype=torch.bool, device=dev)  # a slot sees the whole block
        views, mask, lens = self.context.past(0, n, self.block, dev, every)
        pos = lens[:, None] + torch.arange(self.block, device=dev)
        out = d(d.block_inputs(self.embed, last, self.block), pos, views, mask)
        logits = d.logits(out[:, 1 : k + 1], self.target.model.lm_head)  # [n, k, V] (or [n, k, K])
        if self.s.greedy:
            return d.to_target(logits.argmax(-1)), None
        q = warp(d.full_logits(logits), self.s)
        return sample(q, self.gen)[..., 0], q

    def round(self, rows: list[Row]) -> None:
        n = len(rows)
        ks = [min(self.n, r.out.room - 1) for r in rows]
        k = max(ks)
        dev = self.target.device
        last = to_device(torch.tensor([r.last for r in rows], dtype=torch.long), dev)
        draft, q = self._propose(last, k) if k else (torch.zeros(n, 0, dtype=torch.long, device=dev), None)
        acc, _, hidden = self.verify(rows, draft, ks, q, hidden_layer=self.layers)
        m = max(len(a) for a in acc)
        self._append(0, hidden[:, :m], widths=[len(a) for a in acc])
