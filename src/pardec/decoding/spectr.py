"""`spectr`: SpecTr (Sun et al. 2023), speculative decoding with ``k`` i.i.d. draft sequences.

Each round the draft samples ``k`` sequences of ``gamma`` tokens independently from its warped distribution
(the run's temperature / top-k / top-p); they are grown side by side in the draft's cache as the rows of one
batch (:class:`~pardec.decoding.drafting.Branches`), on the device, read back once, and merged into a trie
(:class:`~pardec.decoding.tree.Tree`), which one target forward verifies under the tree mask.
Verification is the paper's k-sequential draft selection, applied node by node
(:func:`~pardec.decoding.kseq.verify_tree_iid`): the output follows the target's distribution exactly
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
from pardec.decoding.kseq import verify_tree_iid
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree import Tree


def iid_inputs(seqs: list[list[int]], length: int, qs: list[torch.Tensor], greedy: bool
               ) -> tuple[dict[tuple[int, ...], torch.Tensor], dict[tuple[int, ...], list[int]]]:
    """K-SEQ's inputs by drafted prefix, from ``seqs`` (each drawn ``length`` deep; ``qs[step][j]`` the distribution
    sequence ``j`` drew its token ``step`` from): per prefix, the distribution its sequences drew their next token
    from (the first of them's; under greedy decoding not the greedy chain's, sequence 0) and those tokens in draw
    order."""
    q_of: dict[tuple[int, ...], torch.Tensor] = {}
    draws: dict[tuple[int, ...], list[int]] = {}
    for step in range(length):
        for j, s_j in enumerate(seqs):
            key = tuple(s_j[:step])
            if key not in q_of and not (greedy and j == 0):
                q_of[key] = qs[step][j]
            draws.setdefault(key, []).append(s_j[step])
    return q_of, draws


def on_nodes(tree: Tree, q_of: dict, draws: dict) -> dict[str, dict]:
    """:func:`iid_inputs` by node of ``tree`` (the trie of those sequences): ``verify_tree_iid``'s ``q`` and
    ``draws``."""
    prefix = [tree.label_path(i) for i in range(len(tree))]
    return {"q": {i: q_of[key] for i, key in enumerate(prefix) if key in q_of},
            "draws": {i: draws[key] for i, key in enumerate(prefix) if key in draws}}


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
        the branches, the branch node of every fed prefix, draft forwards).

        The ``k`` sequences are the rows of one batch, grown on the device and read back once, after the last
        draw (the paper's batch of sequences; no read per draft step). Rows with the same prefix draw from one
        distribution, that of the first of them (the canonical row), so the draws through a prefix are i.i.d. from
        the ``q`` verification is told even where a batched forward is not bitwise batch-invariant."""
        first = catch_up(self.draft, seq)
        br = Branches(self.draft)
        greedy, k = st.s.greedy, self.k
        dev = first.device
        # greedy still draws sequences 2..k: a generator of its own, on the device of the draft's probabilities
        gen = st.gen if not greedy else torch.Generator(device=dev).manual_seed(st.s.seed)
        toks = torch.zeros(k, length, dtype=torch.long, device=dev)
        logits = first.expand(k, -1)  # [k, V]: every row continues the committed sequence
        qs: list[torch.Tensor] = []  # per step: [k, V] the distribution each row drew from
        parents, nodes = [-1] * k, []  # per fed step: the k rows' branch nodes (host values: the shape is fixed)
        for step in range(length):
            if step:  # the first row sharing each row's prefix stands for it
                same = (toks[:, None, :step] == toks[None, :, :step]).all(-1)  # [k, k], the diagonal true
                logits = logits.index_select(0, same.int().argmax(1))
            if greedy:
                q = torch.softmax(logits.float(), -1)  # rows 2..k at temperature 1; row 1 is the greedy chain
                x = logits[:1].argmax(-1)
                if k > 1:
                    x = torch.cat([x, sample(q[1:], gen).view(-1)])
            else:
                q = warp(logits, st.s)
                x = sample(q, gen).view(-1)
            toks[:, step] = x
            qs.append(q)
            if step < length - 1:
                logits, parents = br.grow(x, parents)
                nodes.append(parents)
        seqs = toks.tolist()  # the round's one draft read
        q_of, draws = iid_inputs(seqs, length, qs, greedy)
        node_of: dict[tuple[int, ...], int] = {(): -1}
        for step in range(length - 1):
            for j, s_j in enumerate(seqs):
                node_of.setdefault(tuple(s_j[: step + 1]), nodes[step][j])
        return seqs, q_of, draws, br, node_of, 1 + br.forwards

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
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
            rule = functools.partial(verify_tree_iid, tree, s=st.s, gen=st.gen, **on_nodes(tree, q, draws))
            acc = self._verify_tree(st, last, tree, rule=rule)[1].tokens
            n_acc = len(acc) - 1
            kept = acc[: min(n_acc, n - 1)]
            # the draft keeps the accepted tokens it has fed, as host values (fed as device tensors: its next
            # catch-up reads nothing back)
            br.keep(node_of[tuple(kept)], kept)
            drafted, accepted = drafted + n, accepted + n_acc
            tree_sizes.append(len(tree) - 1)
            last = acc[-1]
        extras = {"draft_acceptance": accepted / drafted if drafted else None,
                  "mean_tree_nodes": sum(tree_sizes) / len(tree_sizes) if tree_sizes else None}
        return self._result(st, extras, clock.forwards, clock.seconds, drafted, accepted)
