"""``ouroboros`` over a batch: every request's draft runs lookahead decoding itself in its own row of the draft
model's ragged cache, every request's draft and pool phrases are verified as a tree in one target forward.

A round, as batch-1 ``ouroboros`` runs it for one request (:mod:`pardec.decoding.ouroboros`):

1. **Drafting**: draft forwards until every row holds its ``gamma`` tokens (cut to the room left). Each forward
   feeds every row still drafting what its draft row lacks of its sequence (the committed tokens and its drafts so
   far), the trie of pool phrases after its last token and its own lookahead window
   (:func:`~pardec.decoding.ngram.lookahead_inputs`, each row under its own mask; a row done drafting takes no part:
   one padding position, dropped); the draft's own verification keeps each row's accepted path
   (:func:`~pardec.decoding.batch.lookahead.read_verdicts`: greedy, one host read for every row; sampled, one per
   row, each token an exact sample from the draft's warped distribution, recorded as ``q``), and each row's window
   moves on and fills the pool. Rows finish drafting at different forwards: one that accepted pool phrases needs
   fewer.
2. **Lengthening and verification**: each row's tree (its draft chain, then its ``top_k_phrases`` pool phrases
   after the draft's last token) padded to the largest (:func:`~pardec.decoding.batch.verify.padded_trees`) and
   verified in one target forward. Greedy: the target's argmax at every node in one host read, each row's path
   walked on the host: every row's output equals its batch-1 ``ar`` output. Sampled: each row's tree through
   :func:`~pardec.decoding.verify.verify_tree` with ``q`` on the draft chain (one read per row): each row follows
   the target's distribution.
3. **Phrases from verification**: each row's phrases refined and its rejected suffix harvested into the pool, as
   batch-1 does (:class:`~pardec.decoding.ouroboros.OuroborosState`).

The pool: with ``warm_start`` (the paper's full method) one pool for the whole run, which every request's window,
harvest and refinement feed and every request's lengthening reads (so a request's speed depends on its neighbours
as batch-1's depends on the prompts before it; its greedy tokens never do); without it, a pool per request, so each
row drafts, lengthens and accepts as batch-1 ``ouroboros`` does for its prompt alone.
"""

from __future__ import annotations

import torch

from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.batch.lookahead import forward_rows, greedy_path, read_verdicts
from pardec.decoding.ngram import NGramPool, candidate_tree, lookahead_inputs
from pardec.decoding.ouroboros import OuroborosState
from pardec.decoding.sampling import warp
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree


def shared_prefix(a: list[int], b: list[int], most: int) -> int:
    """The length of the longest common prefix of ``a`` and ``b``, at most ``most``."""
    n = min(len(a), len(b), most)
    return next((i for i in range(n) if a[i] != b[i]), n)


