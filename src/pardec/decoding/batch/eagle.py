"""``eagle3`` over a batch: EAGLE-3's chain (vLLM's proposer, ``mode=chain``) per row, the drafter's stable entries in
a ragged cache of its own (:class:`~pardec.models.ragged.RaggedKV`, one layer), as batch-1 ``eagle3`` keeps them
(:mod:`pardec.decoding.eagle`): entry ``j`` of a row pairs the target's fused features at position ``j`` with the
embedding of token ``j + 1``, and the drafter's output at the last one (the row's *root*) predicts its first draft.

Each round: the drafter runs ``num_speculative_tokens - 1`` forwards over every row at once (each row's chain entries
appended to its cache after its stable ones), the target verifies every row's chain and returns the features the
drafter reads, the chain entries leave the drafter's cache and one drafter forward catches every row up with its
accepted tokens (a row's own count: padded, each row's length its own). Greedy: every row's output equals its batch-1
``ar`` output; sampled: speculative sampling with the drafter's warped distributions, per row. EAGLE-2's dynamic tree
(``mode=tree``, batch-1's default) is not batched (docs/batch.md)."""

from __future__ import annotations

import torch

from pardec.config import ConfigError
from pardec.decoding.base import check_range
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.sampling import sample, select, warp
from pardec.models.cache import to_device
from pardec.models.drafters import check_int8_weights, place
from pardec.models.eagle_formats import load_eagle3
from pardec.models.ragged import RaggedKV


@register_batched("eagle3")
class BatchedEagle3(BatchedMethod):
    """``path``: the drafter (as batch-1 ``eagle3`` reads it); ``mode``: ``chain`` (the only one batched);
    ``num_speculative_tokens``: the chain's length (default 3, as batch-1's); ``int8_weights``: as batch-1's."""

    def __init__(self, target, tokenizer=None, draft=None, path: str | None = None, mode: str = "chain",
                 num_speculative_tokens: int = 3, int8_weights: str | None = "per_token"):
        super().__init__(target, tokenizer, draft)
        check_int8_weights(int8_weights)
        self.check_options({"mode": mode})
        check_range("num_speculative_tokens", num_speculative_tokens, 1, 64)
        if path is None:
            raise ConfigError("method 'eagle3' needs an EAGLE-3 drafter: method.path=<dir> (or zoo:eagle3)")
        cfg = target.model.config
        drafter, _ = load_eagle3(path, cfg, key="method.path")
        c = drafter.config
        if c.target_hidden_size != int(cfg.hidden_size) or c.vocab_size != int(cfg.vocab_size):
            raise ConfigError(f"the EAGLE-3 drafter reads features of width {c.target_hidden_size} and vocabulary "
                              f"{c.vocab_size}; the target has {cfg.hidden_size} and {cfg.vocab_size}")
        self.drafter = place(drafter, target.model, target.device, int8_weights)
        self.layers = tuple(int(i) for i in c.layer_ids)
        self.embed = target.model.model.embed_tokens
        self.k = num_speculative_tokens
        self.cache = RaggedKV(1, target.max_rows, target.capacity, "eagle3 drafter")
        self.roots: torch.Tensor | None = None  # [rows, H]: each row's drafter output at its last stable entry

    @classmethod
    def check_options(cls, params: dict) -> None:
        if params.get("mode", "chain") != "chain":
            raise ConfigError(f"method.mode={params['mode']!r}: batched eagle3 drafts chains (method.mode=chain); "
                              f"EAGLE-2's dynamic tree runs at batch size 1")

    @property
    def width(self) -> int:
        return self.k + 1

    def _feed(self, first: int, tokens: torch.Tensor, hidden: torch.Tensor, widths: list[int] | None = None
              ) -> torch.Tensor:
        """Drafter entries for rows ``first ..``: ``tokens`` [n, T] (embedded here), ``hidden`` [n, T, H] (fused
        features or the drafter's own outputs), after each row's cached entries; returns the outputs [n, T, H]."""
        n, t = tokens.shape
        dev = hidden.device
        w = self.cache.window(first, n, t, dev)  # (before the past: it may move the buffers to a larger capacity)
        views, mask, _ = self.cache.past(first, n, t, dev)  # the drafter reads the cached entries as one past
        out, (k, v) = self.drafter(self.embed(tokens), hidden, w.slots, past=views[0] if views else None, mask=mask)
        self.cache.write(0, w, k, v)
        self.cache.advance(w, widths)
        return out

    def admit(self, row: Row) -> None:
        logits, features = self.target.add(row.prompt, hidden_layer=self.layers)
        first = select(logits, self.s, self.gen)
        b = self.cache.new_row()
        tokens = torch.cat([to_device(torch.as_tensor(row.prompt[1:], dtype=torch.long), first.device), first])
        out = self._feed(b, tokens[None], self.drafter.fuse(features)[None])
        if self.roots is None:
            self.roots = out.new_zeros(self.target.max_rows, out.shape[-1])
        self.roots[b] = out[0, -1]
        row.last = int(first)  # (the admission's one host read)
        row.out.commit([row.last])

    def drop(self, b: int) -> None:
        super().drop(b)
        self.cache.drop(b)
        if b < self.cache.rows:  # the last row took its place
            self.roots[b] = self.roots[self.cache.rows]

    def round(self, rows: list[Row]) -> None:
        d, n = self.drafter, len(rows)
        ks = [min(self.k, r.out.room - 1) for r in rows]
        k = max(ks)
        stable = list(self.cache.lengths)
        toks, qs, out = [], [], self.roots[:n]
        for i in range(k):
            logits = d.full_logits(d.logits(out))  # [n, V]
            if self.s.greedy:
                toks.append(logits.argmax(-1))
            else:
                qs.append(warp(logits, self.s))
                toks.append(sample(qs[-1], self.gen)[:, 0])
            if i < k - 1:
                out = self._feed(0, toks[-1][:, None], out[:, None])[:, 0]
        draft = torch.stack(toks, 1) if toks else torch.zeros(n, 0, dtype=torch.long, device=self.roots.device)
        acc, _, hidden = self.verify(rows, draft, ks, torch.stack(qs, 1) if qs else None, hidden_layer=self.layers)
        self.cache.set_lengths(stable)  # the chain's entries leave; the accepted tokens' come with the target's features
        m = max(len(a) for a in acc)
        tokens = to_device(torch.tensor([a + [0] * (m - len(a)) for a in acc], dtype=torch.long), hidden.device)
        out = self._feed(0, tokens, d.fuse(hidden[:, :m]), widths=[len(a) for a in acc])
        last = to_device(torch.tensor([len(a) - 1 for a in acc]), out.device)
        self.roots[:n] = out[torch.arange(n, device=out.device), last]
