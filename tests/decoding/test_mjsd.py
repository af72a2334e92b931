"""MJSD / MJGD: beam bookkeeping on hand-set logits (each beam's prefix likelihoods and selection probabilities follow
the beam indices), the joint-likelihood acceptance against a hand computation (the paper's warped ratio and the raw
one), and both decoders against brute-force references."""

from __future__ import annotations

import math

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import build_decoder
from pardec.decoding.drafting import beam_search
from pardec.decoding.mjsd import MJSD, joint_accept, log_ratio
from pardec.decoding.tree import Tree
from pardec.models.cached import CachedModel
from tests.conftest import draft_for, tiny
from tests.decoding.stubs import TableLM

V = 8
# after the prefix: 1 (0.6) or 2 (0.4); after 1 two even choices, after 2 a confident one: the second step's best
# beam [2, 5] (0.38) grows from the first step's *second* beam
STUB = {(): {1: 0.6, 2: 0.4}, (1,): {3: 0.45, 4: 0.55}, (2,): {5: 0.95, 6: 0.05},
        (1, 3): {7: 1.0}, (1, 4): {0: 0.5, 7: 0.5}, (2, 5): {0: 0.1, 7: 0.9}, (2, 6): {0: 1.0}}


def _logits(probs: dict[int, float]) -> torch.Tensor:
    out = torch.full((V,), -1e9)
    for x, p in probs.items():
        out[x] = math.log(p)
    return out


class StubBranches:
    """:class:`~pardec.decoding.drafting.Branches` for :func:`beam_search` with hand-set logits keyed by the
    branch's tokens (a candidate that cannot be a beam may be fed too: it gets a flat distribution)."""

    def __init__(self):
        self.seq_of: list[tuple[int, ...]] = []
        self._layer: list[tuple[int, ...]] = []
        self._firsts: list[int] = []

    def grow_layer(self, tokens, rows, root=-1):
        if rows is None:
            parents, self._firsts = [self.seq_of[root] if root >= 0 else ()] * len(tokens), []
        else:
            parents = [self._layer[r] for r in rows.tolist()]
        self._firsts.append(len(self.seq_of))
        self._layer = [p + (t,) for p, t in zip(parents, tokens.tolist())]
        self.seq_of.extend(self._layer)
        return torch.stack([_logits(STUB.get(seq, {})) for seq in self._layer])

    def settle_layers(self, rows):
        assert len(rows) == len(self._firsts) - 1
        return self._firsts


def _joint(seq: tuple[int, ...]) -> float:
    return sum(math.log(STUB[seq[:i]][seq[i]]) for i in range(len(seq)))


def test_beam_search_carries_each_beams_own_prefix_likelihoods():
    grow = StubBranches()
    beams = beam_search(_logits(STUB[()]), 3, 2, grow, SamplingConfig(), None)
    # step 2: [2, 5] = 0.38 > [1, 4] = 0.33 > [1, 3] = 0.27: beam order swapped; step 3 keeps [2, 5, 7], [1, 4, *]
    assert [b.tokens for b in beams][0] == [2, 5, 7]
    assert beams[1].tokens[:2] == [1, 4]
    for b in beams:
        assert b.joint == pytest.approx([_joint(tuple(b.tokens[: i + 1])) for i in range(3)], abs=1e-6)
        assert [grow.seq_of[n] for n in b.nodes] == [tuple(b.tokens[: i + 1]) for i in range(2)]
    # the reference code's bug would give beam [2, 5, 7] the first step's score of beam 0 (log 0.6)
    assert beams[0].joint[0] == pytest.approx(math.log(0.4))


@pytest.mark.parametrize("seed", range(5))
def test_beam_sampling_carries_each_beams_own_prefix_likelihoods(seed):
    grow = StubBranches()
    beams = beam_search(_logits(STUB[()]), 3, 2, grow, SamplingConfig(temperature=1.0),
                        torch.Generator().manual_seed(seed))
    assert len({tuple(b.tokens) for b in beams}) == len(beams) == 2
    assert beams[0].score >= beams[1].score
    for b in beams:
        assert b.joint == pytest.approx([_joint(tuple(b.tokens[: i + 1])) for i in range(3)], abs=1e-6)


