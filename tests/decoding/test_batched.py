"""Batched decoding (``batch_size > 1``, :mod:`pardec.decoding.batch`): under greedy fp32 every row's output equals
its prompt's batch-1 ``ar`` output token for token, whatever its neighbours: prompts of very different lengths, rows
finishing early (EOS) while waiting prompts take their rows, rows accepting different numbers of drafted tokens every
round; the ragged cache's forward equals batch-1 forwards; one host read per round; bad input refused before any
model is wrapped. (Sampled rows: tests/decoding/test_batched_distribution.py.)"""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.batch import BATCHED, build_batched, run_batch
from pardec.models.cached import CachedModel
from pardec.models.ragged import RaggedModel
from pardec.testing import VirtualCUDA
from pardec.testing.graphs import EagerGraph, eager_cuda_graphs
from tests.conftest import noisy, tiny
from tests.decoding.drafters import drafter_params, vocab_dir
from tests.models.forward.test_compiled import needs_compiler

TEXTS = ["def fibonacci(n):\n    return",
         "The capital of France is Paris. The capital of Spain is Madrid. The capital of Italy is",
         "x = 1\ny = 2\nz = x + y\nprint(z)\n" * 4,
         "Hello",
         "for i in range(10):\n    print(i)\nfor j in range(10):\n",
         "a b c a b c a b"]
N_NEW = 24


def _prompts(lm) -> list[list[int]]:
    """The texts, and the short prompt the test drafters were fitted on (tests/decoding/drafters.py: their drafts are
    often right after it)."""
    return [lm.tokenizer(t)["input_ids"] for t in TEXTS] + [[1, 504, 1812]]


def _reference(lm, prompts, stop) -> list[list[int]]:
    return [build_decoder("ar", CachedModel(lm.model), lm.tokenizer).generate(p, N_NEW, stop).tokens for p in prompts]


def _early_stop(lm, prompts) -> Stopper:
    """EOS = the 4th token of the second prompt's greedy continuation: some rows end early, others run on."""
    ref = _reference(lm, prompts[1:2], Stopper())[0]
    return Stopper(lm.tokenizer, eos_ids={ref[3]})


TRAINED = ("eagle3", "dflash", "medusa", "medusa_typical", "firp")  # the methods that read a drafter


def _batched(method: str, batch_size: int, draft: str | None = None, **params):
    lm = tiny(0)
    model = {"self": lm.model, "noisy": noisy(0)}[draft] if draft else None
    if method in TRAINED:  # drafters of tests/decoding/drafters.py (eagle3, dflash: fitted to the target's own
        params = {**drafter_params(method, lm.model), **params}  # continuations)
    return build_batched(method, lm.model, batch_size, 64, lm.tokenizer, model, **params)


