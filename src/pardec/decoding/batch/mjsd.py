"""``mjsd`` over a batch (and ``mjgd``, the target's own beam search it approximates: :class:`BatchedMJGD`): every
request's draft beams searched together, every request's verified beams checked by the joint-likelihood rule after
one target forward.

A round, as batch-1 ``mjsd`` runs it for one request (:mod:`pardec.decoding.mjsd`):

1. the draft model is fed what it lacks of each request (one forward for all rows), then one beam search (or beam
   sampling) of ``gamma`` steps runs for every request at once (:func:`~pardec.decoding.drafting.beam_rows`, one
   host read at its end). The beams live in no cache: at step ``s`` each request's row is fed its ``num_beams``
   beams' ``s`` tokens as one tree forward (each beam a chain of its own after the request's cached prefix), and the
   row's cache is cut back to its prefix after it. That costs ``num_beams * s`` draft tokens at step ``s`` where
   batch-1's branches cost ``num_beams`` (it keeps every fed beam node in its cache), and needs one draft cache row per
   request.
2. each request's ``width`` best beams merged into a trie, the tries padded to one size
   (:func:`~pardec.decoding.batch.verify.padded_trees`), one target forward under each row's own mask; the ratio's
   log-probabilities and the target's token after every node of every row in one host read; each row's node picked
   by the joint rule on the host (:func:`~pardec.decoding.mjsd.pick_joint`), as batch-1 picks it.
3. the target's cache compacted to each row's accepted path; the draft's rows catch up next round.

A row with less room than the batch's longest search (its last rounds) takes the beams its search had after its own
number of steps: a beam search's first steps do not depend on the later ones, so they are the beams batch-1 searches
for it. ``exactness = "approximate"``, as batch-1's: each row's output is batch-1 ``mjsd``'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch

from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.batch.methods import catch_up_rows
from pardec.decoding.drafting import beam_rows, beams_of
from pardec.decoding.mjsd import check_mjgd, check_mjsd, draft_logq, pick_joint, scoring_of, target_logp
from pardec.decoding.sampling import select
from pardec.decoding.tree import Tree
from pardec.models.ragged import RaggedModel


def chains_after(model: RaggedModel, held: list[int]) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """:func:`~pardec.decoding.drafting.beam_rows`'s ``feed`` over a ragged batch whose rows hold ``held`` positions:
    at step ``s`` each row is fed its beams' ``s`` tokens so far, each beam a chain of its own after the row's
    prefix (one tree forward, a block-diagonal mask), and cut back to ``held`` after it; no beam stays in the
    cache."""
    paths: list[torch.Tensor] = []  # the beams' tokens so far [n, B, s]

    def feed(tokens: torch.Tensor, parents: torch.Tensor, step: int) -> torch.Tensor:
        n, beams = tokens.shape
        dev = tokens.device
        if paths:
            old = paths.pop()
            tokens = torch.cat([old.gather(1, parents[..., None].expand(n, beams, old.shape[2])), tokens[..., None]], 2)
        else:
            tokens = tokens[..., None]
        paths.append(tokens)
        s = tokens.shape[2]
        chain = torch.ones(s, s, dtype=torch.bool, device=dev).tril()
        attend = torch.block_diag(*[chain] * beams)
        depths = torch.arange(s, device=dev).repeat(beams)
        at = (torch.arange(beams, device=dev) * s + s - 1)[None].expand(n, beams)
        logits = model.forward(tokens.reshape(n, beams * s), depths=depths, attend=attend, logits_at=at)
        model.set_lengths(held)  # the beams' entries leave
        return logits

    return feed


@register_batched("mjsd")
class BatchedMJSD(BatchedMethod):
    """``gamma``, ``num_beams``, ``width``, ``tau``, ``top_k``, ``top_p``, ``ratio``: as batch-1 ``mjsd``'s."""

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 4, num_beams: int = 8, width: int = 1,
                 tau: float = 0.1, top_k: int = 20, top_p: float = 0.9, ratio: Literal["warped", "raw"] = "warped"):
        super().__init__(target, tokenizer, draft)
        check_mjsd(gamma, num_beams, width, tau, top_k, top_p, ratio)
        self.gamma, self.num_beams, self.verified, self.tau = gamma, num_beams, width, tau
        self.top_k, self.top_p, self.ratio = top_k, top_p, ratio

    def _search(self, rows: list[Row], ns: list[int]):
        """Every request's beams of ``ns[b]`` tokens (best first), searched together."""
        first, fed = catch_up_rows(self.draft, rows)
        scoring = scoring_of(self.s, self.top_k, self.top_p)
        tables = beam_rows(first, max(ns), self.num_beams, chains_after(self.draft, fed),
                           self.s if self.s.greedy else scoring, self.gen, scoring.temperature, weights=scoring)
        return [beams_of(t[:nb]) if nb else [] for t, nb in zip(tables, ns)], scoring

    def round(self, rows: list[Row]) -> None:
        n, dev = len(rows), self.target.device
        ns = [max(0, min(self.gamma, r.out.room - 1)) for r in rows]  # the target adds one token of its own
        m = max(ns)
        if m == 0:
            self.verify(rows, torch.zeros(n, 0, dtype=torch.long), ns)
            return
        beams, scoring = self._search(rows, ns)
        warped = self.ratio == "warped"
        trees, logqs = [], []
        for bs in beams:
            verified = bs[: self.verified]
            tree = Tree.from_paths([b.tokens for b in verified])
            logq = draft_logq(verified, warped)
            trees.append(tree)
            logqs.append({i: logq[tree.label_path(i)] for i in range(1, len(tree))})
        buf, labels, base, logits = self.forward_trees(rows, trees, self.gamma)  # [n, N, V]
        size = labels.shape[1]
        logp = target_logp(logits, scoring, warped)  # [n, N, V]
        by_row = torch.arange(n, device=dev)[:, None]
        steps = logp[by_row, buf.parent[:, 1:], labels[:, 1:].clamp(min=0)].double()  # [n, N - 1]
        nxt = select(logits, self.s, self.gen).double()  # [n, N] the target's token after every node
        read = torch.cat([steps, nxt], 1).tolist()  # the round's verification read
        log_tau = math.log(self.tau) if self.tau > 0 else -math.inf
        paths, committed = [], []
        for tree, logq, got in zip(trees, logqs, read):
            node = pick_joint(tree, got[: len(tree) - 1], logq, log_tau)
            path = tree.path_to(node)
            paths.append(path)
            committed.append([int(tree.labels[j]) for j in path[1:]] + [int(got[size - 1 + node])])
        self.target.keep_rows(base, paths)
        for r, tokens, nb in zip(rows, committed, ns):
            r.commit(tokens, nb)


