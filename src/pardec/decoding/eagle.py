"""Method ``eagle3``: an EAGLE-3 drafter (:mod:`pardec.models.eagle`) on the target's own features, verified on the
shared tree rule.

The target runs with ``hidden_layer=layer_ids`` (the drafter's low/mid/high layers), so prefill and every
verification also give the features the drafter reads. The drafter keeps its own KV cache of *stable* entries: entry
``j`` pairs the target's fused features at position ``j`` with the embedding of token ``j + 1``; its output at the
last entry predicts the first draft token. Each step:

* ``mode=tree`` (the default; EAGLE-2's context-aware dynamic tree, Li et al. 2024, §4, the drafting EAGLE-3 uses):
  expand the ``top_k`` most likely tokens of the last entry; then ``depth`` times run the drafter once over the
  current frontier (``top_k`` entries at the next position, each seeing the stable entries and its own ancestors),
  take each frontier node's ``top_k`` children scored by the *cumulative* log-probability of their path (the draft's
  confidence as the value of a node) and keep the ``top_k`` best as the next frontier. All candidates of every level
  are then reranked by that score and the best ``total_tokens - 1`` form the tree (a parent always outscores its
  children, so the kept set is a tree). Defaults: EAGLE-3's ``EaModel.from_pretrained`` (``total_token=60``,
  ``depth=7``, ``top_k=10``; reference ``eagle/model/ea_model.py``).
* ``mode=chain`` (vLLM's EAGLE-3 proposer, ``num_speculative_tokens``): the drafter's greedy (or, under sampling, its
  sampled) chain of ``num_speculative_tokens`` tokens, each entry fed the drafter's own output (default 3: the
  ``speculators`` converter's greedy proposal).

The target verifies in one forward (tree: :func:`~pardec.decoding.verify.verify_tree`; chain:
:func:`~pardec.decoding.verify.verify_chain`), the cache keeps the accepted path, and the drafter's cache catches up
with the accepted tokens and *the target's* features at their positions (one drafter forward), which gives the next
step's first drafts.

Exactness: ``distribution``. Tree candidates are deterministic (top-k), so the shared rule keeps greedy output equal
to ``ar`` and sampled output distributed as the target's; the chain under sampling is speculative sampling with the
drafter's warped distributions. The tree is built on the device (:class:`~pardec.decoding.tree.DeviceTree`):
drafting reads nothing back, and each step's one host read is the verification's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pardec.config import ConfigError, SamplingConfig, check_choice
from pardec.decoding.base import (
    Decoder,
    DraftClock,
    GenerationResult,
    Stopper,
    check_range,
    register_method,
)
from pardec.decoding.features import begin_with_features
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree import DeviceTree
from pardec.decoding.verify import verify_chain, verify_tree
from pardec.models.cached import CachedModel, to_device
from pardec.models.drafters import check_int8_weights, place
from pardec.models.eagle import Eagle3Draft
from pardec.models.eagle_formats import load_eagle3

MODES = ("tree", "chain")


class _DraftCache:
    """The drafter's keys/values of its stable entries ([1, kv_heads, S, head_dim] each)."""

    def __init__(self) -> None:
        self.kv: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return 0 if self.kv is None else int(self.kv[0].shape[2])

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.kv = (k, v) if self.kv is None else (torch.cat([self.kv[0], k], 2), torch.cat([self.kv[1], v], 2))

    def with_(self, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The stable entries followed by ``ks``/``vs`` (this step's draft entries), or None when there are none."""
        if self.kv is None and not ks:
            return None
        base = [] if self.kv is None else [self.kv]
        return (torch.cat([b[0] for b in base] + ks, 2), torch.cat([b[1] for b in base] + vs, 2))


def check_eagle3(mode: str, total_tokens: int, depth: int, top_k: int, num_speculative_tokens: int,
                 int8_weights: str | None) -> None:
    """``eagle3``'s options (batch-1 and batched), refused in one line before anything loads."""
    check_int8_weights(int8_weights)
    check_choice("method.mode", mode, MODES)
    check_range("total_tokens", total_tokens, 1, 4096)
    check_range("depth", depth, 0, 64)
    check_range("top_k", top_k, 1, 64)
    check_range("num_speculative_tokens", num_speculative_tokens, 1, 64)


Level = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def dynamic_tree(drafter: Eagle3Draft, roots: torch.Tensor, levels: int, top_k: int, total_tokens: int,
                 level: Level) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], int]:
    """EAGLE-2's dynamic tree (module doc) for ``n`` rows at once, from the drafter's outputs at their last stable
    entries ``roots`` [n, H], with at most ``levels`` levels below the root. ``level(i, tokens [n, k], hidden
    [n, k, H], seen [n, k, m + k])`` runs the drafter over level ``i``'s frontier (``k`` entries a row, at the
    position after the row's stable entries + ``i``, each seeing those entries, the ``m`` tree entries fed before
    where ``seen`` says, and itself) and returns its outputs [n, k, H]. Returns the trees' (parent, depth, rank,
    labels), each [n, N] (the root first, its parent given as 0 and its label -1), and their branching; made on the
    device, nothing read back."""
    d, dev, n = drafter, roots.device, roots.shape[0]
    if levels == 0 or total_tokens == 1:
        z = torch.zeros(n, 1, dtype=torch.long, device=dev)
        return (z, z, z, z - 1), 1
    logp = torch.log_softmax(d.logits(roots).float(), -1)  # [n, V']
    k = min(top_k, logp.shape[-1])
    top = logp.topk(k)
    scores, tokens = top.values, d.to_target(top.indices)
    ranks = torch.arange(k, device=dev).expand(n, k)
    s_all, t_all, p_all, r_all = [scores], [tokens], [torch.full((n, k), -1, device=dev)], [ranks]
    lv_all = [torch.ones(n, k, dtype=torch.long, device=dev)]
    slots, hidden, toks = ranks, roots[:, None].expand(n, k, roots.shape[-1]), tokens
    eye = torch.eye(k, dtype=torch.bool, device=dev).expand(n, k, k)
    seen, offset = eye, k  # seen [n, k, entries so far]: a frontier entry's ancestors, and itself
    for i in range(levels - 1):
        out = level(i, toks, hidden, seen)
        lp = torch.log_softmax(d.logits(out).float(), -1).topk(k)  # [n, k, k]
        cum = (scores[..., None] + lp.values).reshape(n, k * k)
        kids = d.to_target(lp.indices).reshape(n, k * k)
        s_all.append(cum)
        t_all.append(kids)
        p_all.append(slots[..., None].expand(n, k, k).reshape(n, k * k))
        r_all.append(ranks.repeat(1, k))
        lv_all.append(torch.full((n, k * k), i + 2, dtype=torch.long, device=dev))
        best = cum.topk(k)
        parent = best.indices // k
        scores, toks, slots = best.values, kids.gather(1, best.indices), offset + best.indices
        hidden = out.gather(1, parent[..., None].expand(n, k, out.shape[-1]))
        seen = torch.cat([seen.gather(1, parent[..., None].expand(n, k, seen.shape[-1])), eye], 2)
        offset += k * k
    s_all, t_all, p_all, r_all, lv_all = (torch.cat(x, 1) for x in (s_all, t_all, p_all, r_all, lv_all))
    size = min(total_tokens - 1, s_all.shape[1])
    # the best ``size`` by score; among equal scores the earlier slot first (a parent precedes its children, and
    # never scores less than they do: the kept set is closed under parents), then back in slot order
    keep = torch.sort(s_all, dim=1, descending=True, stable=True).indices[:, :size].sort(1).values
    node = torch.full(s_all.shape, -1, dtype=torch.long, device=dev)
    node.scatter_(1, keep, torch.arange(1, size + 1, device=dev).expand(n, size))
    par = p_all.gather(1, keep)
    parent = torch.where(par < 0, 0, node.gather(1, par.clamp(min=0)))
    zero = torch.zeros(n, 1, dtype=torch.long, device=dev)
    return (torch.cat([zero, parent], 1), torch.cat([zero, lv_all.gather(1, keep)], 1),
            torch.cat([zero, r_all.gather(1, keep)], 1), torch.cat([zero - 1, t_all.gather(1, keep)], 1)), k


