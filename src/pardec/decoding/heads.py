"""Drafters trained on the target itself, one target forward per step: ``medusa`` (+ ``medusa_typical``) and
``firp``.

Each step the target runs once over a tree whose root is the last committed token and whose other nodes are
candidates from the previous step's K draft distributions (depth d: the top-ranked tokens of distribution d, as
the tree's rank paths say: :mod:`pardec.decoding.tree_search`). The same forward gives the target's logits at
every node (verification: :func:`~pardec.decoding.verify.verify_tree`, the cache then keeps the accepted path)
and the drafts of the next step, from the node that ends the accepted path:

* ``medusa`` (Cai et al. 2024): the K heads of :class:`~pardec.models.heads.MedusaHeads` on the node's final
  hidden state; head k drafts the token k + 1 positions after the one the target commits there.
* ``firp`` (Wu et al. 2024): K pseudo hidden states per node, born at intermediate layers from the node's own
  hidden states by :class:`~pardec.models.heads.FirpProjections` and run through the upper layers inside the same
  forward (:meth:`~pardec.models.cached.CachedModel.forward_pseudo`), each seeing the node's prefix, the node's
  earlier pseudo states and itself (``attention=pseudo``: the paper's inference, "No masked", §4.3 / Fig. 7;
  ``attention=real``: "Masked", the ablation the paper finds worse); the LM head runs only on the accepted node's.

Exactness: candidates are deterministic (top-k), so the shared tree rule keeps greedy output equal to ``ar`` and
sampled output distributed exactly as the target's (``distribution``). ``medusa_typical`` replaces it under
sampling by Medusa's typical acceptance (Cai et al. 2024, Sec. 2.3.1; reference ``medusa/model/utils.py``
``evaluate_posterior`` with ``fast=True``, the default of ``medusa_generate``): a candidate passes when its target
probability (at the run's temperature) exceeds ``min(posterior_threshold, posterior_alpha * exp(-entropy))``; the
longest passing path wins, among paths of that length the most likely one (the sum of its accepted tokens' log
probabilities); the token after it is the target's argmax there (``next_token=greedy``: the reference's
``generate_candidates`` with ``fast=True``, the first token of each step decoded greedily and accepted
unconditionally). ``next_token=sample`` draws it from the target's warped distribution (pardec's earlier rule),
``next_token=typical`` from the typical-filtered one (the reference with ``fast=False``). ``approximate``,
declared; under greedy it is the exact greedy rule.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import ClassVar, Literal

import torch

from pardec.config import ConfigError, SamplingConfig, check_choice
from pardec.decoding.base import Decoder, GenerationResult, Stopper, _Run, check_range, register_method
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree import Tree
from pardec.decoding.tree_search import RankTree, resolve_tree, truncate_paths
from pardec.decoding.verify import TreeVerdict, read_verdict, verify_tree
from pardec.models.cached import CachedModel
from pardec.models.drafters import check_int8_weights, load_drafter, place, read_meta
from pardec.models.pseudo import DECODING_ATTENTION, PSEUDO_ATTENTION, forward_pseudo

log = logging.getLogger(__name__)


class TreeDrafter(Decoder):
    """The shared loop; subclasses say how one forward yields the target's logits and the next drafts.
    ``int8_weights``: the drafter's int8 scheme when the target runs int8 (``pardec.models.drafters.place``; null:
    the target's float dtype)."""

    exactness = "distribution"
    custom_mask = True
    kind: ClassVar[str] = ""

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, path: str | None = None,
                 tree: str = "chain", k: int | None = None, int8_weights: str | None = None):
        super().__init__(target, tokenizer, draft)
        check_int8_weights(int8_weights)
        if path is None:
            raise ConfigError(f"method {self.name!r} needs trained {self.kind} weights: method.path=<dir> "
                              f"(train them with python -m train +experiment={self.kind}_smollm2)")
        key = "method.path"
        meta = read_meta(path, key)  # checks that need no model first (the harness checks before loading one)
        if meta.get("kind") != self.kind:
            raise ConfigError(f"{key}={path!r} holds {meta.get('kind')!r} weights; this method needs {self.kind!r}")
        if k is not None:
            check_range("k", k, 1, int(meta["k"]))
        self.k = k or int(meta["k"])
        # a tree deeper than the drafter's K is an error; one deeper than a smaller ``k`` asked for is cut to it
        self.tree_name, paths = resolve_tree(tree, [Path(path) / "trees"], int(meta["k"]))
        self.paths = truncate_paths(paths, self.k)
        self.ranks = RankTree(self.paths)
        if target is not None:
            self.drafter, self.meta = load_drafter(path, target.config, self.kind, key=key)
            # it reads what the LM head reads
            self.drafter = place(self.drafter, target.model, target.head_device, int8_weights)

    # ------------------------------------------------------------------ per method
    def _forward(self, ids: torch.Tensor, positions=None, attend=None, last_only: bool = False):
        """(target logits [T', V], state from which :meth:`_drafts` reads a node's K draft logits)."""
        raise NotImplementedError

    def _drafts(self, state, node: int) -> torch.Tensor:
        raise NotImplementedError

    def _accept(self, tree: Tree, logits: torch.Tensor, st: _Run) -> TreeVerdict:
        return verify_tree(tree, logits, st.s, st.gen)

    # ------------------------------------------------------------------ shared
    def candidates(self, drafts: torch.Tensor, depth: int) -> Tree:
        """The tree of the drafts' top-ranked tokens, the rank paths cut to ``depth`` (:class:`RankTree`)."""
        return self.ranks.candidates(drafts, depth)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, stop: Stopper | None = None,
                 sampling: SamplingConfig | None = None) -> GenerationResult:
        box = {}

        def prefill(ids: torch.Tensor) -> torch.Tensor:
            self.target.reset()
            logits, state = self._forward(ids, last_only=True)
            box["drafts"] = self._drafts(state, -1)
            return logits[-1:]

        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling, prefill)
        drafts = box["drafts"]
        drafted = accepted = 0
        while not st.out.done:
            tree = self.candidates(drafts, min(self.k, st.out.room - 1))
            base, dev = self.target.length, self.target.device
            logits, state = self._forward(tree.tokens(last, dev)[None], tree.positions(base, dev),
                                          tree.on(dev).attend)
            st.target_forwards += 1
            verdict = self._accept(tree, logits, st)
            st.out.commit(verdict.tokens)
            self.target.keep(verdict.path)
            drafts = self._drafts(state, verdict.path[-1])
            last = verdict.tokens[-1]
            drafted += len(tree) - 1
            accepted += len(verdict.path) - 1
        return self._result(st, {"tree": self.tree_name, "tree_nodes": len(Tree.from_paths(self.paths)) - 1,
                                 "k": self.k}, drafted=drafted, draft_accepted=accepted)


