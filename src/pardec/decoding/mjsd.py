"""`mjsd` and `mjgd`: multi-token joint decoding (Qin et al. 2024, "Multi-Token Joint Speculative Decoding").

``mjgd`` (multi-token joint greedy decoding, the paper's Figure 1) is the reference MJSD approximates: on the
target alone, each round commits the ``K`` tokens of the best beam of a beam search over ``K`` tokens (the
joint likelihood ``p(x_1..x_K)`` instead of one token at a time). One target forward per beam step: slow by
design, reported for its perplexity.

``mjsd`` replaces the target's beam search with the draft's: each round the draft runs beam sampling
(``num_beams`` beams, ``gamma`` tokens, the paper's top-k 20 / top-p 0.9 on the draft's proposals; beam
*search* under greedy decoding, the paper's greedy variant), the ``width`` best beams are verified by one target
forward (one beam: a chain; several: a trie under the tree mask), and the longest drafted prefix
``x_1..x_i`` whose joint-likelihood ratio ``min(1, p(x_1..x_i) / q(x_1..x_i))`` reaches ``tau`` is accepted
(the deepest such node, ties by higher ``p``; the paper's ``r <= min(1, p/q)`` with ``r = tau``); then the next
token comes from the target (argmax, or a sample from its warped distribution). ``p`` and ``q`` are the
models' joint probabilities at the run's temperature (1 under greedy decoding), without top-k / top-p.

Beam bookkeeping: every beam carries the joint log-likelihood of each of its own prefixes, copied from the
beam it was expanded from at every step (the reference code appends step scores without reordering them with
the beam indices, so its ratios mix prefixes of different beams; ``tests/decoding/test_mjsd.py`` holds pardec
to the right bookkeeping on a stub with hand-set logits).

Both methods change the output distribution on purpose: ``exactness = "approximate"``.
"""

from __future__ import annotations

import functools
import math

import torch

from pardec.config import SamplingConfig
from pardec.decoding.base import Decoder, DraftClock, GenerationResult, check_range, register_method
from pardec.decoding.drafting import Beam, Branches, beam_search, catch_up
from pardec.decoding.sampling import select
from pardec.decoding.tree import Tree
from pardec.decoding.verify import TreeVerdict


def joint_accept(tree: Tree, target_logp: torch.Tensor, draft_logq: dict[int, float], log_tau: float) -> int:
    """The node MJSD accepts: the deepest node whose ``log p(path) - log q(path) >= log_tau`` (ties: higher
    ``p``), the root (0) if none. ``target_logp`` [N, V]: the target's log-probabilities after each node;
    ``draft_logq``: node -> the draft's joint log-likelihood of the node's path."""
    logp = [0.0] * len(tree)
    best, best_key = 0, (0, 0.0)
    for i in range(1, len(tree)):
        logp[i] = logp[tree.parents[i]] + float(target_logp[tree.parents[i], tree.labels[i]])
        ok = min(0.0, logp[i] - draft_logq[i]) >= log_tau
        key = (int(tree.depth[i]), logp[i])
        if ok and key > best_key:
            best, best_key = i, key
    return best


def joint_verdict(tree: Tree, logits: torch.Tensor, draft_logq: dict[int, float], log_tau: float,
                  temperature: float, s: SamplingConfig, gen: torch.Generator | None) -> TreeVerdict:
    """MJSD's verification of ``tree`` from the target's ``logits`` [N, V]: the :func:`joint_accept` node's path,
    then the target's own next token (argmax, or a sample from its warped distribution)."""
    node = joint_accept(tree, torch.log_softmax(logits.float() / temperature, -1), draft_logq, log_tau)
    path = tree.path_to(node)
    return TreeVerdict(path, [tree.labels[j] for j in path[1:]] + [int(select(logits[node], s, gen))])


