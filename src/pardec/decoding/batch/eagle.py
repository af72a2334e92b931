"""``eagle3`` over a batch, both of batch-1's drafting modes, the drafter's stable entries in a ragged cache of its
own (:class:`~pardec.models.ragged.RaggedKV`, one layer), as batch-1 ``eagle3`` keeps them
(:mod:`pardec.decoding.eagle`): entry ``j`` of a row pairs the target's fused features at position ``j`` with the
embedding of token ``j + 1``, and the drafter's output at the last one (the row's *root*) predicts its first draft.

* ``mode=tree`` (batch-1's default, EAGLE-2's dynamic tree): every row's tree grown at once by
  :func:`~pardec.decoding.eagle.dynamic_tree` (each level one drafter forward over every row's frontier, its entries
  after the row's stable ones, each seeing them, its ancestors and itself), so every row's tree has the same
  number of nodes and its own shape; one target forward over every row's tree, each under its own ancestor mask
  (:func:`~pardec.decoding.tree.device_buffers`), the tree rule applied to every row at once
  (:func:`~pardec.decoding.batch.verify.verify_trees`), each row's cache compacted to its accepted path. A row's
  tree is not cut to the room it has left (batch-1 cuts its depth): tokens past the limit are dropped by the row's
  output, which then ends, so a row's last round may accept another count than batch-1's.
* ``mode=chain`` (vLLM's proposer): ``num_speculative_tokens - 1`` drafter forwards over every row at once (each
  row's chain entries after its stable ones), the target verifies every row's chain.

Then the draft entries leave the drafter's cache and one drafter forward catches every row up with its accepted
tokens and the target's features at their positions (a row's own count: padded, each row's length its own).
Greedy: every row's output equals its batch-1 ``ar`` output; sampled: the target's distribution, per row (the
tree's top-k children by the shared tree rule, the chain by speculative sampling with the drafter's warped
distributions). One host read per round: the verification's."""

from __future__ import annotations

import torch

from pardec.config import ConfigError
from pardec.decoding.base import method_params
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.batch.verify import verify_trees
from pardec.decoding.eagle import check_eagle3, dynamic_tree
from pardec.decoding.sampling import sample, select, warp
from pardec.decoding.tree import device_buffers
from pardec.models.cache import to_device
from pardec.models.drafters import place
from pardec.models.eagle_formats import load_eagle3
from pardec.models.ragged import RaggedKV


