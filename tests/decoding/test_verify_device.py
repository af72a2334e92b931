"""Verification on the device: one host read per call, counted by :class:`pardec.testing.VirtualCUDA`, with the
same outputs as on the CPU; within whole generations too (sps, medusa, spectr). K-SEQ's factor solved exactly, held
to hand-computed values and to the 40-step bisection it replaced (kept here as the reference). Tree buffers built
once per tree shape; drafts that are made on the device stay there."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import pardec.decoding.base as base_mod
import pardec.decoding.heads as heads_mod
import pardec.decoding.spectr as spectr_mod
import pardec.decoding.sps as sps_mod
import pardec.decoding.tree as tree_mod
from pardec.config import SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.heads import typical_accept
from pardec.decoding.kseq import kseq_factors, verify_tree_iid
from pardec.decoding.sampling import sample, warp
from pardec.decoding.tree import Tree
from pardec.decoding.tree_search import save_tree
from pardec.decoding.verify import verify_chain, verify_tree
from pardec.models.cached import CachedModel
from pardec.testing import VirtualCUDA
from tests.conftest import noisy, tiny
from tests.decoding.drafters import drafter_params
from tests.decoding.test_spectr import kseq_factor
from tests.stats import chi_square_p

V = 7
GREEDY = SamplingConfig()
SAMPLED = SamplingConfig(temperature=0.8, top_k=6, top_p=0.95, seed=1)


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 2


def _run(fn, seed: int, *tensors):
    """``fn(gen, *tensors)`` on the CPU and with ``tensors`` on a virtual GPU: (CPU result, GPU result, host syncs
    of the GPU run). The generators are seeded alike, so the two runs draw the same numbers."""
    cpu = fn(torch.Generator().manual_seed(seed), *tensors)
    with VirtualCUDA() as vc:
        placed = [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]
        vc.place([t for t in placed if isinstance(t, torch.Tensor)])
        out = fn(torch.Generator(device="cuda").manual_seed(seed), *placed)
    return cpu, out, sum(vc.syncs.values())


# ---------------------------------------------------------------------------------------------- chains
@pytest.mark.parametrize("k", [0, 1, 4])
@pytest.mark.parametrize("mode", ["greedy", "sampled", "sampled_q"])
def test_chain_verification_reads_back_once(k, mode):
    logits = _logits(k + 1, k)
    draft = logits[:k].argmax(-1)  # the target's own choices: long accepted prefixes
    if k > 1:
        draft[-1] = (draft[-1] + 1) % V  # and a rejection at the end
    q = warp(_logits(k, 10 + k), SAMPLED)
    s = GREEDY if mode == "greedy" else SAMPLED

    def run(gen, draft, logits, q):
        return verify_chain(draft, logits, s, gen, q if mode == "sampled_q" else None)

    cpu, gpu, syncs = _run(run, 5, draft, logits, q)
    assert gpu == cpu and 1 <= len(cpu) <= k + 1
    assert syncs == 1  # before: greedy 4 (two .cpu(), nonzero, tolist); sampled 3 per drafted token


def test_chain_first_rejection_and_its_residual_by_hand():
    """p(d_1) = 1 accepts d_1 for sure, p(d_2) = 0 rejects d_2 for sure; the token after d_1 then comes from p
    without d_2 (one-hot draft) or from max(0, p - q) (draft distribution q)."""
    logits = torch.full((4, V), -30.0)
    logits[0, 3] = 0.0  # p_1 = one-hot 3
    logits[1, :3] = 0.0  # p_2: uniform over 0, 1, 2; d_2 = 5 has p 0
    draft = torch.tensor([3, 5, 1])
    s = SamplingConfig(temperature=1.0)
    q = torch.zeros(3, V)
    q[0, 3], q[1, 5], q[2, 1] = 1.0, 0.5, 1.0
    q[1, 0] = 0.5  # max(0, p_2 - q_2) keeps 1 and 2 only
    seen, seen_q = Counter(), Counter()
    for seed in range(60):
        out = verify_chain(draft, logits, s, torch.Generator().manual_seed(seed))
        assert out[0] == 3 and len(out) == 2
        seen[out[1]] += 1
        out = verify_chain(draft, logits, s, torch.Generator().manual_seed(seed), q)
        assert out[0] == 3 and len(out) == 2
        seen_q[out[1]] += 1
    assert set(seen) == {0, 1, 2} and set(seen_q) == {1, 2}


# ---------------------------------------------------------------------------------------------- trees
PATHS = [[1, 2, 3], [1, 4], [5, 6], [0]]


def _tree_q(tree: Tree) -> dict[int, torch.Tensor]:
    """Draft distributions for the nodes with children (the root and node 1's children drawn from them)."""
    return {i: warp(_logits(1, 20 + i)[0], SAMPLED) for i in range(len(tree)) if tree.children[i]}


@pytest.mark.parametrize("mode", ["greedy", "sampled", "sampled_q", "device_labels"])
def test_tree_verification_reads_back_once(mode):
    tree = Tree.from_paths(PATHS)
    n = len(tree)
    s = GREEDY if mode == "greedy" else SAMPLED
    hits = Counter()
    q = _tree_q(tree)
    for seed in range(6):
        logits = _logits(n, seed)
        if seed % 2:  # make the target agree with the first path (deep acceptances)
            for node, tok in ((0, 1), (1, 2), (2, 3)):
                logits[node, tok] = 8.0

        def run(gen, logits, *qs):
            t = Tree.from_paths(PATHS)  # a tree's device buffers belong to the run that made them
            t = t.relabel(torch.tensor(t.labels, device=logits.device)) if mode == "device_labels" else t
            return verify_tree(t, logits, s, gen, dict(zip(q, qs)) if mode == "sampled_q" else None)

        cpu, gpu, syncs = _run(run, seed, logits, *q.values())
        assert gpu == cpu and [tree.labels[i] for i in cpu.path[1:]] == cpu.tokens[:-1]
        assert syncs == 1  # before: greedy 1, sampled 3 per child tried + 1 (the final sample)
        hits[len(cpu.path)] += 1
    assert max(hits) >= 3  # deep paths were taken


def test_tree_sampling_tries_siblings_in_order_by_hand():
    """Deterministic children: a child of probability 0 is always rejected, then one of probability 1 (in what is
    left) always accepted; when every child is rejected the token comes from p without them."""
    tree = Tree.from_paths([[1], [2, 3], [4]])  # root children 1, 2, 4; node 2 has child 3
    logits = torch.full((len(tree), V), -30.0)
    logits[0, 2] = 0.0  # the root: token 2 only (children 1 rejected, 2 accepted)
    logits[2, [3, 5, 6]] = 0.0  # after 2: 3, 5, 6 equally likely
    s = SamplingConfig(temperature=1.0)
    after = Counter()
    for seed in range(80):
        v = verify_tree(tree, logits, s, torch.Generator().manual_seed(seed))
        assert v.path[:2] == [0, 2]
        after[tuple(v.tokens[1:])] += 1
    # at node 2: child 3 accepted with p 1/3 (then any token from node 3's flat row), else 5 or 6 (3 removed)
    assert {(5,), (6,)} <= set(after) and any(t[0] == 3 and len(t) == 2 for t in after)
    assert all(t in ((5,), (6,)) or (t[0] == 3 and len(t) == 2) for t in after)


def test_iid_tree_verification_reads_back_once():
    seqs = [[1, 2], [1, 3], [4, 2], [1, 2]]  # four i.i.d. sequences: repeats at the root and below
    tree = Tree.from_paths(seqs)
    prefix = {i: tree.label_path(i) for i in range(len(tree))}
    draws_by_prefix = {(): [1, 1, 4, 1], (1,): [2, 3, 2], (4,): [2]}
    draws = {i: draws_by_prefix[key] for i, key in prefix.items() if key in draws_by_prefix}
    q = {i: warp(_logits(1, 40 + i)[0], SAMPLED) for i in draws}
    lengths = Counter()
    for seed in range(8):
        logits = _logits(len(tree), 50 + seed)

        def run(gen, logits, *qs):
            return verify_tree_iid(Tree.from_paths(seqs), logits, SAMPLED, gen, dict(zip(q, qs)), draws)

        cpu, gpu, syncs = _run(run, seed, logits, *q.values())
        assert gpu == cpu
        assert syncs == 1  # before: 40 bisection reads + 1 per draw tried, per node on the path, + 1
        lengths[len(cpu.path)] += 1
    assert len(lengths) >= 2


@pytest.mark.parametrize("next_token", ["greedy", "sample", "typical"])
def test_typical_acceptance_reads_back_once(next_token):
    tree = Tree.from_paths(PATHS)
    logits = _logits(len(tree), 3)
    logits[0, 1] = logits[1, 2] = 6.0

    def run(gen, logits):
        return typical_accept(Tree.from_paths(PATHS), logits, SAMPLED, gen, threshold=0.09, alpha=0.3,
                              next_token=next_token)

    cpu, gpu, syncs = _run(run, 0, logits)
    assert gpu == cpu and cpu.path[:3] == [0, 1, 2]
    assert syncs == 1  # before: 2 (the pass/score read, then the next token)


# ---------------------------------------------------------------------------------------------- K-SEQ
def _bisection(p: torch.Tensor, q: torch.Tensor, m: int, iters: int = 40) -> float:
    """The factor search ``kseq_factor`` ran before (a reference): 40 halvings of [1, m], each evaluating
    ``beta(g)`` over the whole vocabulary and reading it back."""
    def total(g: float) -> float:
        beta = float(torch.minimum(q, p / g).sum())
        return sum((1.0 - beta) ** i for i in range(m))

    lo, hi = 1.0, float(m)
    if total(lo) <= lo + 1e-6:
        return lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if total(mid) <= mid:
            hi = mid
        else:
            lo = mid
    return hi


def test_kseq_factor_by_hand():
    # p = (.75, .25), q = (1, 0): beta(g) = .75 / g; m = 2: g >= 2 - .75 / g, i.e. (g - .5)(g - 1.5) >= 0: g = 1.5
    assert kseq_factor(torch.tensor([0.75, 0.25]), torch.tensor([1.0, 0.0]), 2) == pytest.approx(1.5, abs=1e-11)
    # p = (.6, .4), q = (.3, .7): on [1, 2] (token 0's ratio is 2) beta = .3 + .4 / g; m = 2: g^2 - 1.7 g + .4 >= 0
    p, q = torch.tensor([0.6, 0.4], dtype=torch.float64), torch.tensor([0.3, 0.7], dtype=torch.float64)
    assert kseq_factor(p, q, 2) == pytest.approx((1.7 + math.sqrt(1.29)) / 2, abs=1e-11)
    # m = 3: g = 1 + y + y^2 with y = .7 - .4 / g, a cubic with its root in the same piece
    g = kseq_factor(p, q, 3)
    y = 0.7 - 0.4 / g
    assert 1.0 < g < 2.0 and g == pytest.approx(1 + y + y * y, abs=1e-10)
    # one draw, or a draft equal to the target: plain speculative sampling
    assert kseq_factor(p, q, 1) == 1.0 and kseq_factor(p, p.clone(), 5) == 1.0
    # disjoint supports: nothing is ever accepted, the condition holds at g = m only
    assert kseq_factor(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), 4) == pytest.approx(4.0)