@register_method("mjsd")
class MJSD(Decoder):
    exactness = "approximate"
    custom_mask = True
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 4, num_beams: int = 8, width: int = 1,
                 tau: float = 0.9, top_k: int = 20, top_p: float = 0.9):
        super().__init__(target, tokenizer, draft)
        check_range("gamma", gamma, 1, 64)
        check_range("num_beams", num_beams, 1, 64)
        check_range("width", width, 1, num_beams)
        check_range("tau", tau, 0.0, 1.0, integer=False)
        check_range("top_k", top_k, 0, 1 << 20)
        check_range("top_p", top_p, 0.0, 1.0, integer=False, open_lo=True)
        self.gamma, self.num_beams, self.width, self.tau = gamma, num_beams, width, tau
        self.top_k, self.top_p = top_k, top_p

    def propose(self, seq: list[int], steps: int, st) -> tuple[list[Beam], Branches, int]:
        """Beams of ``steps`` tokens after ``seq`` from the draft. Returns (beams, best first; the branches;
        draft forwards)."""
        first = catch_up(self.draft, seq)
        br = Branches(self.draft)
        propose = st.s if st.s.greedy else SamplingConfig(temperature=st.s.temperature, top_k=self.top_k,
                                                           top_p=self.top_p)
        temp = 1.0 if st.s.greedy else st.s.temperature
        beams = beam_search(first, steps, self.num_beams, br.grow, propose, st.gen, temp)
        return beams, br, 1 + br.forwards

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self._start(prompt_ids, max_new_tokens, stop, sampling)
        self.draft.reset()
        prompt = st.ids[0].tolist()
        temp = 1.0 if st.s.greedy else st.s.temperature
        log_tau = math.log(self.tau) if self.tau > 0 else -math.inf
        drafted = accepted = 0
        clock = DraftClock()
        n_beams, chosen_rank, full = [], [], 0
        while not st.out.done:
            n = min(self.gamma, st.out.room - 1)  # the target adds one token of its own
            if n < 1:
                last = self._step_alone(st, last)
                continue
            beams, br, _ = clock.run(st, self.propose, prompt + st.out.tokens, n, st)
            verified = beams[: self.width]
            tree = Tree.from_paths([b.tokens for b in verified])
            logq, node_of = {}, {}
            for b in verified:
                for i in range(len(b.tokens)):
                    logq[tuple(b.tokens[: i + 1])] = b.joint[i]
                    if i < len(b.nodes):
                        node_of[tuple(b.tokens[: i + 1])] = b.nodes[i]
            rule = functools.partial(joint_verdict, tree, log_tau=log_tau, temperature=temp, s=st.s, gen=st.gen,
                                     draft_logq={i: logq[tree.label_path(i)] for i in range(1, len(tree))})
            _, acc, _ = self._verify_tree(st, last, tree, rule=rule)
            n_acc = len(acc) - 1
            br.keep(node_of.get(tuple(acc[: min(n_acc, n - 1)]), -1))
            drafted, accepted, full = drafted + n, accepted + n_acc, full + (n_acc == n)
            n_beams.append(len(beams))
            if n_acc:
                chosen_rank.append(next(r for r, b in enumerate(verified) if b.tokens[:n_acc] == acc[:n_acc]))
            last = acc[-1]
        rounds = len(n_beams)
        extras = {"draft_acceptance": accepted / drafted if drafted else None,
                  "full_accept_rate": full / rounds if rounds else None,
                  "mean_beams": sum(n_beams) / rounds if rounds else None,
                  "accepted_beam_not_best": (sum(r > 0 for r in chosen_rank) / len(chosen_rank)
                                             if chosen_rank else None)}
        return self._result(st, extras, clock.forwards, clock.seconds, drafted, accepted)


@register_method("mjgd")
class MJGD(Decoder):
    exactness = "approximate"
    custom_mask = True

    def __init__(self, target, tokenizer=None, draft=None, K: int = 4, num_beams: int = 4):
        super().__init__(target, tokenizer, draft)
        check_range("K", K, 1, 64)
        check_range("num_beams", num_beams, 1, 64)
        self.K, self.num_beams = K, num_beams

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self._start(prompt_ids, max_new_tokens, stop, sampling)
        temp = 1.0 if st.s.greedy else st.s.temperature
        while not st.out.done:
            k = min(self.K, st.out.room)
            br = Branches(self.target)
            logits, (root,) = br.grow([last], [-1])
            beams = beam_search(logits[0], k, self.num_beams, br.grow, st.s, st.gen, temp, root=root)
            best = beams[0]
            st.target_forwards += br.forwards
            st.out.commit(best.tokens)
            br.keep(best.nodes[-1] if best.nodes else root)  # `last` + the fed tokens of the chosen beam
            last = best.tokens[-1]
        return self._result(st)