def test_beam_search_records_each_candidates_selection_probability_by_hand():
    """q of the paper's ratio (App. D; the MJSD code's seq_scores): the probability with which the step's draw of beam
    sampling picks the prefix, one softmax over every beam's candidates that top-k / top-p keep, not renormalised
    per beam. Beam search (greedy) records it as beam sampling with ``weights`` would have."""
    beams = beam_search(_logits(STUB[()]), 2, 2, StubBranches(), SamplingConfig(), None,
                        weights=SamplingConfig(temperature=1.0, top_p=0.9))
    # step 1, one beam: top-p 0.9 keeps 1 (0.6) and 2 (0.4, mass before it 0.6 < 0.9): select 0.6 and 0.4.
    # step 2: beam [1] (0.6) keeps 4 (0.55) and 3 (0.45, before it 0.55); beam [2] (0.4) keeps 5 (0.95) and drops 6
    # (before it 0.95 >= 0.9). Candidates: [1, 3] 0.27, [1, 4] 0.33, [2, 5] 0.38; sum 0.98.
    assert [b.tokens for b in beams] == [[2, 5], [1, 4]]  # beam search: the two best joints, 0.38 and 0.33
    assert beams[0].select == pytest.approx([math.log(0.4), math.log(0.38 / 0.98)], abs=1e-6)
    assert beams[1].select == pytest.approx([math.log(0.6), math.log(0.33 / 0.98)], abs=1e-6)
    assert beams[0].joint == pytest.approx([math.log(0.4), math.log(0.38)], abs=1e-6)  # the joint is unchanged