def _slack(p: torch.Tensor, q: torch.Tensor, m: int, g: float) -> float:
    """``g - sum_{i<m} (1 - beta(g))^i``: >= 0 where ``g`` keeps K-SEQ exact."""
    beta = float(torch.minimum(q, p / g).sum())
    return g - sum((1.0 - beta) ** i for i in range(m))


@pytest.mark.parametrize("v", [2, 6, 50])
def test_kseq_factor_equals_the_bisection(v):
    same = 0
    for seed in range(12):
        g = torch.Generator().manual_seed(seed)
        # float64, so that the reference's own rounding (it sums beta in the inputs' dtype) stays far below the
        # tolerance
        p = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * (1 + seed % 3), -1)
        q = torch.softmax(torch.randn(v, generator=g, dtype=torch.float64) * (1 + seed % 3), -1)
        if seed % 4 == 1:  # zeros: tokens the target or the draft cannot produce
            p[: v // 2] = 0.0
            p /= p.sum()
        if seed % 4 == 2:
            q[v // 2 :] = 0.0
            q /= q.sum()
        ms = [1, 2, 3, 5, 8, 16]
        batch = kseq_factors(p.expand(len(ms), -1), q.expand(len(ms), -1), torch.tensor(ms))
        for m, got in zip(ms, batch.tolist()):
            assert got == kseq_factor(p, q, m)
            ref = _bisection(p, q, m)
            assert _slack(p, q, m, got) >= -1e-12  # exact (to rounding)
            assert got <= ref + 1e-9  # never a larger factor (fewer acceptances) than the bisection's
            if abs(got - ref) < 1e-9:  # the bisection's last step on [1, 16] is 1.4e-11
                same += 1
            else:  # only where the condition is flat at 0 to rounding and the bisection's halvings lost the sign
                assert abs(_slack(p, q, m, ref)) < 1e-12 and got < ref
    assert same >= 12 * 6 - 2


def test_kseq_factor_needs_no_host_sync():
    p, q = warp(_logits(3, 0), SAMPLED), warp(_logits(3, 1), SAMPLED)
    with VirtualCUDA() as vc:
        vc.place([p, q])
        m = torch.tensor([2, 3, 4], device="cuda")
        g = kseq_factors(p, q, m)
        assert g.device.type == "cuda"
    assert not vc.syncs


# ---------------------------------------------------------------------------------------------- sampling
def test_sample_follows_each_rows_distribution_and_never_draws_a_zero():
    """:func:`sample` (an inverse transform): each row's draws follow that row's probabilities (chi-square, 20000
    draws a row, weights not normalised), tokens of probability 0 (top-k / top-p cut them) are never drawn, the
    shape is [..., 1], and a seed gives the same draws."""
    flat = SamplingConfig(temperature=2.0, top_k=5, seed=1)  # 5 of the 7 tokens kept: two zeros a row
    weights = warp(_logits(3, 9), flat) * torch.tensor([[1.0], [3.0], [0.5]])  # not normalised
    n = 20000
    draws = sample(weights[:, None].expand(3, n, V), torch.Generator().manual_seed(3))  # [3, n, 1]
    assert draws.shape == (3, n, 1) and draws.dtype == torch.long
    for r in range(3):
        p = weights[r] / weights[r].sum()
        counts = Counter(draws[r, :, 0].tolist())
        assert all(p[x] > 0 for x in counts), (r, counts)
        pv, dof = chi_square_p(counts, {x: float(p[x]) for x in range(V) if p[x] > 0}, n)
        assert dof == 4 and pv > 1e-3, (r, pv, dof)
    again = sample(weights[:, None].expand(3, n, V), torch.Generator().manual_seed(3))
    assert torch.equal(draws, again)
    assert sample(weights[1], torch.Generator().manual_seed(0)).shape == (1,)


# ---------------------------------------------------------------------------------------------- whole generations
def _per_call_syncs(vc: VirtualCUDA, fn, record: list):
    def wrapped(*a, **kw):
        before = sum(vc.syncs.values())
        out = fn(*a, **kw)
        record.append(sum(vc.syncs.values()) - before)
        return out

    return wrapped


def _generate(method: str, s: SamplingConfig, n: int = 16, **params):
    lm = tiny(0)
    draft = CachedModel(noisy(0), name="draft:noisy") if method in ("sps", "spectr", "ouroboros", "mjsd", "bild") \
        else None
    dec = build_decoder(method, CachedModel(lm.model), lm.tokenizer, draft, **{**drafter_params(method, lm.model),
                                                                               **params})
    ids = lm.tokenizer("def fibonacci(n):\n    return")["input_ids"]
    return dec, lambda: dec.generate(ids, n, Stopper(lm.tokenizer), s)


@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_sps_steps_verify_with_one_read_and_keep_drafts_on_the_device(s, monkeypatch):
    noisy(0)
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        dec, run = _generate("sps", s)
        verify, drafts = [], []
        monkeypatch.setattr(base_mod, "verify_chain_reading", _per_call_syncs(vc, base_mod.verify_chain_reading, verify))
        draft_chain = sps_mod.draft_chain

        def seen(*a, **kw):
            chain = draft_chain(*a, **kw)
            drafts.append((chain.tokens.device.type, None if chain.q is None else chain.q.device.type))
            return chain

        monkeypatch.setattr(sps_mod, "draft_chain", seen)
        res = run()
    assert len(res.tokens) == 16 and verify and set(verify) == {1}
    assert set(drafts) == {("cuda", None if s.greedy else "cuda")}


@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["medusa", "firp"])
def test_tree_drafters_read_back_once_and_build_tree_buffers_once_per_shape(method, s, monkeypatch):
    built = []
    make = tree_mod._buffers

    def counted(parents, st, device):
        built.append((tuple(parents), device))
        return make(parents, st, device)

    monkeypatch.setattr(tree_mod, "_buffers", counted)
    tiny(0)  # loaded (and cached) outside the mode: its seeded init forks the RNG of every visible CUDA device
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        dec, run = _generate(method, s, n=24)
        verify, candidates, labels = [], [], []
        monkeypatch.setattr(heads_mod, "verify_tree", _per_call_syncs(vc, heads_mod.verify_tree, verify))
        cands = _per_call_syncs(vc, dec.candidates, candidates)

        def seen(drafts, depth):
            tree = cands(drafts, depth)
            if len(tree) > 1:
                labels.append(tree.labels.device.type if isinstance(tree.labels, torch.Tensor) else "host")
            return tree

        dec.candidates = seen
        res = run()
    steps = len(res.accepted) - 1
    assert len(res.tokens) == 24 and len(verify) == steps and set(verify) == {1}
    assert set(candidates) == {0}  # drafts never read back to build the tree
    assert set(labels) == {"cuda"}  # the candidate tokens stay on the device
    assert len(built) == len(set(built)) <= dec.k + 1  # once per (shape, device): a shape per tree depth


def test_spectr_steps_verify_with_one_read(monkeypatch):
    noisy(0)
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        dec, run = _generate("spectr", SAMPLED, k=3, gamma=3)
        verify = []
        monkeypatch.setattr(spectr_mod, "verify_tree_iid", _per_call_syncs(vc, spectr_mod.verify_tree_iid, verify))
        res = run()
    assert len(res.tokens) == 16 and verify and set(verify) == {1}


@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["sps", "lookahead"])
def test_whole_rounds_read_the_host_once(method, s):
    """A whole round reads the device once: the verification's read. `sps`: the draft's own proposals are fed back
    as device tensors and confirmed from that read (``CachedModel.confirm``), so the next round's catch-up compares
    on the host (before: ~2.6 blocking copies of proposal chunks per round, found by ``python -m pardec.bench gpu-smoke`` on an
    H200: 4.6 host syncs per target forward). `lookahead`: the window's next guesses ride on the verification's
    read (``verify_tree(extra=...)``; before: a second read per step). Not counted: the waits on the finiteness
    flags' events (``check_finite``), which the round's read has already passed."""
    noisy(0)
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        _, run = _generate(method, s, n=24)
        res = run()
    reads = sum(n for name, n in vc.syncs.items() if name not in ("cuda.Event.synchronize", "cuda.synchronize"))
    # per round one read; the prefill's first token and the prompt's tolist once
    assert reads <= res.target_forwards + 1, dict(vc.syncs)
    assert vc.async_copies["to cpu"] >= res.target_forwards  # the finiteness flags, without a wait