OUROBOROS = {"gamma": 3, "window": 3, "guess_set": 3, "level": 3, "top_k_phrases": 2}
CASES = {"ar": ("ar", None, {}), "pld": ("pld", None, {"num_pred": 5}),
         "sps_noisy": ("sps", "noisy", {"gamma": 3}),  # partial acceptance: rows accept different counts
         "sps_self": ("sps", "self", {"gamma": 3}),  # every draft accepted: the draft is fed two tokens next round
         "jacobi": ("jacobi", None, {"block_size": 4}),  # rows start blocks at different rounds
         "eagle3": ("eagle3", None, {"mode": "chain", "num_speculative_tokens": 3}),  # its drafter's own ragged cache
         # EAGLE-2's dynamic tree: every row's tree of one size and its own shape, verified under its own mask
         "eagle3_tree": ("eagle3", None, {"total_tokens": 8, "depth": 3, "top_k": 2}),
         "dflash": ("dflash", None, {}),  # blocks of 4: 3 drafts a row
         "medusa": ("medusa", None, {}),  # a tree per row (tests/decoding/drafters.py's tree T), compacted per row
         # pseudo states born from each row's accepted node after the verification (the paper's "No masked")
         "firp": ("firp", None, {}), "firp_real": ("firp", None, {"attention": "real"}),
         "medusa_typical": ("medusa_typical", None, {}),  # greedy: the shared tree rule
         # a trie of another shape per row, beside a window in another phase per row (rows admitted later)
         "lookahead": ("lookahead", None, {"level": 3, "window": 3, "guess_set": 3, "pool_from_output": True}),
         "lookahead_n2": ("lookahead", None, {"level": 2, "window": 2, "guess_set": 2, "pool_from_prompt": True}),
         # the target drafts for itself (adaptive tokens after each row's drafts; an untrained model's drafts:
         # tests/decoding/test_batched_sdsat.py forces them)
         "sdsat": ("sdsat", None, {"k": 3, "variant": "fused", "tree": "caterpillar", "adaptive_ids": [511]}),
         # k draft rows per request (the draft's cache holds batch_size * k rows), a trie of its own size per row
         "spectr": ("spectr", "noisy", {"k": 3, "gamma": 3}),
         # the draft's own lookahead per row (rows finish drafting at different forwards), a tree of draft and
         # phrases per row; a pool per request (warm_start off: each row's rounds are batch-1's), or one for the run
         "ouroboros": ("ouroboros", "noisy", {**OUROBOROS, "warm_start": False}),
         "ouroboros_warm": ("ouroboros", "self", OUROBOROS)}