@register_batched("ouroboros")
class BatchedOuroboros(OuroborosState, BatchedMethod):
    """Every parameter as batch-1 ``ouroboros``'s (:class:`~pardec.decoding.ouroboros.OuroborosState`).
    ``draft_forwards``: the draft forwards the method ran (one per drafting step of the whole batch)."""

    draft_forwards = 0

    def admit(self, row: Row) -> None:
        super().admit(row)  # the draft's row holds the prompt
        row.state["held"] = list(row.prompt)  # the tokens of the draft row's cache, on the host
        row.state["window"] = self.new_window(row.prompt, self.s.seed)
        if not self.warm_start:
            row.state["pool"] = NGramPool(self.level, self.guess_set)

    def pool_of(self, row: Row) -> NGramPool:
        return self.pool if self.warm_start else row.state["pool"]

    # ------------------------------------------------------------------------------------------- drafting
    def _draft(self, rows: list[Row], ks: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Up to ``ks[b]`` draft tokens per row after its committed sequence: (tokens, ``q`` per token: empty under
        greedy)."""
        n = len(rows)
        toks: list[list[int]] = [[] for _ in rows]
        qs: list[list[torch.Tensor]] = [[] for _ in rows]
        while True:
            todo = [b for b in range(n) if len(toks[b]) < ks[b]]
            if not todo:
                return toks, qs
            lengths = list(self.draft.lengths)
            made: list[tuple | None] = [None] * n
            trees: list[Tree | None] = [None] * n
            feeds: dict[int, tuple[list[int], list[int]]] = {}
            for b in todo:
                r = rows[b]
                seq = r.prompt + r.out.tokens + toks[b]
                lengths[b] = keep = shared_prefix(r.state["held"], seq, len(seq) - 1)  # feed at least the last token
                feed = seq[keep:]
                room = ks[b] - len(toks[b]) - 1  # the draft's own verification adds one token
                window = r.state["window"]
                trees[b] = (candidate_tree(self.pool_of(r), feed[-1], self.guess_set, room) if window is not None
                            else Tree.chain([]))
                made[b] = lookahead_inputs(feed, trees[b], window)
                feeds[b] = (seq, feed)
            self.draft.set_lengths(lengths)
            base = list(self.draft.lengths)
            logits = forward_rows(self.draft, made)
            self.draft_forwards += 1
            window = rows[todo[0]].state["window"]
            lead = [0] if window is not None and window.top_has_root else []  # (every row's window alike)
            verdicts = read_verdicts(trees, [None if m is None else m[3] for m in made], logits, lead, self.s,
                                     self.gen)
            paths = []
            for b, v in enumerate(verdicts):
                if v is None:  # (its padding position leaves again below)
                    paths.append([0])
                    continue
                path, tokens, top = v
                seq, feed = feeds[b]
                r = rows[b]
                paths.append(list(range(len(feed) - 1)) + [len(feed) - 1 + i for i in path])
                r.state["held"] = seq + tokens[:-1]
                if r.state["window"] is not None:
                    r.state["window"].update(top, self.pool_of(r), root=feed[-1])
                toks[b] += tokens
                if not self.s.greedy:  # each token an exact sample from q at its parent node
                    qs[b] += [warp(logits[b, i], self.s) for i in path]
            self.draft.keep_rows(base, paths)
            self.draft.set_lengths([n_b if v is not None else b0
                                    for n_b, b0, v in zip(self.draft.lengths, base, verdicts)])
            for b in todo:
                toks[b], qs[b] = toks[b][: ks[b]], qs[b][: ks[b]]

    # ------------------------------------------------------------------------------------------- rounds
    def round(self, rows: list[Row]) -> None:
        rooms = [r.out.room - 1 for r in rows]  # the target adds one token of its own
        ks = [max(0, min(self.gamma, room)) for room in rooms]
        toks, qs = self._draft(rows, ks) if max(ks) else ([[] for _ in rows], [[] for _ in rows])
        trees, wholes = [], []
        for r, t, room in zip(rows, toks, rooms):
            pool = self.pool_of(r)
            phrases = self.lengthening_phrases(pool, t, room - len(t)) if t else []
            wholes.append(self.whole_phrases(pool, t, phrases) if t else [])
            trees.append(Tree.from_paths([t] + [t + list(p) for p in phrases]))  # nodes 1..k: the draft chain
        _, _, base, logits = self.forward_trees(rows, trees)
        if self.s.greedy:
            verdicts = []
            for t, p in zip(trees, logits.argmax(-1).tolist()):  # the round's one host read
                path, tokens = greedy_path(t, p[: len(t)])
                verdicts.append((path, tokens, p[: len(t)]))
        else:
            verdicts = []
            for b, (t, q) in enumerate(zip(trees, qs)):
                v = verify_tree(t, logits[b, : len(t)], self.s, self.gen, {i: x for i, x in enumerate(q)} or None,
                                extra=logits[b, : len(t)].argmax(-1))
                verdicts.append((v.path, v.tokens, v.extra))
        self.target.keep_rows(base, [path for path, _, _ in verdicts])
        for r, t, tree, whole, (_, tokens, pred) in zip(rows, toks, trees, wholes, verdicts):
            if t:
                self.learn(self.pool_of(r), tree, t, whole, pred, len(tokens) - 1)
            r.commit(tokens, len(t))
