"""``sdsat`` (Liu and Zhu 2024): speculative decoding with semantic adaptive tokens.

A model fine-tuned on masked corpora (``python -m train +experiment=sdsat_smollm2``) has learnt one special token
(or L of them, SDSAT-D): after a real prefix ``x_1..x_n``, the logits at the j-th appended adaptive token predict
the token ``j + 1`` positions after ``x_n``. The target drafts for itself, so there is no draft model; each
forward is the target's.

State between forwards: the last committed token (not cached yet) and, maybe, K draft distributions for the K
tokens after it. One forward runs, under a tree mask, the last token (the root), the candidate tree built from the
drafts, and, where drafts are wanted next, ``k`` adaptive tokens after the end of the tree's main chain (the chain
of every depth's most likely token). Verification is the shared tree rule on the tree's rows
(:func:`~pardec.decoding.verify.verify_tree`); the cache keeps the accepted path only (the adaptive tokens never
stay). The adaptive rows give the next drafts when the accepted path is the whole main chain (they were computed
after it); otherwise the next forward drafts anew.

* ``variant=two_step`` (the paper's greedy "two-step-draft-then-verify"): forward 1 = last token + k adaptive
  tokens (commits the target's next token and drafts k more); forward 2 = that token + the k drafts (verifies
  them, commits the accepted ones and one more). Up to k + 2 tokens per 2 forwards.
* ``variant=fused``: every forward verifies the previous drafts *and* appends the k adaptive tokens, so a fully
  accepted chain is followed at once by the next one: up to k + 1 tokens per forward.

Candidates: under greedy the main chain alone (the drafts' argmax), as the paper's greedy decoder. Under sampling
(the paper's nucleus sampling) each depth's draft distribution (at the run's temperature) gives a ranked list: its
``top_k`` most likely tokens inside the ``top_p`` nucleus (the paper's defaults 10 and 0.95). ``tree`` says which
nodes are built from those lists:

* ``official`` (default): the reference code's static trees (``decoders/model/utils.py``, ``tree_depth_{k}``, run
  by its ``start_nucleus.sh`` for k = 5, 7, 9, 11, 13, the trees its nucleus-sampling results come from):
  Medusa-style rank paths, the node ``(r_1..r_d)`` holding the ``r_d``-th token of depth d's list whatever its
  parent (k = 5: 4 / 8 / 8 / 5 / 3 nodes per depth). Other k have no official tree.
* ``caterpillar`` (pardec's earlier shape, any k): the main chain, with every other listed token of a depth as a
  leaf hanging from the main chain's node one level up.
* a pardec tree file (:mod:`pardec.decoding.tree_search` format: rank paths) no deeper than ``k``.

A node whose rank is past the end of its depth's list (a narrow nucleus) is left out with its subtree. The
candidates are a deterministic function of the committed tokens, so the shared tree rule is exact
(``distribution``) with every shape: the paper's reference code sampled the candidates and each row on its own,
which is not. Adaptive ids never become candidates.

Counts: ``drafted`` is the depth of each verified candidate tree (k, fewer only where fewer tokens remain) and
``draft_accepted`` the drafted tokens accepted, so the harness's draft acceptance is the paper's accept rate (its
Fig. 3: accepted tokens / adaptive tokens, per verification, as the reference code's ``a_time / c_time``). The
per-node figure is the extra ``node_acceptance`` (accepted / candidate nodes verified, ``tree_nodes``).

``k`` is free at inference for identical adaptive tokens (one id repeated); SDSAT-D's distinct tokens allow
``k <= L``. The adaptive ids come from the model's ``config.sdsat`` (written by training) or ``method.adaptive_ids``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import torch

from pardec.config import ConfigError, ModelConfig, SamplingConfig, check_choice
from pardec.decoding.base import Decoder, GenerationResult, Stopper, check_range, register_method
from pardec.decoding.tree import Tree
from pardec.decoding.tree_search import load_tree, truncate_paths
from pardec.decoding.verify import verify_tree
from pardec.models.adaptive import adaptive_ids_of
from pardec.models.cached import CachedModel, to_device
from pardec.models.preflight import read_config_json

# The reference code's nucleus trees (decoders/model/utils.py, tree_depth_{k}), written compactly: depths separated
# by "/", each node a rank path whose leading zeros are left out ("10" at depth 3 is the path [0, 1, 0]).
OFFICIAL_TREES = {
    5: "0 1 2 3 / 0 1 2 10 11 20 21 30 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 / 0 1 2",
    7: "0 1 2 3 / 0 1 2 10 11 20 21 30 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 / 0 1 2 10 11 / 0 1 2 / 0 1",
    9: "0 1 2 3 / 0 1 2 10 11 20 21 30 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 / 0 1 2 10 11 20 / 0 1 2 10 11 / "
       "0 1 2 10 / 0 1 2 / 0 1",
    11: "0 1 2 3 / 0 1 2 10 11 20 21 30 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 / "
        "0 1 2 10 11 20 / 0 1 2 10 11 20 / 0 1 2 10 11 / 0 1 2 10 / 0 1 2 / 0 1",
    13: "0 1 2 3 / 0 1 2 10 11 20 21 30 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 21 100 / "
        "0 1 2 10 11 20 21 100 / 0 1 2 10 11 20 / 0 1 2 10 11 20 / 0 1 2 10 11 20 / 0 1 2 10 11 / 0 1 2 10 / "
        "0 1 2 / 0 1",
}


def official_tree(k: int) -> list[list[int]]:
    """The reference code's nucleus tree of depth ``k`` as rank paths (depth by depth)."""
    return [[int(c) for c in node.rjust(d, "0")]
            for d, level in enumerate(OFFICIAL_TREES[k].split("/"), 1) for node in level.split()]


