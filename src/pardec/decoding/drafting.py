"""Draft-side primitives shared by the methods that draft with a model (``sps``, ``bild``, ``mjsd``, ``mjgd``,
``spectr``); the verification side is :mod:`pardec.decoding.verify`.

* :func:`catch_up`: the draft's cache resynchronised with the committed sequence, and its next-token logits.
* :func:`draft_chain`: ``k`` tokens after the committed sequence, one forward each, in the model's own cache
  (after :func:`catch_up`); an optional ``stop`` test ends the chain early (BiLD's fallback: before the unsure
  token, or after it with ``keep_unsure``, as MJSD's BiLD baseline does).
* :class:`Branches`: several continuations of one cached prefix grown side by side in one cache (beams,
  i.i.d. draft sequences): every new token sees the prefix and its own branch's earlier tokens only, at
  position ``prefix + depth``; afterwards one branch's path is kept (:meth:`Branches.keep`) and the rest
  dropped, so the cache again holds a single sequence.
* :func:`beam_search`: beam search (greedy) or beam sampling over :class:`Branches`, each beam carrying the
  joint log-likelihood of every one of its prefixes and the probability with which beam sampling selected each of
  them (MJSD's q), reordered with the beam indices at every step. It runs on the device (each step one layer of
  :meth:`Branches.grow_layer`) and reads the host once, at its end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pardec.config import SamplingConfig
from pardec.decoding.sampling import sample, sample_without_replacement, warp
from pardec.models.cached import CachedModel, to_device


@dataclass
class DraftChain:
    tokens: torch.Tensor  # [m] long, m <= k, on the draft's device
    q: torch.Tensor | None  # [m, V] the warped distributions the tokens were sampled from (None under greedy)
    forwards: int  # draft forwards run
    stopped: bool = False  # the ``stop`` test ended the chain (BiLD's fallback)


def confidence(logits: torch.Tensor, warped: SamplingConfig | None = None) -> torch.Tensor:
    """The draft's confidence in its next token: the largest probability of ``logits`` [..., V] (plain softmax, or
    the distribution ``warped`` warps). Returns [...] on their device."""
    probs = warp(logits, warped) if warped is not None else torch.softmax(logits.float(), -1)
    return probs.max(-1).values


def catch_up(draft: CachedModel, seq: list[int]) -> torch.Tensor:
    """Resynchronise ``draft``'s cache with ``seq`` (prompt + committed: :meth:`CachedModel.sync` keeps the
    common prefix) in one forward; returns its logits [V] for the token after ``seq``."""
    feed = draft.sync(seq)
    return draft.forward(torch.tensor([feed]), last_only=True).logits[0, -1]


def draft_chain(draft: CachedModel, seq: list[int], k: int, s: SamplingConfig, gen: torch.Generator | None,
                stop: Callable[[torch.Tensor], bool] | None = None, keep_unsure: bool = False) -> DraftChain:
    """Draft up to ``k`` tokens after ``seq`` (prompt + committed): the argmax under greedy decoding, else a
    sample from the draft's warped distribution. ``stop(logits [V])`` is asked before each token is chosen; True
    ends the chain there: the logits' token is not drafted, or with ``keep_unsure`` it is drafted and is the
    chain's last. The last drafted token is not fed."""
    logits = catch_up(draft, seq)
    forwards = 1
    toks: list[torch.Tensor] = []  # [1] each, on the draft's device: never read back here
    qs: list[torch.Tensor] = []
    stopped = False
    for i in range(k):
        stopped = stop is not None and stop(logits)
        if stopped and not keep_unsure:
            break
        if s.greedy:
            x = logits.argmax(-1, keepdim=True)
        else:
            q = warp(logits, s)
            x = sample(q, gen)
            qs.append(q)
        toks.append(x)
        if stopped or i == k - 1:
            break
        logits = draft.forward(x[None]).logits[0, -1]
        forwards += 1
    tokens = torch.cat(toks) if toks else torch.zeros(0, dtype=torch.long, device=logits.device)
    return DraftChain(tokens, torch.stack(qs) if qs else None, forwards, stopped)


UNSETTLED = -2  # a Branches parent not known on the host yet (grow_layer before settle_layers)