@pytest.mark.parametrize("seed", range(3))
def test_beam_sampling_draws_only_kept_candidates_with_their_selection_probability(seed):
    """Beam sampling with top-p 0.9, 3 beams: step 2 keeps exactly 3 candidates ([2, 6] is cut), so all 3 are drawn,
    whatever the seed, each recording its own probability of one draw (weights 0.27, 0.33, 0.38 over 0.98)."""
    beams = beam_search(_logits(STUB[()]), 2, 3, StubBranches(), SamplingConfig(temperature=1.0, top_p=0.9),
                        torch.Generator().manual_seed(seed))
    assert [b.tokens for b in beams] == [[2, 5], [1, 4], [1, 3]]  # best joint first
    assert [b.select[1] for b in beams] == pytest.approx([math.log(w / 0.98) for w in (0.38, 0.33, 0.27)], abs=1e-6)
    assert [b.select[0] for b in beams] == pytest.approx([math.log(0.4), math.log(0.6), math.log(0.6)], abs=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_beam_sampling_draws_twice_the_beams_and_keeps_the_best_joints(seed):
    """HF's beam sampling (what the MJSD code runs): 2 x num_beams draws, the num_beams best joints kept. One beam over
    supports of two tokens: both are drawn at every step, so the kept beam is the best joint whatever the seed."""
    beams = beam_search(_logits(STUB[()]), 2, 1, StubBranches(), SamplingConfig(temperature=1.0),
                        torch.Generator().manual_seed(seed))
    # step 1: 1 (.6) and 2 (.4) drawn, [1] kept; step 2 from [1] alone: 3 (.27) and 4 (.33) drawn, [1, 4] kept
    assert [b.tokens for b in beams] == [[1, 4]]
    assert beams[0].select == pytest.approx([math.log(0.6), math.log(0.55)], abs=1e-6)  # .33 / (.27 + .33)


def test_tau_0_never_accepts_a_token_the_target_cannot_produce():
    """Alg. 1 line 10 accepts while tau < min(1, p/q), strictly: at tau = 0 a drafted token of (warped) target
    probability 0 has ratio 0 and is rejected (with >= it was accepted)."""
    tree = Tree.from_paths([[5, 6]])  # nodes: 1=(5), 2=(5,6)
    logp = torch.full((3, 10), -math.inf)
    logp[0, 5] = math.log(0.7)  # (5) the target can produce; 6 after it is outside its top-k: probability 0
    logp[1, 2] = 0.0
    q = {1: math.log(0.6), 2: math.log(0.3)}
    assert joint_accept(tree, logp, q, -math.inf) == 1
    assert joint_accept(tree, logp, q, math.log(0.99)) == 1  # (5): ratio 1 > 0.99
    logp[0, 5] = -math.inf
    assert joint_accept(tree, logp, q, -math.inf) == 0  # nothing: the target's own token comes next


def test_joint_accept_by_hand():
    tree = Tree.from_paths([[5, 6, 7], [5, 8]])  # nodes: 1=(5), 2=(5,6), 3=(5,6,7), 4=(5,8)
    logp = torch.full((5, 10), -30.0)
    logp[0, 5], logp[1, 6], logp[1, 8], logp[2, 7] = math.log(0.8), math.log(0.5), math.log(0.3), math.log(0.9)
    # target joints: (5) 0.8, (5,6) 0.4, (5,6,7) 0.36, (5,8) 0.24; draft joints below -> ratios
    q = {1: math.log(0.9), 2: math.log(0.81), 3: math.log(0.405), 4: math.log(0.045)}
    # ratios min(1, p/q): (5) 0.889, (5,6) 0.494, (5,6,7) 0.889, (5,8) 1
    assert joint_accept(tree, logp, q, math.log(0.5)) == 3  # the longest prefix over tau, though (5,6) is under it
    assert joint_accept(tree, logp, q, math.log(0.95)) == 4
    assert joint_accept(tree, logp, q, math.log(0.89)) == 4
    assert joint_accept(tree, logp, q, -math.inf) == 3
    q_low = {k: v - 5 for k, v in q.items()}  # every ratio 1: depth first, then the higher target joint
    assert joint_accept(Tree.from_paths([[5, 6], [5, 8]]), logp, {1: q_low[1], 2: q_low[2], 3: q_low[4]}, math.log(0.999)) == 2
    assert joint_accept(tree, logp, {k: 0.0 for k in q}, math.log(0.99)) == 0  # nothing: the root


def _mjsd_on_stub(tau: float):
    draft = TableLM(V, {})
    target = TableLM(V, {7: {0: 1.0}, 0: {1: 0.5, 2: 0.5}, 2: {5: 0.45, 6: 0.55}, 5: {7: 1.0}})
    # the draft's beam search after 0, with the hand-set STUB tables: [2, 5] (q 0.38) is the best beam of two
    draft.logits[0] = _logits(STUB[()])
    draft.logits[1], draft.logits[2] = _logits(STUB[(1,)]), _logits(STUB[(2,)])
    dec = build_decoder("mjsd", target, None, draft, gamma=2, num_beams=2, tau=tau, ratio="raw")
    return dec.generate([7], 4), draft


def test_mjsd_accepts_by_the_chosen_beams_own_joint_likelihood():
    # ratio=raw: p(2) = 0.5 over q(2) = 0.4: ratio 1; p(2, 5) = 0.225 over q(2, 5) = 0.38: ratio 0.59
    res, draft = _mjsd_on_stub(0.9)
    assert res.tokens[:3] == [0, 2, 6]  # (2) accepted, (2, 5) not; the target's argmax after 2 is 6
    res, draft = _mjsd_on_stub(0.5)
    assert res.tokens == [0, 2, 5, 7]  # both accepted, then the target's token after 5
    assert draft.tokens[:3] == [7, 0, 2]  # the draft cache kept the accepted beam's fed token only


# The warped ratio (App. D) on hand-set tables, greedy decoding, top-k 2, top-p off, gamma 2, 2 beams, width 1.
# draft after 0: 1 .5, 2 .4, 3 .1; after 1: 4 .6, 5 .4; after 2: 6 .45, 7 .55.
# target after 0: 1 .45, 3 .35, 2 .2; after 1: 6 .5, 4 .3, 7 .2; after 4: 5.
WARP_DRAFT = {0: {1: 0.5, 2: 0.4, 3: 0.1}, 1: {4: 0.6, 5: 0.4}, 2: {6: 0.45, 7: 0.55}}
WARP_TARGET = {7: {0: 1.0}, 0: {1: 0.45, 3: 0.35, 2: 0.2}, 1: {6: 0.5, 4: 0.3, 7: 0.2}, 4: {5: 1.0}}


@pytest.mark.parametrize("ratio,tau,tokens,accepted", [
    # warped: q(1) = .5 / (.5 + .4) = .556 (top-k 2 drops 3); step 2: the candidates [1, 4] .3, [1, 5] .2,
    # [2, 6] .18, [2, 7] .22 (sum .9): beam search keeps [1, 4] (best) and [2, 7]; q(1, 4) = .3 / .9 = .333.
    # p: the target's top-2, renormalised: p(1) = .45 / .8 = .5625, p(4 | 1) = .3 / .8 = .375, p(1, 4) = .211.
    # ratios: (1) min(1, .5625 / .556) = 1, (1, 4) .211 / .333 = .633: both accepted at tau .5, then the target's 5
    ("warped", 0.5, [0, 1, 4, 5], [1, 3]),
    ("warped", 0.7, [0, 1, 6, 0], [1, 2, 1]),  # .633 < .7: (1) alone, then the target's argmax after 1 (6)
    # raw: p(1) = .45, q(1) = .5: .9; p(1, 4) = .45 * .3 = .135, q(1, 4) = .3: .45
    ("raw", 0.5, [0, 1, 6, 0], [1, 2, 1]),
    ("raw", 0.4, [0, 1, 4, 5], [1, 3]),
    ("warped", 0.0, [0, 1, 4, 5], [1, 3]),  # tau 0 accepts every drafted token the warped target can produce
])
def test_mjsd_ratio_by_hand(ratio, tau, tokens, accepted):
    target, draft = TableLM(V, WARP_TARGET), TableLM(V, WARP_DRAFT)
    dec = build_decoder("mjsd", target, None, draft, gamma=2, num_beams=2, tau=tau, top_k=2, top_p=1.0, ratio=ratio)
    res = dec.generate([7], 4)
    assert res.tokens == tokens and res.accepted == accepted
    assert target.calls[1] == [0, 1, 4]  # the best beam [1, 4] is verified in one forward


def test_mjsd_warped_ratio_is_the_default():
    res = build_decoder("mjsd", TableLM(V, WARP_TARGET), None, TableLM(V, WARP_DRAFT), gamma=2, num_beams=2,
                        tau=0.5, top_k=2).generate([7], 4)
    assert res.tokens == [0, 1, 4, 5]  # the warped row of the table above (top_p 0.9 keeps what top-k 2 keeps here)


def test_a_candidate_outside_top_k_has_q_zero_and_ratio_one():
    assert log_ratio(math.log(0.2), -math.inf) == 0.0  # p > 0, q = 0: ratio 1
    assert log_ratio(-math.inf, -math.inf) == -math.inf  # p = 0: ratio 0
    assert log_ratio(-math.inf, math.log(0.3)) == -math.inf
    assert log_ratio(math.log(0.2), math.log(0.4)) == pytest.approx(math.log(0.5))
    assert log_ratio(math.log(0.4), math.log(0.2)) == 0.0  # min(1, 2)


def test_bad_mjsd_options_are_refused_before_any_model_loads():
    from pardec.evaluation.spec import check_method

    with pytest.raises(ConfigError, match=r"method\.tau=1\.0 is out of range: it must be a number in \[0\.0, 1\.0\)"):
        check_method("mjsd", {"tau": 1.0}, None)
    with pytest.raises(ConfigError, match="method.ratio='warp' must be one of 'warped', 'raw'"):
        check_method("mjsd", {"ratio": "warp"}, None)
    with pytest.raises(ConfigError, match="method.ratio='warp' is not valid; choose one of: warped, raw"):
        MJSD(None, ratio="warp")  # the decoder's own check


def _beam_ref(model, seq: list[int], steps: int, beams: int) -> list[int]:
    """Brute-force beam search (no cache): the best of ``beams`` beams over ``steps`` tokens after ``seq``."""
    cur = [([], 0.0)]
    for _ in range(steps):
        with torch.no_grad():
            logp = torch.stack([torch.log_softmax(model(torch.tensor([seq + t])).logits[0, -1].float(), -1)
                                for t, _ in cur])
        flat = (torch.tensor([s for _, s in cur])[:, None] + logp).reshape(-1)
        top = torch.topk(flat, beams)
        cur = [(cur[i // logp.shape[1]][0] + [i % logp.shape[1]], float(v))
               for i, v in zip(top.indices.tolist(), top.values.tolist())]
    return cur[0][0]


def _argmax(model, seq):
    with torch.no_grad():
        return int(model(torch.tensor([seq])).logits[0, -1].argmax())


@pytest.mark.parametrize("K,beams", [(1, 1), (2, 3), (3, 2)])
def test_mjgd_equals_brute_force_beam_rounds(K, beams):
    lm = tiny(0)
    ids = lm.tokenizer("def fibonacci(n):")["input_ids"]
    res = build_decoder("mjgd", CachedModel(lm.model), K=K, num_beams=beams).generate(ids, 9)
    seq, out = list(ids), [_argmax(lm.model, ids)]
    while len(out) < 9:
        out += _beam_ref(lm.model, seq + out, min(K, 9 - len(out)), beams)
    assert res.tokens == out
    assert res.target_forwards == 9  # one forward per token: slow by design


@pytest.mark.parametrize("gamma,beams", [(3, 1), (2, 3), (4, 2)])
def test_mjsd_with_the_target_as_draft_equals_brute_force_rounds(gamma, beams):
    """p == q under the raw ratio: every drafted beam is accepted, so a round is the draft's beam search + the
    target's argmax. (Under the warped ratio q is a selection probability among all beams' candidates, not the
    joint likelihood: p == q does not make the ratio 1.)"""
    lm = tiny(1)
    ids = lm.tokenizer("The quick brown fox")["input_ids"]
    res = build_decoder("mjsd", CachedModel(lm.model), None, draft_for("self", 1), gamma=gamma,
                        num_beams=beams, ratio="raw", tau=0.9).generate(ids, 11)
    seq, out = list(ids), [_argmax(lm.model, ids)]
    while len(out) < 11:
        n = min(gamma, 11 - len(out) - 1)
        out += _beam_ref(lm.model, seq + out, n, beams) if n else []
        out.append(_argmax(lm.model, seq + out))
    assert res.tokens == out
    if beams == 1:  # beam search of width 1 is greedy: the output is greedy ar's
        assert res.tokens == build_decoder("ar", CachedModel(lm.model)).generate(ids, 11).tokens


def test_mjsd_sampling_reports_its_statistics():
    lm = tiny(0)
    ids = lm.tokenizer("def fibonacci(n):")["input_ids"]
    dec = build_decoder("mjsd", CachedModel(lm.model), None, draft_for("noisy"), num_beams=4, width=2)
    res = dec.generate(ids, 24, sampling=SamplingConfig(temperature=1.0, seed=5))
    again = dec.generate(ids, 24, sampling=SamplingConfig(temperature=1.0, seed=5))
    assert len(res.tokens) == 24 and res.tokens == again.tokens  # seeded
    assert sum(res.accepted) == 24 and res.draft_forwards > 0
    assert res.extras["mean_beams"] == 4.0 and 0.0 <= res.extras["full_accept_rate"] <= 1.0


@pytest.mark.parametrize("method,params,needle", [
    ("mjsd", {"num_beams": 0}, "method.num_beams=0 is out of range: it must be an integer in [1, 64]"),
    ("mjsd", {"num_beams": 2, "width": 3}, "method.width=3 is out of range: it must be an integer in [1, 2]"),
    ("mjsd", {"tau": -0.1}, "method.tau=-0.1 is out of range: it must be a number in [0.0, 1.0)"),
    ("mjsd", {"tau": 1.0}, "method.tau=1.0 is out of range: it must be a number in [0.0, 1.0)"),
    ("mjsd", {"tau": 1}, "method.tau=1 is out of range: it must be a number in [0.0, 1.0)"),
    ("mjsd", {"ratio": "joint"}, "method.ratio='joint' must be one of 'warped', 'raw'"),
    ("mjsd", {"gamma": 0}, "method.gamma=0 is out of range"),
    ("mjgd", {"K": 0}, "method.K=0 is out of range: it must be an integer in [1, 64]"),
    ("mjgd", {"num_beams": 0}, "method.num_beams=0 is out of range"),
])
def test_bad_parameters_are_named(method, params, needle):
    with pytest.raises(ConfigError) as e:
        build_decoder(method, TableLM(V, {}), None, TableLM(V, {}), **params)
    assert needle in str(e.value)


def test_layers_grown_on_the_device_match_branches_grown_from_host_parents():
    """:meth:`Branches.grow_layer` (parents as device row indices, no host read) feeds what :meth:`Branches.grow`
    feeds with the same parents as host values: the same logits, and after :meth:`Branches.settle_layers` the same
    paths, the same kept cache and the same next logits."""
    from pardec.decoding.drafting import Branches

    model = tiny(0).model
    prompt = torch.tensor([[5, 9, 14, 3]])
    host, dev = CachedModel(model), CachedModel(model)
    for cm in (host, dev):
        cm.prefill(prompt)
    hb, db = Branches(host), Branches(dev)
    h0, _ = hb.grow([3, 4], [-1, -1])
    h1, _ = hb.grow([5, 6, 7], [1, 0, 1])
    d0 = db.grow_layer(torch.tensor([3, 4]), None)
    d1 = db.grow_layer(torch.tensor([5, 6, 7]), torch.tensor([1, 0, 1]))
    torch.testing.assert_close(d0, h0)
    torch.testing.assert_close(d1, h1)
    with pytest.raises(ValueError, match="not settled"):
        db.path(3)
    with pytest.raises(ValueError, match="parent rows of 1 layers, got 2"):
        db.settle_layers([[1, 0, 1], [0]])
    assert db.settle_layers([[1, 0, 1]]) == [0, 2]
    assert db.parents == hb.parents == [-1, -1, 1, 0, 1]
    assert db.depths == hb.depths and db.path(4) == hb.path(4) == [1, 4]
    for br, cm in ((hb, host), (db, dev)):
        br.keep(4)
        assert cm.length == 6
    nxt = [cm.forward(torch.tensor([[8]])).logits[0, -1] for cm in (host, dev)]
    torch.testing.assert_close(nxt[1], nxt[0])
    with pytest.raises(ValueError, match="needs a layer grown before it"):
        Branches(dev).grow_layer(torch.tensor([1]), torch.tensor([0]))