def resolve_shape(tree: str, k: int) -> list[list[int]] | None:
    """``method.tree`` -> the rank paths of the sampling tree (None: the caterpillar), checked against ``k``."""
    tree = str(tree)
    if tree == "caterpillar":
        return None
    if tree == "official":
        if k not in OFFICIAL_TREES:
            raise ConfigError(f"method.tree=official has no tree for method.k={k}: the reference code's trees have "
                              f"depth k in {', '.join(map(str, OFFICIAL_TREES))}; use one of those k, "
                              f"method.tree=caterpillar or a tree file")
        return official_tree(k)
    if tree and Path(tree).is_file():
        paths = load_tree(tree).paths
        depth = max(len(p) for p in paths)
        if depth > k:
            raise ConfigError(f"method.tree={tree!r} has depth {depth}, out of range: a tree's depth must be in "
                              f"[1, {k}] (method.k={k} adaptive tokens draft {k} depths)")
        return paths
    raise ConfigError(f"method.tree={tree!r} is not valid; choose official, caterpillar or a tree JSON file "
                      f"(rank paths of depth <= method.k)")


TRAIN_HINT = ("train one with `python -m train +experiment=sdsat_smollm2` and pass model=local "
              "model.path=<run dir>/final (or give method.adaptive_ids)")


def adaptive_of(config, name: str, adaptive_ids: list | None, k: int) -> list[int]:
    """The adaptive ids a model decodes with: ``method.adaptive_ids`` or its config's (written by training), checked
    against its vocabulary and ``k``."""
    adaptive = list(adaptive_ids) if adaptive_ids is not None else adaptive_ids_of(config)
    if adaptive is None:
        raise ConfigError(f"model {name!r} has no SDSAT adaptive token (no `sdsat` in its config): {TRAIN_HINT}")
    vocab = int(config.vocab_size)
    bad = [i for i in adaptive if i >= vocab]
    if bad:
        raise ConfigError(f"adaptive ids {bad} are outside the model's vocabulary (size {vocab})")
    check_k(adaptive, k)
    return adaptive