@register_batched("eagle3")
class BatchedEagle3(BatchedMethod):
    """``path``, ``mode``, ``total_tokens``, ``depth``, ``top_k``, ``num_speculative_tokens``, ``int8_weights``: as
    batch-1 ``eagle3``'s."""

    def __init__(self, target, tokenizer=None, draft=None, path: str | None = None, mode: str = "tree",
                 total_tokens: int = 60, depth: int = 7, top_k: int = 10, num_speculative_tokens: int = 3,
                 int8_weights: str | None = "per_token"):
        super().__init__(target, tokenizer, draft)
        check_eagle3(mode, total_tokens, depth, top_k, num_speculative_tokens, int8_weights)
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
        self.mode, self.total_tokens, self.depth, self.top_k = mode, total_tokens, depth, top_k
        self.k = num_speculative_tokens
        self.cache = RaggedKV(1, target.max_rows, target.capacity, "eagle3 drafter")
        self.roots: torch.Tensor | None = None  # [rows, H]: each row's drafter output at its last stable entry

    @classmethod
    def check_options(cls, params: dict, sampling=None) -> None:
        p = {k: v.default for k, v in method_params(cls).items() if k != "path"} | params
        check_eagle3(p["mode"], p["total_tokens"], p["depth"], p["top_k"], p["num_speculative_tokens"],
                     p["int8_weights"])

    def _feed(self, first: int, tokens: torch.Tensor, hidden: torch.Tensor, widths: list[int] | None = None,
              level: tuple[torch.Tensor, int, torch.Tensor] | None = None) -> torch.Tensor:
        """Drafter entries for rows ``first ..``: ``tokens`` [n, T] (embedded here), ``hidden`` [n, T, H] (fused
        features or the drafter's own outputs), after each row's cached entries; returns the outputs [n, T, H].
        ``level``: a tree level's entries (``stable`` [n] each row's stable entries, the level ``i``, ``seen``
        [n, T, m + T] over the row's ``m`` tree entries cached after them and these): each at the position
        ``stable + i``, seeing the stable entries and what ``seen`` says; default: a chain's, causal."""
        n, t = tokens.shape
        dev = hidden.device
        w = self.cache.window(first, n, t, dev)  # (before the past: it may move the buffers to a larger capacity)
        views, mask, _ = self.cache.past(first, n, t, dev)  # the drafter reads the cached entries as one past
        positions = w.slots
        if level is not None:
            stable, i, seen = level
            m, s = seen.shape[2] - t, mask.shape[2] - t
            rel = torch.arange(s, device=dev)[None] - stable[:, None]  # [n, S]: slot - the row's stable length
            cached = (rel < 0)[:, None].expand(n, t, s)
            if m:
                tree = seen[:, :, :m].gather(2, rel.clamp(0, m - 1)[:, None].expand(n, t, s))
                cached = cached | (tree & ((rel >= 0) & (rel < m))[:, None])
            mask = torch.cat([cached, seen[:, :, m:]], 2)
            positions = (stable + i)[:, None].expand(n, t)
        out, (k, v) = self.drafter(self.embed(tokens), hidden, positions, past=views[0] if views else None, mask=mask)
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
        if self.mode == "tree":
            self._tree_round(rows)
        else:
            self._chain_round(rows)

    def _catch_up(self, n: int, tokens: list[list[int]], hidden: torch.Tensor) -> None:
        """Every row's stable entries for its committed ``tokens`` (their features ``hidden`` [n, >= m, L * H], in
        order), and its new root."""
        m = max(len(a) for a in tokens)
        ids = to_device(torch.tensor([a + [0] * (m - len(a)) for a in tokens], dtype=torch.long), hidden.device)
        out = self._feed(0, ids, self.drafter.fuse(hidden[:, :m]), widths=[len(a) for a in tokens])
        last = to_device(torch.tensor([len(a) - 1 for a in tokens]), out.device)
        self.roots[:n] = out[torch.arange(n, device=out.device), last]

    def _tree_round(self, rows: list[Row]) -> None:
        n, dev = len(rows), self.roots.device
        stable = list(self.cache.lengths)
        at = to_device(torch.tensor(stable, dtype=torch.long), dev)

        def level(i: int, toks: torch.Tensor, hidden: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
            return self._feed(0, toks, hidden, level=(at, i, seen))

        levels = self.depth + 1
        (parent, depth, rank, labels), width = dynamic_tree(self.drafter, self.roots[:n], levels, self.top_k,
                                                             self.total_tokens, level)
        self.cache.set_lengths(stable)  # the tree's entries leave
        buf = device_buffers(parent, depth, rank, width, levels)
        last = to_device(torch.tensor([[r.last] for r in rows], dtype=torch.long), dev)
        base = list(self.target.lengths)
        logits, hidden = self.target.forward(torch.cat([last, labels[:, 1:]], 1), depths=depth, attend=buf.attend,
                                             hidden_layer=self.layers)
        verdicts = verify_trees(buf, labels, logits, self.s, self.gen)
        paths = [path for path, _ in verdicts]
        self.target.keep_rows(base, paths)
        m = max(map(len, paths))
        idx = to_device(torch.tensor([p + [p[-1]] * (m - len(p)) for p in paths]), dev)
        self._catch_up(n, [tokens for _, tokens in verdicts],
                       hidden.gather(1, idx[..., None].expand(n, m, hidden.shape[-1])))
        for r, (_, tokens) in zip(rows, verdicts):
            r.commit(tokens, labels.shape[1] - 1)

    def _chain_round(self, rows: list[Row]) -> None:
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
        self._catch_up(n, acc, hidden)
