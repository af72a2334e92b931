"""``lookahead`` over a batch: each row keeps its own window and n-gram pool (:mod:`pardec.decoding.lookahead`'s,
seeded per request as batch-1 seeds them), and every row's candidate trie and window go through one target forward,
each row under its own mask (the tries differ per row, so the new tokens are padded to the widest row; a padded
position sees only the cache and itself, and nothing reads it). The accepted path stays in each row's cache
(:meth:`~pardec.models.ragged.RaggedModel.keep_rows`), the window advances with the target's argmax at its top level
and the pool takes the n-grams it completes, as batch-1 ``lookahead`` does.

Greedy: one host read per round for the whole batch (the argmax of every row's tree nodes and window), each row's
path then walked on the host: every row's output equals its batch-1 ``ar`` output. Sampled: each row's tree goes
through :func:`~pardec.decoding.verify.verify_tree` (the target's distribution, per row), one host read per row:
the rows' tries differ in shape, which the batch's tree rule (:func:`~pardec.decoding.batch.verify.verify_trees`,
one shape for all rows) does not take."""

from __future__ import annotations

import torch

from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.lookahead import LookaheadState
from pardec.decoding.ngram import LookaheadWindow, candidate_tree
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree
from pardec.models.cache import to_device


def greedy_path(tree: Tree, pred: list[int]) -> tuple[list[int], list[int]]:
    """(the accepted path's nodes, root first; the committed tokens) of ``tree`` under greedy verification, from
    the target's argmax after each node (``pred``, host ids): a child is accepted when its token is its parent's
    argmax (siblings are distinct, so at most one is), then the argmax after the path's last node."""
    path = [0]
    while True:
        node = path[-1]
        nxt = next((c for c in tree.children[node] if tree.labels[c] == pred[node]), None)
        if nxt is None:
            return path, [tree.labels[c] for c in path[1:]] + [pred[node]]
        path.append(nxt)


@register_batched("lookahead")
class BatchedLookahead(LookaheadState, BatchedMethod):
    """``level``, ``window``, ``guess_set``, ``pool_from_prompt``, ``pool_from_output``: as batch-1 ``lookahead``'s."""

    def __init__(self, target, tokenizer=None, draft=None, level: int = 5, window: int = 15, guess_set: int = 15,
                 pool_from_prompt: bool = False, pool_from_output: bool = False):
        super().__init__(target, tokenizer, draft)
        self.set_lookahead(level, window, guess_set, pool_from_prompt, pool_from_output)

    @property
    def width(self) -> int:
        # the trie (root + guess_set candidates of level - 1 tokens) and the window (level 0's W + N - 3 guesses
        # and W per level above it)
        n, w = self.level, self.window
        return 1 + self.guess_set * (n - 1) + (w + n - 3) + (n - 2) * w

    def admit(self, row: Row) -> None:
        super().admit(row)
        row.state["pool"], row.state["window"] = self.begin_request(row.prompt, self.s.seed)

    def _inputs(self, row: Row) -> tuple[Tree, list[int], list[int], torch.Tensor, list[int]]:
        """Row ``row``'s (trie, new tokens, their offsets from its length, attend among them, the columns whose
        logits verification and the window read: the trie's nodes, then the window's top level)."""
        tree = candidate_tree(row.state["pool"], row.last, self.guess_set, row.out.room - 1)  # the target adds one
        win: LookaheadWindow = row.state["window"]
        n = len(tree)
        w_tokens, w_pos, w_attend = win.inputs(0)  # (offsets: the root sits at the row's length)
        attend = torch.zeros(n + len(w_tokens), n + len(w_tokens), dtype=torch.bool)
        attend[:n, :n] = tree.attend
        attend[n:, 0] = True  # the window sees the root
        attend[n:, n:] = w_attend
        top = win.top()
        wanted = list(range(n)) + [n + i for i in range(top.start, top.stop)]
        return tree, tree.tokens(row.last).tolist() + w_tokens, tree.positions(0).tolist() + w_pos, attend, wanted

    def round(self, rows: list[Row]) -> None:
        made = [self._inputs(r) for r in rows]
        t = max(len(m[1]) for m in made)
        k = max(len(m[4]) for m in made)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        depths = torch.zeros(len(rows), t, dtype=torch.long)
        attend = torch.eye(t, dtype=torch.bool).repeat(len(rows), 1, 1)  # padding: the cache and itself
        at = torch.zeros(len(rows), k, dtype=torch.long)
        for b, (_, toks, offs, att, wanted) in enumerate(made):
            m = len(toks)
            ids[b, :m], depths[b, :m], attend[b, :m, :m] = torch.tensor(toks), torch.tensor(offs), att
            at[b, : len(wanted)] = torch.tensor(wanted)
        dev = self.target.device
        base = list(self.target.lengths)
        logits = self.target.forward(ids, depths=to_device(depths, dev), attend=to_device(attend, dev),
                                     logits_at=to_device(at, dev))  # [n, K, V]
        # the window's next guesses: the target's argmax at its top level (the root's first when the top level
        # holds the root: level 2), as batch-1 lookahead takes them under greedy and sampling alike
        lead = [0] if rows[0].state["window"].top_has_root else []  # (the same for every row: level == 2)
        if self.s.greedy:
            pred = logits.argmax(-1).tolist()  # the round's one host read
            verdicts = []
            for (tree, *_, wanted), p in zip(made, pred):
                path, tokens = greedy_path(tree, p[: len(tree)])
                verdicts.append((path, tokens, [p[i] for i in lead] + p[len(tree) : len(wanted)]))
        else:
            verdicts = []
            for b, (tree, *_, wanted) in enumerate(made):
                cols = to_device(torch.tensor(lead + list(range(len(tree), len(wanted)))), dev)
                v = verify_tree(tree, logits[b, : len(tree)], self.s, self.gen, extra=logits[b, cols].argmax(-1))
                verdicts.append((v.path, v.tokens, v.extra))
        self.target.keep_rows(base, [path for path, _, _ in verdicts])
        for r, (tree, *_), (_, tokens, top) in zip(rows, made, verdicts):
            root = r.last
            win: LookaheadWindow = r.state["window"]
            before = len(r.out.tokens)
            r.commit(tokens, len(tree) - 1)
            win.update(top, r.state["pool"], root=root)
            self.pool_output(r.state["pool"], r.prompt, r.out.tokens, len(r.out.tokens) - before)