@register_method("medusa")
class Medusa(TreeDrafter):
    kind = "medusa"
    renamed = {"heads": "path"}

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, path: str | None = None,
                 tree: str = "chain", k: int | None = None, int8_weights: str | None = "per_token"):
        super().__init__(target, tokenizer, draft, path, tree, k, int8_weights)

    def _forward(self, ids, positions=None, attend=None, last_only=False):
        out = self.target.forward(ids, positions=positions, attend=attend, last_only=last_only,
                                  hidden_layer=self.target.num_layers)
        return out.logits[0], out.hidden[0]

    def _drafts(self, hidden, node):
        return self.drafter(hidden[node])[: self.k]  # [k, V]


@register_method("medusa_typical")
class MedusaTypical(Medusa):
    """Medusa with its typical acceptance under sampling (lossy; greedy = the exact rule)."""

    exactness = "approximate"

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, path: str | None = None,
                 tree: str = "chain", k: int | None = None, posterior_threshold: float = 0.09,
                 posterior_alpha: float = 0.3, next_token: Literal["greedy", "sample", "typical"] = "greedy",
                 int8_weights: str | None = "per_token"):
        super().__init__(target, tokenizer, draft, path, tree, k, int8_weights)
        check_typical(posterior_threshold, posterior_alpha, next_token)
        self.threshold, self.alpha, self.next_token = posterior_threshold, posterior_alpha, next_token

    def _accept(self, tree, logits, st):
        if st.s.greedy:
            return verify_tree(tree, logits, st.s, st.gen)
        return typical_accept(tree, logits, st.s, st.gen, self.threshold, self.alpha, self.next_token)


NEXT_TOKEN = ("greedy", "sample", "typical")


def check_typical(posterior_threshold: float, posterior_alpha: float, next_token: str) -> None:
    """``medusa_typical``'s options (batch-1 and batched)."""
    check_range("posterior_threshold", posterior_threshold, 0.0, 1.0, integer=False)
    check_range("posterior_alpha", posterior_alpha, 0.0, 1.0, integer=False)
    check_choice("method.next_token", next_token, NEXT_TOKEN)