class Branches:
    """Branches grown from the prefix cached in ``model`` (its length now is the branches' base).

    Node ``i`` is the ``i``-th token fed through :meth:`grow` or :meth:`grow_layer`; its parent is another node or
    ``-1`` (the prefix). The cache holds the nodes in feeding order after the prefix."""

    def __init__(self, model: CachedModel):
        self.model = model
        self.base = model.length
        self.parents: list[int] = []
        self.depths: list[int] = []
        self.forwards = 0
        self._layers: list[int] = []  # first node of each layer grown by grow_layer since its root, until settled
        self._layer: torch.Tensor | None = None  # the last layer's attention rows, on the device

    def path(self, node: int) -> list[int]:
        """Nodes from the branch's first token down to ``node`` (empty for -1, the prefix)."""
        out = []
        while node != -1:
            if self.parents[node] == UNSETTLED:
                raise ValueError(f"node {node} was grown by grow_layer and not settled (settle_layers)")
            out.append(node)
            node = self.parents[node]
        return out[::-1]

    def grow(self, tokens: list[int] | torch.Tensor, parents: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Feed ``tokens`` [n] (host values, or a tensor left on its device), token ``i`` continuing node
        ``parents[i]``, in one forward. Returns (logits [n, V] after each token, their node ids)."""
        if len(tokens) != len(parents) or len(tokens) == 0:
            raise ValueError(f"grow needs one parent per token, got {len(tokens)} tokens and {len(parents)} parents")
        old, n, base = len(self.parents), len(tokens), self.base
        attend = torch.zeros(n, base + old + n, dtype=torch.bool)
        attend[:, :base] = True
        positions = []
        for i, p in enumerate(parents):
            if not -1 <= p < old:
                raise ValueError(f"parent {p} is not a node (0..{old - 1}) or -1 (the prefix)")
            attend[i, [base + j for j in self.path(p)]] = True
            attend[i, base + old + i] = True
            depth = self.depths[p] + 1 if p >= 0 else 0
            positions.append(base + depth)
            self.parents.append(p)
            self.depths.append(depth)
        ids = tokens.view(1, -1) if isinstance(tokens, torch.Tensor) else torch.tensor([tokens])
        logits = self.model.forward(ids, positions=torch.tensor(positions), attend=attend).logits[0]
        self.forwards += 1
        return logits, list(range(old, old + n))

    def grow_layer(self, tokens: torch.Tensor, rows: torch.Tensor | None, root: int = -1) -> torch.Tensor:
        """Feed a layer of ``tokens`` [n] (on the device) one deeper than their parents, in one forward and without a
        host read: token ``i`` continues node ``rows[i]`` of the layer grown last (a device tensor of indices into
        it), or with ``rows`` None node ``root`` (a settled node or -1, the prefix). Returns the logits [n, V]. The new
        nodes get the next ids in order; their parents are unknown on the host until :meth:`settle_layers`."""
        n, old, base = tokens.numel(), len(self.parents), self.base
        dev = tokens.device
        attend = torch.zeros(n, base + old + n, dtype=torch.bool, device=dev)
        if rows is None:
            attend[:, :base] = True
            path = self.path(root)
            if path:
                attend.index_fill_(1, to_device(torch.tensor([base + j for j in path]), dev), True)  # (no sync)
            depth = self.depths[root] + 1 if root >= 0 else 0
            self._layers = []
        else:
            if not self._layers:
                raise ValueError("grow_layer with rows needs a layer grown before it (rows=None starts one)")
            attend[:, :self._layer.shape[1]] = self._layer[rows]
            depth = self.depths[-1] + 1
        attend[:, base + old:] = torch.eye(n, dtype=torch.bool, device=dev)
        self._layer = attend
        self._layers.append(old)
        self.parents.extend([root if rows is None else UNSETTLED] * n)
        self.depths.extend([depth] * n)
        positions = torch.full((n,), base + depth, dtype=torch.long, device=dev)
        logits = self.model.forward(tokens.view(1, -1), positions=positions, attend=attend).logits[0]
        self.forwards += 1
        return logits

    def settle_layers(self, rows: list[list[int]]) -> list[int]:
        """The parents of the layers grown by :meth:`grow_layer` since ``rows=None``, as host values: ``rows[k]`` the
        parent rows of layer ``k + 1`` (the first layer hangs from its root). Returns every such layer's first node
        id (node ``first + i`` is the layer's token ``i``)."""
        firsts = self._layers
        if len(rows) != max(len(firsts) - 1, 0):
            raise ValueError(f"settle_layers needs the parent rows of {max(len(firsts) - 1, 0)} layers, got {len(rows)}")
        for k in range(1, len(firsts)):  # the first layer's parent, its root, is known
            end = firsts[k + 1] if k + 1 < len(firsts) else len(self.parents)
            for i, node in enumerate(range(firsts[k], end)):
                self.parents[node] = firsts[k - 1] + rows[k - 1][i]
        self._layers, self._layer = [], None
        return firsts

    def keep(self, node: int, tokens: list[int] | None = None) -> None:
        """Keep the path from the prefix to ``node`` (-1: the prefix alone) and drop every other branch. ``tokens``:
        the path's tokens as host values (e.g. from the verification's read), settled in the cache
        (:meth:`CachedModel.settle`) so that the next catch-up reads back nothing that was fed as device tensors."""
        path = self.path(node)
        if tokens is not None and len(tokens) != len(path):
            raise ValueError(f"keep: {len(tokens)} tokens for a path of {len(path)} nodes")
        self.model.keep(path, start=self.base)
        if tokens:
            self.model.settle(tokens)


@dataclass
class Beam:
    tokens: list[int] = field(default_factory=list)
    joint: list[float] = field(default_factory=list)  # joint[i] = log P(tokens[0..i]) under the scoring distribution
    # select[i] = log of the probability with which step i's draw of beam sampling picked tokens[0..i] among all the
    # step's candidates (every beam's kept tokens), see :func:`beam_search`
    select: list[float] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)  # Branches node of each fed token (all but possibly the last)

    @property
    def score(self) -> float:
        return self.joint[-1] if self.joint else 0.0


def beam_search(first_logits: torch.Tensor, steps: int, num_beams: int, branches: Branches, propose: SamplingConfig,
                gen: torch.Generator | None, temperature: float = 1.0, root: int = -1,
                weights: SamplingConfig | None = None) -> list[Beam]:
    """``steps`` tokens by beam search from ``first_logits`` [V] (the distribution after the prefix): :func:`beam_rows`
    for one prompt, every new token but the last step's fed as one layer of ``branches``
    (:meth:`Branches.grow_layer`; ``root``: the node the beams hang from), whose nodes the beams then record
    (:meth:`Branches.settle_layers` learns the fed nodes' parents from the search's one read). Returns the beams, best
    joint likelihood first."""

    def feed(tokens: torch.Tensor, rows: torch.Tensor, step: int) -> torch.Tensor:
        return branches.grow_layer(tokens[0], rows[0] if step else None, root)[None]

    table = beam_rows(first_logits[None], steps, num_beams, feed, propose, gen, temperature, weights)[0]
    firsts = branches.settle_layers([[int(r) for r in t[2]] for t in table[1:-1]])
    return beams_of(table, firsts)


def beam_rows(first_logits: torch.Tensor, steps: int, num_beams: int,
              feed: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], propose: SamplingConfig,
              gen: torch.Generator | None, temperature: float = 1.0, weights: SamplingConfig | None = None
              ) -> list[list[list[list[float]]]]:
    """A beam search of ``steps`` tokens for each of ``n`` prompts at once, from ``first_logits`` [n, V] (each
    prompt's distribution after its prefix).

    Each step expands every beam ``b`` with every token ``v``: candidate score ``score_b + log p_b(v)``, where
    ``p_b`` is the softmax of the beam's logits at ``temperature`` (the joint likelihood the beams carry).
    ``propose.greedy``: the ``num_beams`` best candidates (beam search). Otherwise beam sampling as HF's (and the
    MJSD code's) beam sampling does it: the top-k / top-p of ``propose`` remove tokens from each beam's candidates,
    the survivors keep their joint likelihood (not renormalised per beam), ``2 * num_beams`` candidates are drawn
    without replacement from one softmax over all beams' survivors, i.e. with probability ``w(b, v) / sum w`` where
    ``w(b, v) = exp(score_b) p_b(v)`` for a kept ``v`` and 0 otherwise, and the ``num_beams`` drawn ones with the best
    joint likelihood become the new beams. Every new beam records the log of that probability for its candidate (the
    probability of one draw, as the MJSD code's ``seq_scores``; under greedy decoding computed all the same, with
    ``weights``' top-k / top-p, None: none). ``feed(tokens, rows, step)`` [n, B] each: the new beams' tokens and the
    rows of the beams they extend; returns their logits [n, B, V] (called for every step but the last).

    The search runs on the device with one host read at its end. Returns per prompt its table: per step
    [joint, selection, parent row, token, real], each a list over the step's beams (:func:`beams_of` reads the beams
    from it). A candidate that cannot be a beam (an infinite joint likelihood under beam search, a weight of 0 under
    beam sampling: fewer candidates than beams) stays a row with score -inf, fed like the others and never picked
    again, and is dropped by :func:`beams_of`."""
    n = first_logits.shape[0]
    logits = first_logits[:, None]  # [n, B, V]
    score = torch.zeros(n, 1, device=first_logits.device)  # [n, B] joint log-likelihood of each beam
    steps_read = []  # per step: [n, 5, B] joint, selection, parent row, token, real
    for step in range(steps):
        logp = torch.log_softmax(logits.float() / max(temperature, 1e-8), dim=-1)  # [n, B, V]
        vocab = logp.shape[-1]
        cand = score[..., None] + logp  # [n, B, V] joint log-likelihood of every candidate
        cut = weights if propose.greedy else propose  # the top-k / top-p that remove candidates from the draw
        kept = cand if cut is None else cand.masked_fill(warp(logits, cut) == 0, float("-inf"))
        log_sel = torch.log_softmax(kept.reshape(n, -1), dim=-1)  # [n, B*V] one draw's probability of each candidate
        flat = cand.reshape(n, -1)
        if propose.greedy:  # the best candidates (the infinite ones, past the finite ones, dropped after the read)
            picks = torch.topk(flat, min(num_beams, flat.shape[1]), dim=-1).indices
            real = torch.isfinite(flat.gather(1, picks))
        else:  # HF's beam sampling: 2 x num_beams draws without replacement, the num_beams best joints kept
            drawn, real = sample_without_replacement(log_sel.exp(), 2 * num_beams, gen)
            best = torch.topk(flat.gather(1, drawn).masked_fill(~real, float("-inf")),
                              min(num_beams, drawn.shape[1]), dim=-1).indices
            picks, real = drawn.gather(1, best), real.gather(1, best)
        score = flat.gather(1, picks).masked_fill(~real, float("-inf"))  # best first (topk's order)
        rows, tokens = picks // vocab, picks % vocab
        # float64 keeps the float32 values and the indices exact in the one read below
        steps_read.append(torch.stack([score.double(), log_sel.gather(1, picks).double(), rows.double(),
                                       tokens.double(), real.double()], 1))
        if step < steps - 1:
            logits = feed(tokens, rows, step)
    read = torch.cat([t.flatten(1) for t in steps_read], 1).tolist()  # the one host read
    tables = []
    for flat_read in read:
        table, at = [], 0
        for t in steps_read:  # [steps][5][B]
            b = t.shape[2]
            table.append([flat_read[at + k * b: at + (k + 1) * b] for k in range(5)])
            at += 5 * b
        tables.append(table)
    return tables


def beams_of(table: list[list[list[float]]], firsts: list[int] | None = None) -> list[Beam]:
    """The real beams of one prompt's :func:`beam_rows` table, best joint likelihood first; with ``firsts`` (the
    first :class:`Branches` node of each fed layer) each beam's fed nodes too."""
    steps, beams = len(table), []
    for i, ok in enumerate(table[-1][4]):
        if not ok:
            continue
        beam, row = Beam(), i
        for step in range(steps - 1, -1, -1):  # back from the last step along the parent rows
            joint, sel, parent, token, _ = (t[row] for t in table[step])
            beam.tokens.append(int(token))
            beam.joint.append(joint)
            beam.select.append(sel)
            if firsts is not None and step < steps - 1:
                beam.nodes.append(firsts[step] + row)
            row = int(parent)
        for seq in (beam.tokens, beam.joint, beam.select, beam.nodes):
            seq.reverse()
        beams.append(beam)
    return beams