@pytest.mark.slow
@pytest.mark.parametrize("s", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_ouroboros_reads_the_host_once_per_forward_of_either_model(s):
    """Ouroboros drafts with the draft's own lookahead window and pool, a verification per draft forward, then one
    target verification per round: one host read per forward of either model. The window's next guesses and the
    target's tokens after every node (pool refinement and harvest) ride on the verifications' reads, and the draft's
    kept tokens are settled as host values (``CachedModel.settle``) so its next ``sync`` reads nothing back
    (before: ~25 reads per target forward on this tiny pair, three per draft forward)."""
    noisy(0)
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        _, run = _generate("ouroboros", s, n=24)
        res = run()
    assert len(res.tokens) == 24 and res.draft_forwards > res.target_forwards
    reads = sum(n for name, n in vc.syncs.items() if name not in ("cuda.Event.synchronize", "cuda.synchronize"))
    assert reads <= res.target_forwards + res.draft_forwards + 2, dict(vc.syncs)


@pytest.mark.parametrize("s", [pytest.param(GREEDY, id="greedy"), pytest.param(SAMPLED, id="sampled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method,per_target,per_draft", [
    ("jacobi", 1, 0),  # the next guesses ride on the verification's read (before: 1.94 per forward)
    ("mjgd", 0.5, 0),  # one read per beam search of K target forwards (before: 2.94, then 1 per beam step)
    ("mjsd", 2, 0),  # one per beam search, one per verification: log p and the next token together (12.3, then 4.3)
    ("bild", 1, 1),  # the draft's confidence per draft step; the rollback, draft and next token in one (before: 2.9)
    ("sdsat", 1, 0),  # the next tree's candidates ride on the verification's read (before: 2; sampled 67.6)
    ("spectr", 2, 0),  # the k sequences grown on the device, read once per round, + the verification (before: 4.7)
    ("eagle3", 1, 0),  # the dynamic tree built on the device (DeviceTree): the verification's read only
    ("dflash", 1, 0),  # the block drafted on the device: the verification's read only
    ("dflash_tree", 1, 0),  # the slots' top ranks relabel the rank tree on the device: the verification's read only
])
def test_reads_per_forward(method, per_target, per_draft, s, tmp_path):
    """Host reads of whole generations on a virtual GPU, against each method's budget per forward of the target
    and of the draft (+2: the prompt and the prefill's first token). Found with ``VirtualCUDA(trace=True)``."""
    noisy(0)
    params = {"tree": str(save_tree(tmp_path / "T.json", "T", [[0], [1], [0, 0], [0, 1], [0, 0, 0]]))} \
        if method == "dflash_tree" else {}
    method = method.removesuffix("_tree")
    drafter_params(method, tiny(0).model)  # (a drafter fitted on the CPU, before the model is placed)
    with VirtualCUDA(trace=True) as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        _, run = _generate(method, s, n=24, **params)
        res = run()
    assert len(res.tokens) == 24
    reads = sum(n for name, n in vc.syncs.items() if name not in ("cuda.Event.synchronize", "cuda.synchronize"))
    budget = per_target * res.target_forwards + per_draft * res.draft_forwards + 2
    assert reads <= budget, (reads, budget, vc.sync_sites.most_common(6))


def test_trace_names_where_reads_happen():
    with VirtualCUDA(trace=True) as vc:
        t = torch.ones(3, device="cuda")
        t.tolist()
        from pardec.decoding.verify import verify_chain
        verify_chain([1], torch.zeros(2, 4, device="cuda"), GREEDY, None)
    assert vc.syncs["tolist"] == 2
    sites = {w for (name, w) in vc.sync_sites}
    assert len(vc.sync_sites) == 2 and "?" in sites  # a read outside pardec (this test)
    assert any(w.startswith("decoding/verify.py:") for w in sites)


def test_settle_keeps_known_tokens_as_host_values():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    cm.prefill(torch.tensor([[5, 6, 7]]))
    cm.forward(torch.tensor([[11, 12]]))
    cm._tokens.parts[1:] = [p.to("meta") for p in cm._tokens.parts[1:]]  # as if they lived on an accelerator
    cm.settle([7, 11, 12])
    assert cm.length == 5 and cm._tokens.host()[0].tolist() == [5, 6, 7, 11, 12]
    assert cm.sync([5, 6, 7, 11, 13]) == [13]
    with pytest.raises(ValueError, match="settle: 5 values for a cache of 4 positions"):
        cm.settle([1, 2, 3, 4, 5])


def test_confirm_keeps_accepted_proposals_as_host_values_and_drops_the_rest():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    cm.prefill(torch.tensor([[5, 6, 7]]))
    for t in (11, 12, 13):  # a draft's proposals, fed back as device (here: CPU) tensors
        cm.forward(torch.tensor([[t]]))
    assert cm.length == 6
    cm._tokens.parts[1:] = [p.to("meta") for p in cm._tokens.parts[1:]]  # as if they lived on an accelerator
    cm.confirm([11, 12])  # two accepted; 13 rejected
    assert cm.length == 5
    assert cm._tokens.host()[0].tolist() == [5, 6, 7, 11, 12]
    assert cm.sync([5, 6, 7, 11, 12, 20]) == [20]  # the catch-up needs no read of the proposals
    cm.confirm([1, 2])  # fed only host tokens since: nothing to confirm
    assert cm.length == 5


@pytest.mark.parametrize("method", ["ar", "pld", "sps", "lookahead", "jacobi", "medusa", "firp", "sdsat", "mjsd",
                                    "mjgd", "spectr", "bild", "ouroboros", "eagle3", "dflash", "dflash_tree"])
@pytest.mark.slow
def test_no_blocking_upload_per_step(method, tmp_path):
    """Host tensors reach the device through pinned memory without blocking (``pardec.models.cached.to_device``):
    a plain upload from pageable memory makes the host wait for the stream, which the H200 smoke counted as one to
    two syncs per step (ids, positions, masks, tree labels, drafts made on the host). Left: the prompt's upload,
    the cache's rare growth and, for tree drafters, a rank tree per depth (built once), a handful per generation
    whatever its length."""
    noisy(0)
    params = {"tree": str(save_tree(tmp_path / "T.json", "T", [[0], [1], [0, 0], [0, 1], [0, 0, 0]]))} \
        if method == "dflash_tree" else {}
    method = method.removesuffix("_tree")
    drafter_params(method, tiny(0).model)  # (a drafter fitted on the CPU, before the model is placed)
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        dec, run = _generate(method, GREEDY, n=24, **params)
        before = sum(vc.uploads.values())  # (loading a drafter's weights onto the device is not a step)
        res = run()
    assert len(res.tokens) == 24
    # (the rank trees, one per depth, built once: the heads' k + 1, DFlash's as the room left cuts it at the end)
    per_shape = dec.k + 1 if method in ("medusa", "firp") else 4 if params else 0
    assert sum(vc.uploads.values()) - before <= 4 + per_shape, dict(vc.uploads)