def typical_accept(tree: Tree, logits: torch.Tensor, s: SamplingConfig, gen: torch.Generator | None,
                   threshold: float, alpha: float, next_token: str = "greedy", depth: int | None = None) -> TreeVerdict:
    """Medusa's typical acceptance (Sec. 2.3.1): node n passes when its parent's target probability of its token
    (temperature only) exceeds ``min(threshold, alpha * exp(-H))``, H the entropy there. Among the nodes whose whole
    path passes, the deepest wins; among equally deep ones the most likely path (the largest sum of its tokens' log
    probabilities, as the reference's ``evaluate_posterior``), the first in node order among exact ties. One more
    token follows at the winner: the target's argmax (``greedy``, the paper's), a sample of the target's warped
    distribution (``sample``) or of its typical-filtered one (``typical``: tokens under the bar there dropped).
    ``depth``: nodes deeper never pass (the tree as if cut there). Everything is decided on the device; one host
    read."""
    dev = logits.device
    buf, labels = tree.on(dev), tree.label_tensor(dev)
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)  # [N, V]
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
    bar = torch.minimum(torch.full_like(ent, threshold), alpha * torch.exp(-ent))  # [N]
    p = probs[buf.parent, labels.clamp(min=0)]  # [N] each node's probability under its parent's row (root: unused)
    ok = p > bar.index_select(0, buf.parent)
    ok[0].fill_(True)  # (a fill kernel: `ok[0] = True` uploads a host scalar, a sync on CUDA)
    if depth is not None:
        ok &= buf.depth <= depth
    logp = p.clamp_min(1e-30).log().double()
    logp[0] = 0.0
    passes = ~(buf.attend & ~ok).any(-1)  # [N] the whole path passes
    score = (buf.attend.double() * logp).sum(-1)  # [N] the path's log likelihood
    deepest = torch.where(passes, buf.depth, -1)
    best = torch.where(deepest == deepest.max(), score, float("-inf")).argmax().view(1)  # first among exact ties
    if next_token == "greedy":
        nxt = logits.index_select(0, best).argmax(-1)
    else:
        row = probs.index_select(0, best)
        dist = warp(logits.index_select(0, best), s) if next_token == "sample" else \
            row.masked_fill(row < bar.index_select(0, best)[:, None], 0)
        nxt = sample(dist, gen)[0]
    return read_verdict(tree, buf.attend.index_select(0, best)[0], nxt, labels)


@register_method("firp")
class Firp(TreeDrafter):
    """``attention``: what a pseudo state sees at decoding: ``pseudo`` (the default, the paper's inference: the
    node's prefix, its earlier pseudo states and itself, "No masked", §4.3 / Fig. 7) or ``real`` (the prefix and
    itself only: "Masked", the ablation Fig. 7 finds worse). The projections are trained teacher-forced on real
    states (§3.3, their drafter.json ``attention: real``): trained ``real`` and decoded ``pseudo`` is the paper's
    combination. Every combination stays exact; the one that runs is logged."""

    kind = "firp"
    renamed = {"projections": "path"}

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, path: str | None = None,
                 tree: str = "chain", k: int | None = None, attention: str = DECODING_ATTENTION,
                 int8_weights: str | None = None):
        check_choice("method.attention", attention, PSEUDO_ATTENTION)
        super().__init__(target, tokenizer, draft, path, tree, k, int8_weights)
        self.attention = attention
        self.layers = self.drafter.layers[: self.k] if target is not None else None
        if target is not None:
            what = {"pseudo": "the paper's No masked decoding", "real": "the Masked ablation (FIRP Fig. 7)"}
            log.info("FIRP: projections trained with attention=%s, decoded with attention=%s, %s",
                     self.drafter.attention, attention, what[attention])

    def _forward(self, ids, positions=None, attend=None, last_only=False):
        n = ids.shape[-1]
        anchors = [n - 1] if last_only else None
        out = forward_pseudo(self.target, ids, self.drafter, self.layers, anchors=anchors, positions=positions,
                                         attend=attend, logits_at=[n - 1] if last_only else None,
                                         attention=self.attention)
        return out.logits[0], out.pseudo[0]

    def _drafts(self, pseudo, node):
        return self.target.lm_head(pseudo[node])  # [k, V]