@register_batched("mjgd")
class BatchedMJGD(BatchedMethod):
    """``K``, ``num_beams``: as batch-1 ``mjgd``'s. Each round every row's target beam search of ``K`` tokens runs
    together (:func:`chains_after` over the target: its beams are fed as chains and leave the cache), then each row
    commits its best beam; its tokens enter the cache with the next round's first forward, which also gives the
    next search's first distribution (batch-1 keeps the chosen beam's nodes instead). Target forwards per round: one
    plus one per beam step, as batch-1 counts them."""

    def __init__(self, target, tokenizer=None, draft=None, K: int = 4, num_beams: int = 4):
        super().__init__(target, tokenizer, draft)
        check_mjgd(K, num_beams)
        self.K, self.num_beams = K, num_beams

    def round(self, rows: list[Row]) -> None:
        ks = [min(self.K, r.out.room) for r in rows]
        first, held = catch_up_rows(self.target, rows)  # the rows' last committed tokens
        temp = 1.0 if self.s.greedy else self.s.temperature
        tables = beam_rows(first, max(ks), self.num_beams, chains_after(self.target, held), self.s, self.gen, temp)
        for r, table, k in zip(rows, tables, ks):
            r.commit(beams_of(table[:k])[0].tokens)
            r.forwards += k - 1  # the beam steps (the commit counted the first forward)
