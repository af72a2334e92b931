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

from pardec.config import SamplingConfig
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.lookahead import LookaheadState
from pardec.decoding.ngram import LookaheadWindow, candidate_tree, lookahead_inputs
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree
from pardec.models.cache import to_device
from pardec.models.ragged import RaggedModel


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


def forward_rows(model: RaggedModel, made: list[tuple[list[int], list[int], torch.Tensor, list[int]] | None]
                 ) -> torch.Tensor:
    """One forward of every row's new tokens under its own mask (``made[b]``: the tokens, offsets, attend and read
    columns of :func:`~pardec.decoding.ngram.lookahead_inputs`; None: the row takes no part), the rows padded to the
    widest (a padded position sees only the cache and itself, and nothing reads it). Returns the logits at each
    row's read columns [n, K, V] (padded columns: column 0's)."""
    n = len(made)
    t = max(len(m[0]) for m in made if m is not None)
    k = max(len(m[3]) for m in made if m is not None)
    ids = torch.zeros(n, t, dtype=torch.long)
    depths = torch.zeros(n, t, dtype=torch.long)
    attend = torch.eye(t, dtype=torch.bool).repeat(n, 1, 1)  # padding: the cache and itself
    at = torch.zeros(n, k, dtype=torch.long)
    for b, m in enumerate(made):
        if m is None:
            continue
        toks, offs, att, wanted = m
        w = len(toks)
        ids[b, :w], depths[b, :w], attend[b, :w, :w] = torch.tensor(toks), torch.tensor(offs), att
        at[b, : len(wanted)] = torch.tensor(wanted)
    dev = model.device
    return model.forward(ids, depths=to_device(depths, dev), attend=to_device(attend, dev),
                         logits_at=to_device(at, dev))


def read_verdicts(trees: list[Tree | None], wanted: list[list[int] | None], logits: torch.Tensor, lead: list[int],
                  s: SamplingConfig, gen: torch.Generator | None) -> list[tuple[list[int], list[int], list[int]] | None]:
    """Each row's (accepted path of its tree, root first; committed tokens; the window's next guesses) from
    :func:`forward_rows`' ``logits``: greedy, one host read for every row; sampled, each row's tree through
    :func:`~pardec.decoding.verify.verify_tree` (one read per row: the trees differ in shape). The guesses are the
    argmax at the window's top level (``lead``: ``[0]`` when it holds the root, level 2), under greedy and sampling
    alike, as batch-1 lookahead takes them. A row without a tree (None) gets None."""
    if s.greedy:
        pred = logits.argmax(-1).tolist()  # the one host read
        out = []
        for tree, w, p in zip(trees, wanted, pred):
            if tree is None:
                out.append(None)
                continue
            path, tokens = greedy_path(tree, p[: len(tree)])
            out.append((path, tokens, [p[i] for i in lead] + p[len(tree) : len(w)]))
        return out
    out = []
    for b, (tree, w) in enumerate(zip(trees, wanted)):
        if tree is None:
            out.append(None)
            continue
        cols = to_device(torch.tensor(lead + list(range(len(tree), len(w))), dtype=torch.long), logits.device)
        v = verify_tree(tree, logits[b, : len(tree)], s, gen, extra=logits[b, cols].argmax(-1))
        out.append((v.path, v.tokens, v.extra))
    return out


@register_batched("lookahead")
class BatchedLookahead(LookaheadState, BatchedMethod):
    """``level``, ``window``, ``guess_set``, ``pool_from_prompt``, ``pool_from_output``: as batch-1 ``lookahead``'s."""

    def __init__(self, target, tokenizer=None, draft=None, level: int = 5, window: int = 15, guess_set: int = 15,
                 pool_from_prompt: bool = False, pool_from_output: bool = False):
        super().__init__(target, tokenizer, draft)
        self.set_lookahead(level, window, guess_set, pool_from_prompt, pool_from_output)

    def admit(self, row: Row) -> None:
        super().admit(row)
        row.state["pool"], row.state["window"] = self.begin_request(row.prompt, self.s.seed)

    def _inputs(self, row: Row) -> tuple[Tree, list[int], list[int], torch.Tensor, list[int]]:
        """Row ``row``'s (trie, new tokens, their offsets from its length, attend among them, the columns whose
        logits verification and the window read: the trie's nodes, then the window's top level)."""
        tree = candidate_tree(row.state["pool"], row.last, self.guess_set, row.out.room - 1)  # the target adds one
        return (tree, *lookahead_inputs([row.last], tree, row.state["window"]))

    def round(self, rows: list[Row]) -> None:
        made = [self._inputs(r) for r in rows]
        base = list(self.target.lengths)
        logits = forward_rows(self.target, [m[1:] for m in made])  # [n, K, V]
        lead = [0] if rows[0].state["window"].top_has_root else []  # (the same for every row: level == 2)
        verdicts = read_verdicts([m[0] for m in made], [m[4] for m in made], logits, lead, self.s, self.gen)
        self.target.keep_rows(base, [path for path, _, _ in verdicts])
        for r, (tree, *_), (_, tokens, top) in zip(rows, made, verdicts):
            root = r.last
            win: LookaheadWindow = r.state["window"]
            before = len(r.out.tokens)
            r.commit(tokens, len(tree) - 1)
            win.update(top, r.state["pool"], root=root)
            self.pool_output(r.state["pool"], r.prompt, r.out.tokens, len(r.out.tokens) - before)