@register_method("eagle3", renamed_from=("eagle",))  # one name for EAGLE-3: method, drafter type, formats
class Eagle(Decoder):
    """``path``: the drafter: a pardec ``drafter.type: eagle3`` run's ``final`` dir, or a published EAGLE-3 checkpoint
    (the original release's or vLLM ``speculators``' layout; a dir or a Hub id: :mod:`pardec.models.eagle_formats`);
    ``mode``: ``tree`` | ``chain``;
    ``total_tokens``, ``depth``, ``top_k``: the dynamic tree's size (nodes including the root), expansion steps and
    branching; ``num_speculative_tokens``: the chain's length; ``int8_weights``: the drafter's int8 scheme when the
    target runs int8 (``pardec.models.drafters.place``; null: fp32)."""

    exactness = "distribution"
    custom_mask = True

    def __init__(self, target: CachedModel, tokenizer=None, draft=None, path: str | None = None,
                 mode: str = "tree", total_tokens: int = 60, depth: int = 7, top_k: int = 10,
                 num_speculative_tokens: int = 3, int8_weights: str | None = "per_token"):
        drafter = draft if isinstance(draft, Eagle3Draft) else None
        super().__init__(target, tokenizer, None)
        check_eagle3(mode, total_tokens, depth, top_k, num_speculative_tokens, int8_weights)
        if drafter is None and path is None:
            raise ConfigError("method 'eagle3' needs an EAGLE-3 drafter: method.path=<dir> (train one with "
                              "python -m train +experiment=eagle3_smollm2)")
        self.mode, self.total_tokens, self.depth, self.top_k = mode, total_tokens, depth, top_k
        self.chain_k = num_speculative_tokens
        if target is None:
            return
        if drafter is None:  # pardec's, the original release's or speculators' layout, a dir or a Hub id
            drafter, _ = load_eagle3(path, target.config, key="method.path")
        c = drafter.config
        if c.target_hidden_size != int(target.config.hidden_size) or c.vocab_size != int(target.config.vocab_size):
            raise ConfigError(f"the EAGLE-3 drafter reads features of width {c.target_hidden_size} and vocabulary "
                              f"{c.vocab_size}; the target has {target.config.hidden_size} and "
                              f"{target.config.vocab_size}")
        self.drafter = place(drafter, target.model, target.device, int8_weights)
        self.layers = tuple(int(i) for i in c.layer_ids)
        self.embed = target.inner().embed_tokens
        self.clock = DraftClock()

    # ------------------------------------------------------------------ drafter steps
    def _catch_up(self, cache: _DraftCache, features: torch.Tensor, tokens: torch.Tensor, start: int
                  ) -> tuple[torch.Tensor, int]:
        """Stable entries ``start ..`` from the target's ``features`` [m, n * H] and the ``tokens`` [m] after them;
        returns (the last entry's output [H], forwards)."""
        d = self.drafter
        pos = torch.arange(start, start + tokens.numel(), device=tokens.device)
        out, (k, v) = d(self.embed(tokens)[None], d.fuse(features)[None], pos, past=cache.kv)
        cache.append(k, v)
        return out[0, -1], 1

    def _tree(self, cache: _DraftCache, root: torch.Tensor, base: int, levels: int) -> tuple[DeviceTree, int]:
        """EAGLE-2's dynamic tree of candidates from the last stable entry's output ``root`` [H] (module doc), with
        at most ``levels`` levels below the root; built on the device."""
        d = self.drafter
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        stable = torch.ones(1, cache.length, dtype=torch.bool, device=root.device)

        def level(i: int, toks: torch.Tensor, hidden: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
            k = toks.shape[1]
            pos = torch.full((k,), base + i, dtype=torch.long, device=toks.device)
            out, (kk, vv) = d(self.embed(toks), hidden, pos, past=cache.with_(ks, vs),
                              mask=torch.cat([stable.expand(k, -1), seen[0]], 1))
            ks.append(kk)
            vs.append(vv)
            return out

        (parent, depth, rank, labels), width = dynamic_tree(d, root[None], levels, self.top_k, self.total_tokens,
                                                             level)
        return DeviceTree(parent[0], depth[0], rank[0], labels[0], width, levels), len(ks)

    def _chain(self, cache: _DraftCache, root: torch.Tensor, base: int, n: int, s: SamplingConfig,
               gen: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """The drafter's chain of ``n`` tokens from ``root`` [H]: (tokens [n], their warped draft distributions
        [n, V] under sampling (None greedy), forwards)."""
        d = self.drafter
        toks, qs, ks, vs, out = [], [], [], [], root[None]
        forwards = 0
        for i in range(n):
            logits = d.full_logits(d.logits(out[-1:]))  # [1, V]
            if s.greedy:
                tok = logits.argmax(-1)
            else:
                q = warp(logits, s)
                qs.append(q)
                tok = sample(q, gen)[:, 0]
            toks.append(tok)
            if i == n - 1:
                break
            pos = torch.full((1,), base + i, dtype=torch.long, device=tok.device)
            h, (kk, vv) = d(self.embed(tok)[None], out[-1:][None], pos, past=cache.with_(ks, vs))
            out = h[0]
            forwards += 1
            ks.append(kk)
            vs.append(vv)
        return torch.cat(toks), (torch.cat(qs) if qs else None), forwards

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens: int, stop: Stopper | None = None,
                 sampling: SamplingConfig | None = None) -> GenerationResult:
        st, last, features = begin_with_features(self, prompt_ids, max_new_tokens, stop, sampling)
        tgt, dev = self.target, st.ids.device
        cache = _DraftCache()
        first = torch.cat([st.ids[0, 1:], torch.full((1,), last, dtype=torch.long, device=dev)])
        root, _ = self.clock.run(st, self._catch_up, cache, features, first, 0)
        drafted = accepted = 0
        while not st.out.done:
            room = st.out.room - 1  # the target's token after the drafts always comes too
            base = tgt.length
            if self.mode == "tree":
                tree, _ = self.clock.run(st, self._tree, cache, root, base, min(self.depth + 1, room))
                out = tgt.forward(tree.tokens(last)[None], positions=tree.positions(base), attend=tree.on(dev).attend,
                                  hidden_layer=self.layers)
                st.target_forwards += 1
                verdict = verify_tree(tree, out.logits[0], st.s, st.gen)
                tokens, path = verdict.tokens, verdict.path
                tgt.keep(path)
                features = out.hidden[0].index_select(0, to_device(torch.tensor(path), dev))
                drafted += len(tree) - 1
            else:
                n = min(self.chain_k, room)
                if n == 0:
                    draft, q = torch.zeros(0, dtype=torch.long, device=dev), None
                else:
                    draft, q, _ = self.clock.run(st, self._chain, cache, root, base, n, st.s, st.gen)
                out = tgt.forward(torch.cat([torch.full((1,), last, dtype=torch.long, device=dev), draft])[None],
                                  hidden_layer=self.layers)
                st.target_forwards += 1
                tokens = verify_chain(draft, out.logits[0], st.s, st.gen, q)
                tgt.truncate(base + len(tokens))
                features = out.hidden[0, : len(tokens)]
                drafted += n
            accepted += len(tokens) - 1
            st.out.commit(tokens)
            last = tokens[-1]
            if st.out.done:
                break
            root, _ = self.clock.run(st, self._catch_up, cache, features,
                                     to_device(torch.tensor(tokens, dtype=torch.long), dev), base)
        extras = {"mode": self.mode, **({"total_tokens": self.total_tokens, "depth": self.depth, "top_k": self.top_k}
                                        if self.mode == "tree" else {"num_speculative_tokens": self.chain_k})}
        return self._result(st, extras, draft_forwards=self.clock.forwards, draft_s=self.clock.seconds,
                            drafted=drafted, draft_accepted=accepted)
