"""`mjsd` and `mjgd`: multi-token joint decoding (Qin et al. 2024, "Multi-Token Joint Speculative Decoding").

``mjgd`` (multi-token joint greedy decoding, the paper's Figure 1) is the reference MJSD approximates: on the
target alone, each round commits the ``K`` tokens of the best beam of a beam search over ``K`` tokens (the
joint likelihood ``p(x_1..x_K)`` instead of one token at a time). One target forward per beam step: slow by
design, reported for its perplexity. Under sampling its beams are drawn by beam sampling with the run's top-k /
top-p; it has no acceptance ratio, so ``mjsd``'s ``ratio`` choice does not concern it.

``mjsd`` replaces the target's beam search with the draft's: each round the draft runs beam sampling
(``num_beams`` beams, ``gamma`` tokens, the paper's top-k 20 / top-p 0.9 on the draft's proposals; beam
*search* under greedy decoding, pardec's greedy variant), the ``width`` best beams are verified by one target
forward (one beam: a chain; several: a trie under the tree mask), and the longest drafted prefix
``x_1..x_i`` whose ratio ``min(1, p(x_1..x_i) / q(x_1..x_i))`` exceeds ``tau`` is accepted (the deepest such node,
ties by higher ``p``; the paper's Alg. 1 line 10 accepts while ``tau < min(1, p/q)``, strictly, App. D Table 5:
tau = 0.1); then
the next token comes from the target (argmax, or a sample from its warped distribution, the run's ``sampling``).

``p`` and ``q`` of the ratio (``ratio``):

* ``warped`` (default, the paper's App. D and its code, github.com/ZongyueQin/MJSD @ bb00dc9): ``p(x_1..x_i)`` is the
  product of the target's distributions warped with the same top-k / top-p as the draft's proposals (renormalised;
  0 for a token they remove), at the run's temperature; ``q(x_1..x_i)`` is the probability with which the draft's
  beam sampling selected that prefix at step ``i``: one draw's probability among all the step's candidates,
  ``exp(log q(x_1..x_i)) / sum over beams b and kept tokens v of exp(score_b) q_b(v)`` (see
  :func:`~pardec.decoding.drafting.beam_search`), not the product of per-token probabilities.
* ``raw`` (pardec's earlier rule): both are the models' joint probabilities at the run's temperature, without
  top-k / top-p: ``p`` the target's, ``q`` the draft's joint likelihood of the prefix.

Under greedy decoding both use temperature 1 (the draft's beam search is scored, and for ``warped`` its selection
probability computed, as beam sampling at temperature 1 with ``top_k`` / ``top_p`` would; a beam-search candidate
that top-k / top-p would never draw has ``q = 0``: ratio 1 where ``p > 0``).

``tau`` is in ``[0, 1)``: the reference code treats a threshold ``>= 1`` as "reject every draft" (speculative_sampling.py
line 698), which leaves the target decoding alone while the draft still runs; ``tau = 0`` accepts every drafted
token of ratio above 0, i.e. every one the target (warped, for ``warped``) can produce: a token of target
probability 0 is never accepted.

Beam bookkeeping: every beam carries the joint log-likelihood and the selection probability of each of its own
prefixes, copied from the beam it was expanded from at every step (the reference code appends step scores without
reordering them with the beam indices, so its ratios mix prefixes of different beams; ``tests/decoding/test_mjsd.py``
holds pardec to the right bookkeeping on a stub with hand-set logits). Not copied either: the reference code starts
beam sampling from ``num_beams`` copies of the prefix, all with score 0, so its first step's selection probabilities
are the warped draft's divided by ``num_beams``; pardec's first step has one beam.

Both methods change the output distribution on purpose: ``exactness = "approximate"``.
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from pardec.config import ConfigError, SamplingConfig, check_choice
from pardec.decoding.base import Decoder, DraftClock, GenerationResult, check_range, register_method
from pardec.decoding.drafting import Beam, Branches, beam_search, catch_up
from pardec.decoding.sampling import select, warp
from pardec.decoding.tree import Tree
from pardec.decoding.verify import TreeVerdict
from pardec.models.cached import to_device

RATIOS = ("warped", "raw")


def log_ratio(logp: float, logq: float) -> float:
    """``log min(1, p / q)``; ``q = 0`` (a candidate the draft's top-k / top-p would never draw): 1 where ``p > 0``."""
    if logq == -math.inf:
        return 0.0 if logp > -math.inf else -math.inf
    return min(0.0, logp - logq)


def joint_accept(tree: Tree, target_logp: torch.Tensor, draft_logq: dict[int, float], log_tau: float,
                 next_tokens: torch.Tensor | None = None) -> int | tuple[int, int]:
    """The node MJSD accepts: the deepest node whose ``log min(1, p(path) / q(path)) > log_tau`` (ties: higher
    ``p``), the root (0) if none. ``target_logp`` [N, V]: the target's log-probabilities after each node (-inf where
    its distribution is 0); ``draft_logq``: node -> ``log q`` of the node's path. With ``next_tokens`` [N] (the
    target's token after every node, on the device), returns (node, the token after it), both from one host read."""
    nodes = range(1, len(tree))
    index = to_device(torch.tensor([[tree.parents[i] for i in nodes], [tree.labels[i] for i in nodes]],
                                   dtype=torch.long), target_logp.device)  # (a list index would upload, blocking)
    step = target_logp[index[0], index[1]].double()
    if next_tokens is not None:  # float64 keeps the token ids exact beside the log-probabilities
        step = torch.cat([step, next_tokens.double()])
    read = step.tolist()  # the one host read
    best = pick_joint(tree, read[: len(tree) - 1], draft_logq, log_tau)
    if next_tokens is None:
        return best
    return best, int(read[len(tree) - 1 + best])


def pick_joint(tree: Tree, step_logp: list[float], draft_logq: dict[int, float], log_tau: float) -> int:
    """:func:`joint_accept`'s choice on the host: ``step_logp[i - 1]`` the target's log-probability of node ``i``'s
    token after its parent (nodes 1..N-1)."""
    logp = [0.0] * len(tree)
    best, best_key = 0, (0, -math.inf)
    for i, lp in zip(range(1, len(tree)), step_logp):
        logp[i] = logp[tree.parents[i]] + lp
        ok = log_ratio(logp[i], draft_logq[i]) > log_tau  # strict: the paper's tau < min(1, p/q)
        key = (int(tree.depth[i]), logp[i])
        if ok and key > best_key:
            best, best_key = i, key
    return best


def target_logp(logits: torch.Tensor, scoring: SamplingConfig, warped: bool) -> torch.Tensor:
    """The target's log-probabilities [N, V] for the ratio: ``scoring``'s temperature, and with ``warped`` its top-k
    / top-p too (-inf for the tokens they remove)."""
    if warped:
        return torch.log(warp(logits, scoring))
    return torch.log_softmax(logits.float() / scoring.temperature, -1)


def joint_verdict(tree: Tree, logits: torch.Tensor, draft_logq: dict[int, float], log_tau: float,
                  scoring: SamplingConfig, warped: bool, s: SamplingConfig, gen: torch.Generator | None) -> TreeVerdict:
    """MJSD's verification of ``tree`` from the target's ``logits`` [N, V] (``p`` from :func:`target_logp`): the
    :func:`joint_accept` node's path, then the target's own next token (argmax, or a sample from its distribution
    warped by the run's ``s``)."""
    # the target's token after every node (drawn independently per node, so the accepted node's is an exact draw),
    # read back with the ratios' log-probabilities: one host read per verification
    node, nxt = joint_accept(tree, target_logp(logits, scoring, warped), draft_logq, log_tau, select(logits, s, gen))
    path = tree.path_to(node)
    return TreeVerdict(path, [tree.labels[j] for j in path[1:]] + [nxt])


def check_mjsd(gamma: int, num_beams: int, width: int, tau: float, top_k: int, top_p: float, ratio: str) -> None:
    """MJSD's parameters (batch-1 and batched), each refused in one line."""
    check_range("gamma", gamma, 1, 64)
    check_range("num_beams", num_beams, 1, 64)
    check_range("width", width, 1, num_beams)
    if not (isinstance(tau, (int, float)) and not isinstance(tau, bool) and 0.0 <= tau < 1.0):
        raise ConfigError(f"method.tau={tau!r} is out of range: it must be a number in [0.0, 1.0) (the threshold "
                          f"on min(1, p/q); the paper's code rejects every draft at tau >= 1)")
    check_range("top_k", top_k, 0, 1 << 20)
    check_range("top_p", top_p, 0.0, 1.0, integer=False, open_lo=True)
    check_choice("method.ratio", ratio, RATIOS)


def check_mjgd(K: int, num_beams: int) -> None:
    """MJGD's parameters (batch-1 and batched), each refused in one line."""
    check_range("K", K, 1, 64)
    check_range("num_beams", num_beams, 1, 64)


def scoring_of(s: SamplingConfig, top_k: int, top_p: float) -> SamplingConfig:
    """The distributions of the draft's proposals and of the ratio: the run's temperature (1 under greedy decoding)
    with the method's top-k / top-p."""
    return SamplingConfig(temperature=1.0 if s.greedy else s.temperature, top_k=top_k, top_p=top_p)


def draft_logq(beams: list[Beam], warped: bool) -> dict[tuple[int, ...], float]:
    """``log q`` of every drafted prefix of ``beams`` for the ratio: the selection probability (``warped``) or the
    joint likelihood (``raw``) its beams carry."""
    return {tuple(b.tokens[: i + 1]): b.select[i] if warped else b.joint[i] for b in beams
            for i in range(len(b.tokens))}


@register_method("mjsd")
class MJSD(Decoder):
    exactness = "approximate"
    custom_mask = True
    needs_draft = True

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 4, num_beams: int = 8, width: int = 1,
                 tau: float = 0.1, top_k: int = 20, top_p: float = 0.9, ratio: Literal["warped", "raw"] = "warped"):
        super().__init__(target, tokenizer, draft)
        check_mjsd(gamma, num_beams, width, tau, top_k, top_p, ratio)
        self.gamma, self.num_beams, self.width, self.tau = gamma, num_beams, width, tau
        self.top_k, self.top_p, self.ratio = top_k, top_p, ratio

    def propose(self, seq: list[int], steps: int, st) -> tuple[list[Beam], Branches, int]:
        """Beams of ``steps`` tokens after ``seq`` from the draft. Returns (beams, best first; the branches;
        draft forwards)."""
        first = catch_up(self.draft, seq)
        br = Branches(self.draft)
        scoring = self.scoring(st.s)
        propose = st.s if st.s.greedy else scoring
        beams = beam_search(first, steps, self.num_beams, br, propose, st.gen, scoring.temperature,
                            weights=scoring)
        return beams, br, 1 + br.forwards

    def scoring(self, s: SamplingConfig) -> SamplingConfig:
        return scoring_of(s, self.top_k, self.top_p)

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        self.draft.reset()
        prompt = st.ids[0].tolist()
        scoring, warped = self.scoring(st.s), self.ratio == "warped"
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
            logq = draft_logq(verified, warped)
            node_of = {tuple(b.tokens[: i + 1]): b.nodes[i] for b in verified for i in range(len(b.nodes))}
            rule = functools.partial(joint_verdict, tree, log_tau=log_tau, scoring=scoring, warped=warped, s=st.s,
                                     gen=st.gen, draft_logq={i: logq[tree.label_path(i)] for i in range(1, len(tree))})
            acc = self._verify_tree(st, last, tree, rule=rule)[1].tokens
            n_acc = len(acc) - 1
            kept = acc[: min(n_acc, n - 1)]
            node = node_of.get(tuple(kept), -1)
            br.keep(node, kept if node >= 0 else [])  # the kept tokens as host values: the catch-up reads nothing
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
        check_mjgd(K, num_beams)
        self.K, self.num_beams = K, num_beams

    @torch.inference_mode()
    def generate(self, prompt_ids, max_new_tokens, stop=None, sampling=None) -> GenerationResult:
        st, last = self.begin(prompt_ids, max_new_tokens, stop, sampling)
        temp = 1.0 if st.s.greedy else st.s.temperature
        while not st.out.done:
            k = min(self.K, st.out.room)
            br = Branches(self.target)
            logits, (root,) = br.grow([last], [-1])
            beams = beam_search(logits[0], k, self.num_beams, br, st.s, st.gen, temp, root=root)
            best = beams[0]
            st.target_forwards += br.forwards
            st.out.commit(best.tokens)
            br.keep(best.nodes[-1] if best.nodes else root)  # `last` + the fed tokens of the chosen beam
            last = best.tokens[-1]
        return self._result(st)