def check_k(adaptive: list[int], k: int) -> None:
    """SDSAT-D's ``L`` distinct adaptive tokens draft at most ``k = L``; one repeated id drafts any ``k``."""
    if len(adaptive) > 1 and k > len(adaptive):
        raise ConfigError(f"method.k={k} is out of range: this model's {len(adaptive)} distinct adaptive "
                          f"tokens (SDSAT-D, L={len(adaptive)}) draft at most k={len(adaptive)}")


def adaptive_chain(adaptive: list[int], n: int) -> list[int]:
    """The ids of ``n`` appended adaptive tokens: one id repeated, or SDSAT-D's a_1..a_n."""
    return [adaptive[0]] * n if len(adaptive) == 1 else adaptive[:n]


def without_adaptive(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Draft logits [..., V] of adaptive rows with the adaptive ids (``index``, on their device) excluded."""
    return rows.float().index_fill(-1, index, float("-inf"))


@register_method("sdsat")
class SDSAT(Decoder):
    exactness = "distribution"
    custom_mask = True  # sampling trees (greedy chains need none)

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, k: int = 5,
                 variant: Literal["two_step", "fused"] = "two_step", top_k: int = 10, top_p: float = 0.95,
                 tree: str = "official", adaptive_ids: list | None = None):
        super().__init__(target, tokenizer, draft)
        check_range("k", k, 1, 1 << 16)
        check_choice("method.variant", variant, ("two_step", "fused"))
        check_range("top_k", top_k, 1, 1 << 20)
        check_range("top_p", top_p, 0.0, 1.0, integer=False, open_lo=True)
        if adaptive_ids is not None and (not adaptive_ids or not all(isinstance(i, int) and i >= 0
                                                                    for i in adaptive_ids)):
            raise ConfigError(f"method.adaptive_ids={adaptive_ids!r} is not valid: give a non-empty list of token ids")
        self.k, self.fused, self.top_k, self.top_p = k, variant == "fused", top_k, top_p
        self.variant = variant
        self.adaptive: list[int] | None = list(adaptive_ids) if adaptive_ids is not None else None
        if target is not None:
            self.adaptive = adaptive_of(target.config, target.name, adaptive_ids, k)
        elif self.adaptive is not None:
            check_k(self.adaptive, k)
        self.tree_name, self.paths = str(tree), resolve_shape(tree, k)  # the sampling tree; greedy drafts a chain

    @classmethod
    def check_model(cls, model: ModelConfig, params: dict) -> None:
        """Before the model loads: a model whose config.json is at hand must record adaptive tokens."""
        if params.get("adaptive_ids") is not None:
            return
        config = {} if model.source == "tiny_random" else read_config_json(model)  # a tiny random model has none
        if config is not None and adaptive_ids_of(config) is None:
            raise ConfigError(f"model {model.name!r} ({model.path or model.source}) has no SDSAT adaptive token "
                              f"(no `sdsat` in its config): {TRAIN_HINT}")

    # ------------------------------------------------------------------ drafting
    def _adaptive_chain(self, n: int) -> list[int]:
        return adaptive_chain(self.adaptive, n)

    def draft_logits(self, rows: torch.Tensor, before: list[int], token: torch.Tensor) -> torch.Tensor:
        """[k, V] draft logits from the adaptive rows (adaptive ids excluded). The rows follow ``token`` [1], on the
        device and not yet read back (the prefill's first token, or a verification's bonus token), which follows
        the new tokens ``before``: the drafts continue ``before + [token]``. A seam for tests (oracle drafts)."""
        return without_adaptive(rows, self._adaptive_index(rows.device))

    def _adaptive_index(self, device: torch.device) -> torch.Tensor:
        """The adaptive ids as an index on ``device``, uploaded once (a list index is uploaded on every call,
        blocking: one sync per step on CUDA, seen on the H200)."""
        cached = getattr(self, "_adaptive_on", None)
        if cached is None or cached.device != device:
            cached = self._adaptive_on = to_device(torch.tensor(self.adaptive, dtype=torch.long), device)
        return cached

    def candidate_lists(self, drafts: torch.Tensor, s: SamplingConfig) -> torch.Tensor:
        """What building the candidates needs on the host, on the drafts' device: [P, d, K] ids, row-wise in the
        drafts [d, V] (so the first rows serve a shallower tree). Greedy (or a caterpillar with ``top_k`` 1): each
        depth's argmax [1, d, 1]. Else each depth's ``top_k`` most likely tokens at the run's temperature and
        whether each is inside the ``top_p`` nucleus (the most likely always is) [2, d, K]; the caterpillar adds each
        depth's argmax of the raw drafts [3, d, K]."""
        if s.greedy or (self.paths is None and self.top_k <= 1):
            return drafts.argmax(-1).reshape(1, -1, 1)
        probs = torch.softmax(drafts.float() / s.temperature, dim=-1)
        top = probs.topk(min(self.top_k, probs.shape[-1]), dim=-1)
        before = top.values.cumsum(-1) - top.values  # mass of the more likely ones
        keep = (before < self.top_p) & (top.values > 0)
        keep[:, 0].fill_(True)  # never empty: the most likely token stays
        parts = [top.indices, keep.long()]
        if self.paths is None:
            parts.append(drafts.argmax(-1, keepdim=True).expand_as(top.indices))
        return torch.stack(parts)

    def _lists_maker(self, rows: torch.Tensor, before: list[int], s: SamplingConfig, box: dict):
        """``make(token)``: the flat :meth:`candidate_lists` of the drafts that the adaptive ``rows`` make after
        ``before + [token]`` (``token`` still on the device); the [P, d, K] tensor is left in ``box["lists"]``."""

        def make(token: torch.Tensor) -> torch.Tensor:
            box["lists"] = self.candidate_lists(self.draft_logits(rows, before, token), s)
            return box["lists"].reshape(-1)

        return make

    def candidates(self, drafts: torch.Tensor, s: SamplingConfig) -> tuple[Tree, int]:
        """(candidate tree, index of the main chain's last node) from draft logits [d, V] (one host read)."""
        return self.tree_from_lists(self.candidate_lists(drafts, s).tolist(), s)

    def tree_from_lists(self, got: list, s: SamplingConfig) -> tuple[Tree, int]:
        """(candidate tree, index of the main chain's last node) from :meth:`candidate_lists`' values [P][d][K]."""
        if s.greedy:  # the main chain alone
            return Tree.chain([row[0] for row in got[0]]), len(got[0])
        if self.paths is None:
            return self._caterpillar(got)
        ranked = [[t for t, k in zip(row, flags) if k] for row, flags in zip(got[0], got[1])]
        paths = [p for p in truncate_paths(self.paths, len(ranked))
                 if all(r < len(ranked[d]) for d, r in enumerate(p))]  # ranks past a narrow nucleus: left out
        tree = Tree.from_paths([[ranked[d][r] for d, r in enumerate(p)] for p in paths])
        node = 0  # the main chain: every depth's most likely token, as deep as the tree holds it
        for d in range(len(ranked)):
            nxt = [c for c in tree.children[node] if tree.labels[c] == ranked[d][0]]
            if not nxt:
                break
            node = nxt[0]
        return tree, node

    def _caterpillar(self, got: list) -> tuple[Tree, int]:
        """The main chain with each depth's other listed tokens as leaves under the chain's node one level up."""
        parents, labels = [-1], [-1]
        node = 0  # the main chain's deepest node so far
        if len(got) == 1:  # top_k 1: the argmax chain
            lists, main = None, [row[0] for row in got[0]]
        else:
            lists = [[t for t, k in zip(row, flags) if k] for row, flags in zip(got[0], got[1])]
            main = [row[0] for row in got[2]]
        for d, tok in enumerate(main):
            alts = [t for t in lists[d] if t != tok] if lists is not None else []
            parents += [node] * (1 + len(alts))
            labels += [int(tok)] + alts
            node = len(parents) - 1 - len(alts)
        return Tree(parents, labels), node

    # ------------------------------------------------------------------ loop
    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, stop: Stopper | None = None,
                 sampling: SamplingConfig | None = None) -> GenerationResult:
        """One host read per target forward: the next candidates' values (:meth:`candidate_lists` of the adaptive
        rows) ride on the read of the forward that produced them (the prefill's first token, or the verification)."""
        box: dict = {}

        def prefill(ids: torch.Tensor) -> torch.Tensor:
            self.target.reset()
            n = ids.shape[1]
            extra = torch.tensor([self._adaptive_chain(self.k)], device=ids.device)
            logits = self.target.forward(torch.cat([ids, extra], 1), logits_at=list(range(n - 1, n + self.k))
                                         ).logits[0]
            self.target.truncate(n)
            box["rows"] = logits[1:]
            return logits[:1]

        def first_lists(token: torch.Tensor) -> torch.Tensor:
            return self._lists_maker(box["rows"], [], sampling or SamplingConfig(), box)(token)

        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling, prefill, extra=first_lists)
        lists = unflatten_lists(st.extra, box["lists"].shape)  # the next candidates' values, or None (no drafts)
        drafted = accepted = nodes = 0
        loops = 0
        while not st.out.done:
            depth = min(self.k, st.out.room - 1) if lists is not None else 0
            if depth > 0:
                tree, anchor = self.tree_from_lists([part[:depth] for part in lists], st.s)
            else:
                tree, anchor = Tree.chain([]), 0
            # adaptive tokens after the main chain: always when there are no drafts (two-step's first forward),
            # every time in the fused variant; not when no token could follow the main chain
            n_adapt = self.k if (depth == 0 or self.fused) and st.out.room > depth + 1 else 0
            full = tree if not n_adapt else with_chain(tree, anchor, self._adaptive_chain(n_adapt))
            if all(p == i - 1 for i, p in enumerate(full.parents[1:], 1)):  # a chain (greedy): plain causal
                logits = self.target.forward(full.tokens(last)[None]).logits[0]
            else:
                logits = self.target.forward(full.tokens(last)[None], positions=full.positions(self.target.length),
                                             attend=full.attend).logits[0]
            st.target_forwards += 1
            loops += depth > 0
            nxt = None  # the next candidates: used only if the whole main chain is accepted (read all the same)
            if n_adapt:
                nxt = self._lists_maker(logits[len(tree):], st.out.tokens + list(tree.label_path(anchor)), st.s,
                                        box)
            verdict = verify_tree(tree, logits[: len(tree)], st.s, st.gen, extra=nxt)
            st.out.commit(verdict.tokens)
            self.target.keep(verdict.path)
            drafted += depth  # the paper's accept rate counts adaptive tokens (drafted depths), not tree nodes
            nodes += len(tree) - 1
            accepted += len(verdict.path) - 1
            last = verdict.tokens[-1]
            lists = (unflatten_lists(verdict.extra, box["lists"].shape) if nxt is not None and verdict.path[-1] == anchor
                     else None)
        extras = {"k": self.k, "variant": self.variant, "tree": self.tree_name, "verifications": loops,
                  "tree_nodes": nodes, "node_acceptance": accepted / nodes if nodes else None}
        return self._result(st, extras, drafted=drafted, draft_accepted=accepted)


def unflatten_lists(values: list[int], shape: torch.Size) -> list:
    """Flat host values back into nested lists of ``shape`` [P, d, K]."""
    p, d, k = shape
    return [[values[(i * d + j) * k:(i * d + j + 1) * k] for j in range(d)] for i in range(p)]


def with_chain(tree: Tree, anchor: int, labels: list[int]) -> Tree:
    """``tree`` with a chain of ``labels`` hanging from node ``anchor`` (node indices len(tree)..)."""
    parents, labs = list(tree.parents), list(tree.labels)
    for lab in labels:
        parents.append(anchor if len(parents) == len(tree) else len(parents) - 1)
        labs.append(lab)
    return Tree(parents, labs)