@pytest.mark.parametrize("batch_size", [2, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_every_row_equals_its_batch_one_ar_output(case, batch_size):
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    ref = _reference(lm, prompts, stop)
    assert min(map(len, ref)) < N_NEW == max(map(len, ref))  # some rows end early, some run to the limit
    method, draft, params = CASES[case]
    run = run_batch(_batched(method, batch_size, draft, **params), prompts, N_NEW, stop)
    assert [r.tokens for r in run.results] == ref
    assert run.batch_size == batch_size and run.tokens == sum(map(len, ref))
    assert run.rounds < run.tokens - len(prompts)  # rows shared rounds
    for r in run.results:
        assert r.target_forwards == len(r.accepted) and sum(r.accepted) == len(r.tokens)
        assert 0 < r.prefill_s <= r.total_s <= run.wall_s
    if case not in ("ar", "jacobi", "medusa", "medusa_typical", "firp", "firp_real", "lookahead_n2", "sdsat"):
        # (not: Jacobi on an untrained model, untrained heads and projections, level-2 n-grams, an untrained model's
        # adaptive tokens)
        accepted = [a for r in run.results for a in r.accepted[1:]]
        assert max(accepted) >= 3  # drafts were accepted several deep
        if case == "sps_self":
            assert all(r.draft_accepted == r.drafted for r in run.results)
    if case == "ouroboros_warm":  # one pool for the run: each row's rounds depend on its neighbours (module doc);
        # pool phrases lengthened drafts and were accepted (more than the draft's gamma tokens + the target's)
        assert max(a for r in run.results for a in r.accepted) > params["gamma"] + 1
        return
    # each row drafted and accepted as the batch-1 method does on its prompt alone
    lm_draft = {"self": lm.model, "noisy": noisy(0)}.get(draft)
    single = build_decoder(method, CachedModel(lm.model), lm.tokenizer,
                           None if lm_draft is None else CachedModel(lm_draft),
                           **_single_params(method, lm, params))
    alone = [single.generate(p, N_NEW, stop).accepted for p in prompts]
    if case == "eagle3_tree":  # batch-1 cuts a tree's depth to the room left; a row's tree keeps it (module doc)
        alone, ours = [a[:-1] for a in alone], [r.accepted[:-1] for r in run.results]
    else:
        ours = [r.accepted for r in run.results]
    assert ours == alone


@pytest.mark.parametrize("variant", ["bild", "mjsd"])
def test_bild_rows_equal_batch_one_bild(variant):
    """BiLD is approximate: under greedy decoding each row's output is batch-1 ``bild``'s on its prompt, token for
    token and round for round, while the rows' chains fall back at different steps and are rolled back in different
    rounds (and the output is not ``ar``'s)."""
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    params = {"fallback_threshold": BILD_FALLBACK, "rollback_threshold": BILD_ROLLBACK, "max_draft": 4,
              "variant": variant}
    run = run_batch(_batched("bild", 3, "noisy", **params), prompts, N_NEW, stop)
    single = build_decoder("bild", CachedModel(lm.model), lm.tokenizer, CachedModel(noisy(0)), **params)
    alone = [single.generate(p, N_NEW, stop) for p in prompts]
    assert [r.tokens for r in run.results] == [a.tokens for a in alone]
    assert [(r.accepted, r.drafted, r.draft_accepted) for r in run.results] == \
        [(a.accepted, a.drafted, a.draft_accepted) for a in alone]
    # the mechanism at work: fallbacks before max_draft, rollbacks, and drafts the target would not have chosen
    assert 0 < sum(a.extras["fallback_rate"] for a in alone) < len(alone)
    assert sum(a.extras["rollback_rate"] for a in alone) > 0
    assert [r.tokens for r in run.results] != _reference(lm, prompts, stop)


@pytest.mark.parametrize("params", [{"gamma": 3, "num_beams": 3}, {"gamma": 4, "num_beams": 4, "width": 2},
                                    {"gamma": 3, "num_beams": 2, "ratio": "raw", "tau": 0.3}])
def test_mjsd_rows_equal_batch_one_mjsd(params):
    """MJSD is approximate: under greedy decoding each row's output is batch-1 ``mjsd``'s on its prompt, token for
    token and round for round, while every request's beams are searched together (each row's beams fed as chains
    after its prefix, no beam in the cache), one beam or a trie of two verified per row, and rows near their limit
    take their beams after fewer steps than their neighbours search."""
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    run = run_batch(_batched("mjsd", 3, "noisy", **params), prompts, N_NEW, stop)
    single = build_decoder("mjsd", CachedModel(lm.model), lm.tokenizer, CachedModel(noisy(0)), **params)
    alone = [single.generate(p, N_NEW, stop) for p in prompts]
    assert [(r.tokens, r.accepted, r.drafted) for r in run.results] == [(a.tokens, a.accepted, a.drafted)
                                                                        for a in alone]
    assert [r.tokens for r in run.results] != _reference(lm, prompts, stop)  # the joint rule accepted its own
    assert max(a for r in run.results for a in r.accepted[1:]) >= 3


@pytest.mark.parametrize("params", [{"K": 3, "num_beams": 2}, {"K": 4, "num_beams": 3}])
def test_mjgd_rows_equal_batch_one_mjgd(params):
    """MJGD (the target's own beam search, committing its best beam each round) over a batch: each row's tokens,
    commits and target forwards are batch-1 ``mjgd``'s, while the rows' beams are searched together and rows near
    their limit search fewer steps."""
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    run = run_batch(_batched("mjgd", 3, **params), prompts, N_NEW, stop)
    single = build_decoder("mjgd", CachedModel(lm.model), lm.tokenizer, **params)
    alone = [single.generate(p, N_NEW, stop) for p in prompts]
    assert [(r.tokens, r.accepted, r.target_forwards) for r in run.results] == \
        [(a.tokens, a.accepted, a.target_forwards) for a in alone]
    assert [r.tokens for r in run.results] != _reference(lm, prompts, stop)  # the joint likelihood chose


def test_sampled_mjsd_rows_draw_beams_per_row_and_repeat_with_the_seed():
    """Beam sampling over a batch (2 x num_beams draws without replacement per row, pardec.decoding.drafting.beam_rows):
    rows run to their limit, accept drafted tokens, and the same seed draws the same rows again."""
    lm = tiny(0)
    prompts = _prompts(lm)
    s = SamplingConfig(temperature=1.0, seed=3)
    runs = [run_batch(_batched("mjsd", 3, "noisy", gamma=3, num_beams=3, tau=0.0), prompts, N_NEW, sampling=s)
            for _ in range(2)]
    assert [r.tokens for r in runs[0].results] == [r.tokens for r in runs[1].results]
    assert all(len(r.tokens) == N_NEW for r in runs[0].results)
    assert sum(r.draft_accepted for r in runs[0].results) > 0


@pytest.mark.parametrize("bar", ["paper", "zero"])
def test_sampled_medusa_typical_rows_accept_as_batch_one(bar):
    """Medusa's typical acceptance under sampling, with the paper's next token (the target's argmax) and top-k 1 (so
    the prefill's token is the argmax too): a deterministic rule, so each row's output equals batch-1
    ``medusa_typical``'s on its prompt, token for token and round for round, its tree cut to the room it has left as
    batch-1 cuts it (its accepted drafts need not be ``ar``'s)."""
    from pardec.config import SamplingConfig

    lm = tiny(0)
    prompts = _prompts(lm)
    s = SamplingConfig(temperature=1.0, top_k=1, seed=3)
    params = drafter_params("medusa_typical", lm.model)
    if bar == "zero":  # every candidate passes: the deepest path every round
        params |= {"posterior_threshold": 0.0, "posterior_alpha": 0.0}
    run = run_batch(build_batched("medusa_typical", lm.model, 3, 64, lm.tokenizer, **params), prompts, N_NEW,
                    sampling=s)
    single = build_decoder("medusa_typical", CachedModel(lm.model), lm.tokenizer, **params)
    alone = [single.generate(p, N_NEW, sampling=s) for p in prompts]
    assert [(r.tokens, r.accepted) for r in run.results] == [(a.tokens, a.accepted) for a in alone]
    accepted = {a for r in run.results for a in r.accepted[1:]}
    assert max(accepted) >= 3 and (bar == "zero" or len(accepted) >= 2), accepted
    with pytest.raises(ConfigError, match="method.next_token"):
        build_batched("medusa_typical", lm.model, 2, 64, **{**params, "next_token": "best"})


@pytest.mark.parametrize("attention", ["pseudo", "real"])
def test_firp_rows_draft_what_batch_one_drafts(attention):
    """Each row's pseudo-state drafts after every round (born from its accepted node after the verification) equal
    the drafts batch-1 ``firp`` keeps from its verification forward, to rounding (another layout of the same keys)."""
    lm = tiny(0)
    prompts = _prompts(lm)
    params = {**drafter_params("firp", lm.model), "attention": attention}
    m = build_batched("firp", lm.model, 3, 64, lm.tokenizer, **params)
    ours: dict[int, list] = {i: [] for i in range(len(prompts))}
    admit, round_ = m.admit, m.round

    def admitting(row):
        admit(row)
        ours[row.index].append(m.drafts[m.target.rows - 1].clone())

    def rounding(rows):
        round_(rows)
        for b, r in enumerate(rows):
            ours[r.index].append(m.drafts[b].clone())

    m.admit, m.round = admitting, rounding
    run_batch(m, prompts, N_NEW)
    for i, p in enumerate(prompts):
        single = build_decoder("firp", CachedModel(lm.model), lm.tokenizer, **params)
        theirs, drafts = [], single._drafts
        single._drafts = lambda state, node, drafts=drafts, theirs=theirs: theirs.append(drafts(state, node)) or \
            theirs[-1]
        single.generate(p, N_NEW)
        assert len(ours[i]) == len(theirs) > 3, i  # (batch-1 also drafts after its last round)
        for j, (a, b) in enumerate(zip(ours[i], theirs)):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (i, j, float((a - b).abs().max()))


#: tiny(0)'s distributions are nearly flat (largest probability ~2.2e-4 of 8192 ids, cross-entropies ~8.5 nats): at
#: these thresholds about half the noisy draft's chains fall back before max_draft and half are rolled back
BILD_FALLBACK, BILD_ROLLBACK = 2.2e-4, 8.45


def _single_params(method: str, lm, params: dict) -> dict:
    out = dict(params)
    if method in TRAINED:
        out.update(drafter_params(method, lm.model))
    return out


def test_a_dflash_draft_vocabulary_over_a_batch_drafts_and_accepts_as_batch_one():
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    ref = _reference(lm, prompts, stop)
    v = int(lm.model.config.vocab_size)
    params = {"draft_vocab": vocab_dir(sorted(set(range(0, v, 2)) | set(ref[0])), v)}
    run = run_batch(_batched("dflash", 3, **params), prompts, N_NEW, stop)
    assert [r.tokens for r in run.results] == ref
    single = build_decoder("dflash", CachedModel(lm.model), lm.tokenizer, None, **_single_params("dflash", lm, params))
    assert [r.accepted for r in run.results] == [single.generate(p, N_NEW, stop).accepted for p in prompts]


def test_rows_accept_different_counts_in_one_round():
    """pld over prompts with and without repetition: in some round one row accepts several drafted tokens while
    another accepts none."""
    lm = tiny(0)
    prompts = _prompts(lm)
    method = _batched("pld", 3, num_pred=5)
    seen = []
    verify = method.verify

    def recording(*a, **kw):
        out = verify(*a, **kw)
        seen.append([len(t) - 1 for t in out.tokens])
        return out

    method.verify = recording
    run_batch(method, prompts, N_NEW)
    assert any(max(r) >= 2 and min(r) == 0 for r in seen if len(r) > 1), seen


def test_continuous_batching_keeps_at_most_batch_size_rows_and_admits_as_rows_leave():
    lm = tiny(0)
    prompts = _prompts(lm)
    method = _batched("ar", 2)
    rows_seen = []
    round_ = method.round
    method.round = lambda rows: (rows_seen.append(len(rows)), round_(rows))
    stop = _early_stop(lm, prompts)
    run = run_batch(method, prompts, N_NEW, stop)
    assert max(rows_seen) == 2 and method.target.rows == 0
    assert [r.tokens for r in run.results] == _reference(lm, prompts, stop)
    # requests finish in order of admission and length: a later prompt finished before an earlier one did not start
    firsts = [r.prefill_s for r in run.results]
    assert firsts[2] > firsts[0] and firsts[2] > firsts[1]


def test_ragged_forward_equals_batch_one_forwards_with_trees():
    """Two rows of different lengths, a tree forward (depths, ancestor mask): each row's logits equal a batch-1
    CachedModel forward of the same tree; keeping each row's own path compacts each row to it."""
    lm = tiny(0)
    a, b = _prompts(lm)[:2]
    rag = RaggedModel(lm.model, 3, 8)  # a capacity it must grow past
    rag.add(a)
    rag.add(b)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    depths = torch.tensor([0, 1, 1, 2])
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    got = rag.forward(ids, depths=depths, attend=tree)
    for row, p in enumerate((a, b)):
        one = CachedModel(lm.model)
        one.prefill(torch.tensor([p]))
        want = one.forward(ids[row : row + 1], positions=len(p) + depths, attend=tree).logits[0]
        torch.testing.assert_close(got[row], want, rtol=1e-4, atol=1e-4)
    rag.keep_rows([len(a), len(b)], [[0, 1], [0, 2, 3]])  # row 0 keeps the path 0 -> 1, row 1 0 -> 2 -> 3
    assert rag.lengths == [len(a) + 2, len(b) + 3]
    nxt = rag.forward(torch.tensor([[3], [4]]))
    for row, kept, tok in ((0, a + [5, 6], 3), (1, b + [9, 11, 12], 4)):
        one = CachedModel(lm.model)
        one.prefill(torch.tensor([kept]))
        want = one.forward(torch.tensor([[tok]])).logits[0, 0]
        torch.testing.assert_close(nxt[row, 0], want, rtol=1e-4, atol=1e-4)


def _int8(attention: str):
    from pardec.config import ModelConfig
    from pardec.models.loading import load_model

    m = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu", dtype="int8", layers=3)).model
    m.config._attn_implementation = attention
    return m


def test_invariant_ragged_rows_are_bitwise_batch_one_one_token_steps():
    """``model.attn_implementation=invariant`` over a ragged batch of int8 rows: every query row of a round (a chain
    of several new tokens, then a tree) gives bitwise the logits of batch-1 ``ar``'s one-token step at that position
    (transformers' forward with the same attention), whatever the other rows hold."""
    lm = tiny(0)
    prompts = _prompts(lm)[:3]
    m = _int8("invariant")
    rag = RaggedModel(m, 3, 8)  # (a capacity it must grow past)
    firsts = [rag.add(p)[0] for p in prompts]
    chains = torch.tensor([[5, 6, 7], [9, 10, 11], [3, 3, 3]])
    got = rag.forward(chains)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    ids = torch.tensor([[4, 8, 9, 2], [7, 6, 5, 4], [1, 2, 3, 4]])
    treed = rag.forward(ids, depths=torch.tensor([0, 1, 1, 2]), attend=tree)
    for b, p in enumerate(prompts):  # batch-1 ar: one-token steps
        one = CachedModel(m)
        assert torch.equal(one.prefill(torch.tensor([p]))[0], firsts[b])
        for j, tok in enumerate(chains[b].tolist()):
            assert torch.equal(one.forward(torch.tensor([[tok]])).logits[0, 0], got[b, j]), (b, j)
        for path in ([0, 1], [0, 2, 3]):  # each root-to-node path of the tree, one token at a time
            alone = CachedModel(m)
            alone.prefill(torch.tensor([p + chains[b].tolist()]))
            for node in path:
                step = alone.forward(ids[b : b + 1, node : node + 1]).logits[0, 0]
                assert torch.equal(step, treed[b, node]), (b, path, node)


@pytest.mark.parametrize("case", ["pld", "medusa", "lookahead"])
def test_invariant_int8_rows_equal_batch_one_int8_ar(case):
    """int8 with invariant attention: every batched method's rows equal batch-1 int8 ``ar`` with the same attention
    token for token by construction (each verified position computed as ``ar``'s one-token step)."""
    lm = tiny(0)
    prompts = _prompts(lm)
    m = _int8("invariant")
    ref = [build_decoder("ar", CachedModel(m)).generate(p, N_NEW).tokens for p in prompts]
    method, _, params = CASES[case]
    if method == "medusa":
        params = {**drafter_params("medusa", m), **params}
    run = run_batch(build_batched(method, m, 3, 64, lm.tokenizer, **params), prompts, N_NEW)
    assert [r.tokens for r in run.results] == ref


@pytest.mark.parametrize("case", ["ar", "pld", "sps_noisy", "jacobi", "eagle3", "eagle3_tree", "dflash", "medusa",
                                  "lookahead", "sdsat", "firp", "spectr", "mjsd", "ouroboros_warm"])
def test_one_host_read_per_round_on_a_gpu(case):
    """On a (virtual) CUDA device: the same tokens as on the CPU, host reads = one per admission (its first token) +
    one per round (``spectr``, ``mjsd``: two, as batch-1's: the drafts, then the verification; ``ouroboros``: one
    per draft forward of the batch, as batch-1's per draft forward, + one), and the finiteness flags copied without
    a wait."""
    lm = tiny(0)
    prompts = _prompts(lm)[:4]
    method, draft, params = {**CASES, "mjsd": ("mjsd", "noisy", {"gamma": 3, "num_beams": 3, "width": 2})}[case]
    on_cpu = run_batch(_batched(method, 3, draft, **params), prompts, 12)
    noisy(0)
    with VirtualCUDA() as vc:
        vc.place(lm.model)
        vc.place(noisy(0))
        m = _batched(method, 3, draft, **params)
        on_cuda = run_batch(m, prompts, 12)
        # not counted: the run's clock (start, end) and the waits on the finiteness flags' events, as in
        # tests/decoding/test_verify_device.py
        reads = sum(n for k, n in vc.syncs.items() if k not in ("cuda.synchronize", "cuda.Event.synchronize"))
    assert [r.tokens for r in on_cuda.results] == [r.tokens for r in on_cpu.results]
    if case == "ouroboros_warm":
        assert reads == len(prompts) + on_cuda.rounds + m.draft_forwards, dict(vc.syncs)
    elif case in ("spectr", "mjsd"):  # (a round in which no row has room for a draft verifies alone: one read)
        assert len(prompts) + on_cuda.rounds < reads <= len(prompts) + 2 * on_cuda.rounds, dict(vc.syncs)
    else:
        assert reads == len(prompts) + on_cuda.rounds, dict(vc.syncs)
    assert vc.async_copies["to cpu"] >= on_cuda.rounds


@pytest.mark.parametrize("case", ["ar", "sps_noisy", "eagle3_tree", "medusa"])
def test_graphed_rows_equal_batch_one_ar(case):
    """forward_impl=cudagraph over a batch, on a virtual GPU with the capture an eager stand-in that keeps a graph's
    contract and the functions uncompiled (pardec.testing.graphs): every row equals its batch-1 ``ar`` output; the
    active rows are padded to a power of two (3 rows -> 4; 2 or 1 as rows leave at the end), one graph per padded
    row count, width and capture, the padding rows rows of the buffers past the active ones."""
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    ref = _reference(lm, prompts, stop)
    method, draft, params = CASES[case]
    params = {**(drafter_params(method, lm.model) if method in TRAINED else {}), **params}  # (fitted on the CPU)
    noisy(0)
    with VirtualCUDA() as vc, eager_cuda_graphs() as graphs:
        vc.place(lm.model)
        vc.place(noisy(0))
        dec = build_batched(method, lm.model, 3, 64, lm.tokenizer, {"noisy": noisy(0)}.get(draft),
                            forward_impl="cudagraph", **params)
        run = run_batch(dec, prompts, N_NEW, stop)
        shapes = [key[1][0] for by_buffers in [graphs.by_model[lm.model][1]] for g in by_buffers.values()
                  for key in g]
    assert [r.tokens for r in run.results] == ref
    assert 4 in {rows for rows, _ in shapes} <= {1, 2, 4}  # the padded row counts, never 3
    assert EagerGraph.captures >= len(set(shapes))


def test_bad_input_is_refused_before_any_model_is_wrapped():
    lm = tiny(0)
    with pytest.raises(ConfigError, match=r"batch_size=0 must be an integer >= 1"):
        build_batched("ar", lm.model, 0, 64)
    with pytest.raises(ConfigError, match=r"method 'hf_pld' has no batched implementation: batch_size > 1 runs "
                                          r"ar, bild, dflash, eagle3, firp, jacobi, lookahead, medusa, medusa_typical, "
                                          r"mjgd, mjsd, ouroboros, pld, sdsat, spectr, sps"):
        build_batched("hf_pld", lm.model, 2, 64)
    with pytest.raises(KeyError, match="unknown method 'nope'"):
        build_batched("nope", lm.model, 2, 64)
    with pytest.raises(ConfigError, match=r"method 'sps' has no parameter\(s\) \['adaptive'\]; valid: gamma"):
        build_batched("sps", lm.model, 2, 64, draft=noisy(0), adaptive=True)
    with pytest.raises(ConfigError, match="needs a draft model"):
        build_batched("sps", lm.model, 2, 64)
    with pytest.raises(ConfigError, match="method.num_pred"):
        build_batched("pld", lm.model, 2, 64, num_pred=0)
    m = build_batched("ar", lm.model, 2, 64)
    with pytest.raises(ValueError, match="empty prompt"):
        run_batch(m, [[1, 2], []], 4)
    with pytest.raises(ConfigError, match="method.guess_from"):
        build_batched("jacobi", lm.model, 2, 64, guess_from="nowhere")
    with pytest.raises(ConfigError, match=r"method.mode='beam' is not valid; choose one of: tree, chain"):
        build_batched("eagle3", lm.model, 2, 64, path="unused", mode="beam")
    with pytest.raises(ConfigError, match=r"method.top_k"):
        build_batched("eagle3", lm.model, 2, 64, path="unused", top_k=0)
    with pytest.raises(ConfigError, match="needs an EAGLE-3 drafter"):
        build_batched("eagle3", lm.model, 2, 64)
    with pytest.raises(ConfigError, match="needs a DFlash drafter"):
        build_batched("dflash", lm.model, 2, 64)
    with pytest.raises(ConfigError, match="level"):
        build_batched("lookahead", lm.model, 2, 64, level=1)
    with pytest.raises(ConfigError, match=r"method.variant='both' is not valid; choose one of: bild, mjsd"):
        build_batched("bild", lm.model, 2, 64, draft=noisy(0), variant="both")
    with pytest.raises(ConfigError, match="fallback_threshold"):
        build_batched("bild", lm.model, 2, 64, draft=noisy(0), fallback_threshold=1.5)
    assert BATCHED.names() == ["ar", "bild", "dflash", "eagle3", "firp", "jacobi", "lookahead", "medusa",
                               "medusa_typical", "mjgd", "mjsd", "ouroboros", "pld", "sdsat", "spectr", "sps"]


@needs_compiler  # TorchInductor compiles (one graph serves every row count, width and capacity)
def test_compiled_rows_equal_batch_one_ar():
    """``forward_impl=compiled``: every forward after a prefill runs as one compiled graph over the whole buffers; a
    tree with a hidden-state capture (``medusa``, its rows compacted to their accepted paths) keeps every row's greedy
    output equal to its batch-1 ``ar`` output, rows leaving and joining as in the lean forward, and the buffers
    growing past their first capacity (a dynamic dimension of the graph)."""
    lm = tiny(0)
    prompts = _prompts(lm)
    stop = _early_stop(lm, prompts)
    ref = _reference(lm, prompts, stop)
    m = build_batched("medusa", lm.model, 3, 16, lm.tokenizer, forward_impl="compiled",
                      **drafter_params("medusa", lm.model))
    assert m.target.compiled
    run = run_batch(m, prompts, N_NEW, stop)
    assert [r.tokens for r in run.results] == ref
    assert m.target.capacity > 16
    with pytest.raises(ValueError, match=r"forward_impl='graph' is not valid for a batch; choose one of: lean, "
                                         r"compiled"):
        build_batched("ar", lm.model, 2, 64, forward_impl="graph")
    with pytest.raises(ValueError, match=r"forward_impl=compiled cannot run .* its attention is invariant"):
        build_batched("ar", _int8("invariant"), 2, 64, forward_impl="compiled")


@pytest.mark.parametrize("method", ["ar", "pld"])
def test_int8_rows_equal_batch_one_int8_ar(method):
    """pardec's per-token int8 linears (each token its own activation scale) over a batch: every row's greedy output
    equals batch-1 int8 ``ar``'s."""
    from pardec.config import ModelConfig
    from pardec.models.loading import load_model

    lm = tiny(0)
    m = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu", dtype="int8")).model
    prompts = _prompts(lm)
    ref = [build_decoder("ar", CachedModel(m)).generate(p, N_NEW).tokens for p in prompts]
    run = run_batch(build_batched(method, m, 3, 64), prompts, N_NEW)
    assert [r.tokens for r in run.results] == ref
