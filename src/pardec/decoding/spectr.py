"""`spectr`: SpecTr (Sun et al. 2023), speculative decoding with ``k`` i.i.d. draft sequences.

Each round the draft samples ``k`` sequences of ``gamma`` tokens independently from its warped distribution
(the run's temperature / top-k / top-p); they are grown side by side in the draft's cache
(:class:`~pardec.decoding.drafting.Branches`; sequences that share a prefix share its forward work) and merged
into a trie (:class:`~pardec.decoding.tree.Tree`), which one target forward verifies under the tree mask.
Verification is the paper's k-sequential draft selection, applied node by node
(:func:`~pardec.decoding.verify.verify_tree_iid`): the output follows the target's distribution exactly
(``exactness = "distribution"``).

Greedy decoding: the first sequence is the draft's greedy chain and the other ``k - 1`` are sampled from the
draft at temperature 1 (a generator seeded with the run's seed), verified by the greedy tree rule: the output
equals greedy ``ar`` token for token, and the extra sequences only add chances of acceptance.
"""

from __future__ import annotations

import functools

import torch

from pardec.decoding.base import Decoder, DraftClock, GenerationResult, check_range, register_method
from pardec.decoding.drafting import Branches, catch_up
from pardec.decoding.sampling import warp
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_tree_iid


@register_method("spectr")
class SpecTr(Decoder):
    exactness = "distribution"
    custom_mask = True
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, k: int = 4, gamma: int = 4):
        super().__init__(target, tokenizer, draft)
        check_range("k", k, 1, 64)
        check_range("gamma", gamma, 1, 64)
        self.k, self.gamma = k, gamma

    def propose(self, seq: list[int], length: int, st) -> tuple[list[list[int]], dict, dict, Branches, dict, int]:
        """``k`` sequences of ``length`` tokens after ``seq``. Returns (sequences, q and draws per prefix
        (tuple of tokens -> the distribution its continuations were drawn from / those tokens in draw order),
        the branches, the branch node of every fed prefix, draft forwards)."""
        first = catch_up(self.draft, seq)
        br = Branches(self.draft)
        greedy = st.s.greedy
        # greedy still draws sequences 2..k: a generator of its own, on the device of the draft's probabilities
        gen = st.gen if not greedy else torch.Generator(device=first.device).manual_seed(st.s.seed)
        logits_of: dict[tuple[int, ...], torch.Tensor] = {(): first}
        node_of: dict[tuple[int, ...], int] = {(): -1}
        seqs: list[list[int]] = [[] for _ in range(self.k)]
        q: dict[tuple[int, ...], torch.Tensor] = {}
        draws: dict[tuple[int, ...], list[int]] = {}
        for step in range(length):
            # the k draws of this step in one batch, read back together (one host read per draft step, not k)
            keys = [tuple(s_j) for s_j in seqs]
            sampled = keys[1:] if greedy else keys
            for key in sampled:
                if key not in q:
                    q[key] = torch.softmax(logits_of[key].float(), -1) if greedy else warp(logits_of[key], st.s)
            picks = [logits_of[keys[0]].argmax().view(1)] if greedy else []
            if sampled:
                picks.append(torch.multinomial(torch.stack([q[key] for key in sampled]), 1, generator=gen).view(-1))
            xs = torch.cat(picks).tolist()
            for key, s_j, x in zip(keys, seqs, xs, strict=True):
                draws.setdefault(key, []).append(x)
                s_j.append(x)
            if step < length - 1:
                new = list(dict.fromkeys(tuple(s_j) for s_j in seqs))  # distinct prefixes, in first-seen order
                out, nodes = br.grow([p[-1] for p in new], [node_of[p[:-1]] for p in new])
                for p, row, node in zip(new, out, nodes):
                    logits_of[p], node_of[p] = row, node
        return seqs, q, draws, br, node_of, 1 + br.forwards

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self._start(prompt_ids, max_new_tokens, stop, sampling)
        self.draft.reset()
        prompt = st.ids[0].tolist()
        drafted = accepted = 0
        clock = DraftClock()
        tree_sizes: list[int] = []
        while not st.out.done:
            n = min(self.gamma, st.out.room - 1)  # the target adds one token of its own
            if n < 1:
                last = self._step_alone(st, last)
                continue
            seqs, q, draws, br, node_of, _ = clock.run(st, self.propose, prompt + st.out.tokens, n, st)
            tree = Tree.from_paths(seqs)
            prefix = [tree.label_path(i) for i in range(len(tree))]
            rule = functools.partial(verify_tree_iid, tree, s=st.s, gen=st.gen,
                                     q={i: q[key] for i, key in enumerate(prefix) if key in q},
                                     draws={i: draws[key] for i, key in enumerate(prefix) if key in draws})
            acc = self._verify_tree(st, last, tree, rule=rule)[1].tokens
            n_acc = len(acc) - 1
            br.keep(node_of[tuple(acc[: min(n_acc, n - 1)])])  # the draft keeps the accepted tokens it has fed
            drafted, accepted = drafted + n, accepted + n_acc
            tree_sizes.append(len(tree) - 1)
            last = acc[-1]
        extras = {"draft_acceptance": accepted / drafted if drafted else None,
                  "mean_tree_nodes": sum(tree_sizes) / len(tree_sizes) if tree_sizes else None}
        return self._result(st, extras, clock.forwards, clock.seconds, drafted, accepted)
