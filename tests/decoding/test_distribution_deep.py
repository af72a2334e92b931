"""Distributions past the first draft token (issues #24, #54). ``test_distribution.py`` stops at 3 new tokens: the
first comes from the prefill and only one token is left to draft, so every draft there is one token deep. Here every
``distribution`` method generates 5 tokens (sdsat 7), drafting 3 deep (sdsat's official k = 5 tree: 5 deep), and
chi-square tests compare the **joint of three consecutive tokens** with the target's, enumerated exactly on the
16-token model, at both sampling settings (temperature 1, and temperature 2 with top-k 5 / top-p 0.9):

* every drafting method (``ar`` drafts nothing; ``test_distribution.py`` covers its sampling): tokens 2-3-4 (depths 1-3 of the first draft, jointly) and tokens 3-4-5 (depths 2-3 and the last
  draft position or the bonus token, or a second round);
* ``sdsat`` (k = 2, fused, 7 tokens): tokens 2-3-4 and 4-5-6 (the second round's drafts read from the adaptive
  tokens a verification forward appended);
* ``sdsat_k5`` (the official k = 5 tree, two-step, 7 tokens): tokens 2-3-4 and 4-5-6 (depths 3-5 of one draft).

Each case runs with parameters that reach its deep paths, and the test asserts that they ran:

* every drafting method: some verification accepted >= 2 drafted tokens, some accepted >= 1 and then rejected (a
  residual sampled at depth >= 2), and tokens 4 and 5 came out of one target forward in some samples;
* ``spectr``: K-SEQ at a node below the root with >= 2 draws through it, both accepting a draw and falling back
  to its residual;
* ``ouroboros``: the draft's own lookahead accepted pool phrases (several draft tokens in one draft forward),
  draft chain + pool phrases were verified as one tree, and phrase tokens were accepted past the draft;
* ``sdsat`` (``variant=fused``): drafts read from the adaptive tokens appended to a verification forward were
  verified by the next forward, and accepted >= 2 deep there; ``sdsat_k5``: verifications reached depth 5 of the
  official tree (>= 4 drafted tokens accepted) and accepted all 5;
* ``jacobi``: re-sampled guesses (a block's later iterations) were accepted;
* ``eagle3`` (a small dynamic tree) and ``eagle3_chain`` (drafts sampled from the drafter's recorded q): a fitted
  EAGLE-3 drafter (:func:`eagle_deep`) accepted >= 2 deep and rejected below the root;
* ``dflash`` (a block of 4, each slot's draft sampled from its recorded q): a fitted DFlash drafter
  (:func:`dflash_deep`) accepted >= 2 deep and rejected below the root; ``dflash_vocab`` the same drafter over a
  draft vocabulary without tokens 9 and 15 (:func:`vocab_deep`: its q is 0 at the cycle's token 9, which only the
  residual can give); ``dflash_compiled`` the same drafter with ``compile=true`` (each round one compiled graph);
  ``dflash_tree`` the same drafter's slots' top ranks as a static tree (:func:`depth3_tree`);
* ``lookahead`` / ``pld``: pool / prompt n-grams accepted >= 2 deep.

Set-up. The prompt is the target's own 3-cycle (0 -> 5 -> 9 -> 0, each step with probability 0.45-0.8 at
temperature 1), so n-gram drafts from the prompt, the pool and the window are often, not always, right. Draft
models are a noisy copy of the target (Gaussian noise, 0.3 x each tensor's std: the draft/target TV distance is
~0.3 on these pairs), not the unrelated ``tiny_vocab(1)`` of the 3-token test, which is almost never accepted
twice in a row. The untrained Medusa heads / FIRP projections of ``tests/decoding/drafters.py`` and the stand-in
SDSAT adaptive token guess the *next* token at every depth, which a 3-cycle never continues; their candidate trees
are built instead from an oracle's drafts (the noisy copy's greedy rollout from the committed context, through the
methods' own seams ``candidates`` / ``draft_logits``), so medusa and firp draw the same samples and differ only
in their forwards. Drafts never change what these methods sample, only which paths run: every draft here is a
deterministic function of the committed tokens (or an exact sample of a recorded ``q``), which is what exactness
needs.

Power (``test_the_triples_detect_a_ten_percent_contamination``, run on every commit): N = 2000 samples at temperature
1 and 2400 warped, cells with expected count < 5 pooled, each triple at p > 1e-3. Simulated with the exact triple
distribution P (200 runs), output (1 - eps) P + eps Q with eps = 0.10 and Q = the three tokens independent with P's
marginals (a bug that breaks the dependence between positions) is rejected in >= 94% of runs for every triple
tested (1500 samples, the pair test's N, caught it in 14-80%). A contamination uniform on P's support is caught
at temperature 1 (>= 77% at 1500), not warped: there most of the support is in the pooled tail. The exact joints
at temperature 1 drop the prefixes of probability < 1e-9 (mass <= 1.2e-4 over 6 tokens).

Teeth: depth-only bugs planted in a scratch copy (pytest plugins that monkeypatch, never the sources), all
invisible to the 3-token test, which passed with each of them; the pair test that preceded this one (tokens 3-4 and
4-5, warped, N = 1500) caught each (the last one in two of the three methods it hits):
sps checking every draft token against the draft's first distribution q_1 (tokens 3-4 p = 3e-47); SpecTr's K-SEQ
below the root replaced by the naive rule (division factor 1, residual norm(max(p - q, 0))) (p = 5e-5); sdsat's
candidate tree seeing the adaptive tokens a fused forward appends after it (p = 2e-7); the tree rule below the root
sampling the fallback token from p instead of p without the rejected candidates: lookahead p = 2e-12, medusa 3e-5,
but sdsat (fewer deep nodes here) only 1e-3 / 0.12 on its two pairs: not caught.
"""

from __future__ import annotations

import copy
import functools
import tempfile
from collections import Counter
from pathlib import Path

import pytest
import torch

import pardec.decoding.base as base_mod
import pardec.decoding.dflash as dflash_mod
import pardec.decoding.eagle as eagle_mod
import pardec.decoding.heads as heads_mod
import pardec.decoding.lookahead as lookahead_mod
import pardec.decoding.ouroboros as ouroboros_mod
import pardec.decoding.sdsat as sdsat_mod
import pardec.decoding.spectr as spectr_mod
from pardec.config import SamplingConfig
from pardec.decoding import METHODS, Stopper, build_decoder
from pardec.decoding.sampling import warp
from pardec.decoding.tree_search import save_tree
from pardec.models.cached import CachedModel
from pardec.models.drafters import save_drafter
from tests.decoding.drafters import drafter_params, fit_dflash, fit_eagle3, vocab_dir
from tests.decoding.test_distribution import DISTRIBUTION, SETTINGS, V, tiny_vocab
from tests.shared import once
from tests.stats import chi_square_p

T = 5  # new tokens (LENGTH: per case)
GROUPS = ((2, 3, 4), (3, 4, 5))  # the joints tested (1-based positions; GROUPS_OF: per case)
PROMPT = [0, 5, 9, 0, 5, 9, 0]  # the target's 3-cycle (see the module doc)
N = {"t1": 2000, "warped": 2400}  # the power the module doc states
FLOOR = 1e-9  # prefixes below this probability are left out of the exact joints
#: case -> the method it runs
METHOD_OF = {"sps_unsure": "sps", "sdsat_k5": "sdsat", "eagle3_chain": "eagle3", "dflash_vocab": "dflash",
             "dflash_compiled": "dflash",
             "dflash_tree": "dflash"}
PARAMS = {
    "sps": {"gamma": 3},  # tokens 2-4 drafted in the first round, token 5 its bonus
    "sps_unsure": {"gamma": 3, "confidence_threshold": 0.6},  # drafts that end where the draft is unsure
    "pld": {"max_ngram": 3, "num_pred": 4},
    "jacobi": {"block_size": 4},  # one block for tokens 2-5: iterations after the first verify re-sampled guesses
    "lookahead": {"level": 4, "window": 3, "guess_set": 3, "pool_from_prompt": True},
    # gamma 2 leaves one position for a pool phrase after the first round's draft; the pool kept across samples
    "ouroboros": {"gamma": 2, "level": 3, "window": 2, "guess_set": 3, "top_k_phrases": 2, "warm_start": True},
    "spectr": {"k": 3, "gamma": 3},
    # k 2 and 7 tokens: the first verification (tokens 2-3, bonus 4) appends the adaptive tokens whose drafts the
    # second verifies (tokens 5-6, bonus 7); a depth-2 tree file (rank paths), as the official trees are
    "sdsat": {"k": 2, "variant": "fused", "top_k": 3},  # + tree: depth2_tree()
    # the official k = 5 tree (tree=official, the default) with its default variant: 5 drafts after the prefill (7
    # tokens: room for all 5 and the bonus token, so the tree is not cut)
    "sdsat_k5": {"k": 5},
    # a fitted EAGLE-3 drafter (eagle_deep): a small dynamic tree 3 deep, and the chain (drafts sampled from q)
    "eagle3": {"total_tokens": 12, "depth": 3, "top_k": 3},
    "eagle3_chain": {"mode": "chain", "num_speculative_tokens": 3},
    "dflash": {"num_speculative_tokens": 3},  # a fitted DFlash drafter (dflash_deep), blocks of 4
    "dflash_vocab": {"num_speculative_tokens": 3},  # + draft_vocab: vocab_deep()
    "dflash_compiled": {"num_speculative_tokens": 3, "compile": True},  # the round as one compiled graph
    "dflash_tree": {"num_speculative_tokens": 3},  # + tree: depth3_tree(), the slots' top ranks
}
LENGTH = {"sdsat": 7, "sdsat_k5": 7}
GROUPS_OF = {"sdsat": ((2, 3, 4), (4, 5, 6)), "sdsat_k5": ((2, 3, 4), (4, 5, 6))}
#: every drafting method (``ar`` drafts nothing: the 3-token test covers its sampling), sdsat twice
CASES = [c for m in DISTRIBUTION if m != "ar" for c in (m, *(k for k, v in METHOD_OF.items() if v == m))]
NOISE = 0.3  # the draft: the target plus Gaussian noise of 0.3 x each tensor's std


@functools.cache
def near_draft() -> torch.nn.Module:
    """A noisy copy of the target (``tiny_vocab(0)``): agrees with it often, not always."""
    model = copy.deepcopy(tiny_vocab(0))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for w in model.parameters():
            std = float(w.std()) if w.numel() > 1 else 0.0
            w.add_(torch.randn(w.shape, generator=g) * std * NOISE)
    return model


@functools.cache
def _rollout(context: tuple[int, ...], depth: int) -> torch.Tensor:
    """The near draft's logits [depth, V] along its greedy continuation of ``context``."""
    seq, rows = list(context), []
    with torch.no_grad():
        for _ in range(depth):
            row = near_draft()(input_ids=torch.tensor([seq])).logits[0, -1]
            rows.append(row)
            seq.append(int(row.argmax()))
    return torch.stack(rows)


@functools.cache
def target_samples() -> torch.Tensor:
    """48 of the target's own samples of 8 tokens after PROMPT (temperature 1), PROMPT included: [48, 15]."""
    model = tiny_vocab(0)
    g = torch.Generator().manual_seed(11)
    ids = torch.tensor([PROMPT] * 48)
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, torch.multinomial(torch.softmax(model(input_ids=ids).logits[:, -1], -1), 1,
                                                    generator=g)], 1)
    return ids


@functools.cache
def eagle_deep() -> str:
    """An EAGLE-3 drafter fitted to 48 of the target's own samples of 8 tokens after PROMPT (temperature 1):
    its drafts are often, not always, right there. Drafts depend only on the committed tokens (tree: the top-k of
    deterministic draft distributions; chain: samples of the recorded q), as exactness needs."""
    model = tiny_vocab(0)
    return str(once("deep-eagle3", lambda d: save_drafter(fit_eagle3(model, target_samples().tolist(), steps=150), d,
                                                          model.config, "v16")))


@functools.cache
def dflash_deep() -> str:
    """A DFlash drafter (blocks of 4) fitted to the same 48 samples as :func:`eagle_deep`: its block's slots are
    often, not always, right after PROMPT. Its drafts are samples of the recorded per-slot q."""
    model = tiny_vocab(0)
    return str(once("deep-dflash", lambda d: save_drafter(
        fit_dflash(model, target_samples().tolist(), steps=150, lr=3e-3, prompt_len=len(PROMPT) - 2), d, model.config,
        "v16")))


def vocab_deep() -> str:
    """A draft vocabulary of the 16-token model without tokens 9 and 15 (``dflash_vocab``)."""
    return vocab_dir([i for i in range(V) if i not in (9, 15)], V)


@functools.cache
def depth2_tree() -> str:
    """A tree file of rank paths, 2 deep (sdsat's ``tree``)."""
    return str(save_tree(Path(tempfile.mkdtemp(prefix="pardec-deep-")) / "D2.json", "D2",
                         [[0], [1], [0, 0], [0, 1], [1, 0]]))


@functools.cache
def depth3_tree() -> str:
    """A tree file of rank paths, 3 deep (``dflash_tree``: candidates from the block's three slots)."""
    return str(save_tree(Path(tempfile.mkdtemp(prefix="pardec-deep-")) / "D3.json", "D3",
                         [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]))


def oracle(committed: list[int], depth: int) -> torch.Tensor:
    return _rollout(tuple(PROMPT + list(committed)), depth).clone()


@functools.cache
def exact_joints(setting: str, length: int, groups: tuple[tuple[int, ...], ...]) -> dict[tuple, torch.Tensor]:
    """P(t_i, t_j, t_k | PROMPT) under ``SETTINGS[setting]`` for each group (1-based positions), as a flat
    [V ** len(group)] tensor: every prefix of ``length`` tokens with probability >= FLOOR enumerated (batched
    forwards), then summed. Computed once per test run (tests/shared.py: 7 tokens at temperature 1 take ~15 s)."""
    key = f"joints-{setting}-{length}-" + "_".join("".join(map(str, g)) for g in groups)
    path = once(key, lambda d: torch.save(_exact_joints(setting, length, groups), d / "joints.pt")) / "joints.pt"
    return torch.load(path)


def _exact_joints(setting: str, length: int, groups: tuple[tuple[int, ...], ...]) -> dict[tuple, torch.Tensor]:
    model, s = tiny_vocab(0), SETTINGS[setting]
    with torch.no_grad():
        joint = torch.ones(1, dtype=torch.float64)
        pref = torch.zeros(1, 0, dtype=torch.long)
        for _ in range(length):
            ids = torch.cat([torch.tensor(PROMPT).expand(len(pref), -1), pref], 1)
            p = torch.cat([warp(model(input_ids=ids[i:i + 8192]).logits[:, -1], s).double()
                           for i in range(0, len(ids), 8192)])  # [B, V]
            joint = (joint[:, None] * p).reshape(-1)
            pref = torch.cat([pref.repeat_interleave(V, 0), torch.arange(V).repeat(len(pref))[:, None]], 1)
            keep = joint >= FLOOR
            joint, pref = joint[keep], pref[keep]
    out = {}
    for g in groups:
        key = sum(pref[:, i - 1] * V ** (len(g) - 1 - j) for j, i in enumerate(g))
        out[g] = torch.zeros(V ** len(g), dtype=torch.float64).index_add_(0, key, joint)
    return out


def as_key(x: int, width: int) -> tuple[int, ...]:
    """A flat index over ``width`` tokens as the tokens (t_1, ..., t_width)."""
    return tuple((x // V ** (width - 1 - j)) % V for j in range(width))


def as_cells(flat: torch.Tensor, width: int) -> dict[tuple[int, ...], float]:
    """A flat joint over ``width`` tokens as {(t_1, ..., t_width): probability} (its support only)."""
    return {as_key(x, width): float(q) for x, q in enumerate(flat.tolist()) if q > 0}


# ---------------------------------------------------------------------------------------------- instrumentation
class Probe:
    """What the verifications of one generation did, recorded by wrapping the rules the decoders call."""

    def __init__(self):
        self.checks: list[tuple[int, int, bool]] = []  # target verifications: (depth offered, accepted, rejected)
        self.draft_multi = 0  # ouroboros: draft forwards whose own verification accepted pool tokens
        self.kseq: list[list[tuple[int, bool]]] = []  # spectr: per verification, per depth: (draws, one accepted)
        #: sdsat: drafts read from adaptive rows: (the verification that will use them, the candidate depth of the
        #: forward that produced them: 0 an adaptive-only forward, -1 the prefill)
        self.reads: list[tuple[int, int]] = []
        self.phrases = 0  # ouroboros: rounds whose tree carried pool phrases after the draft

    def reset(self):
        self.__init__()


def _chain_reading(probe: Probe, fn):
    def wrapped(draft, logits, s, gen, q=None, extra=None):
        out, more = fn(draft, logits, s, gen, q, extra)
        k = len(draft)
        probe.checks.append((k, len(out) - 1, len(out) - 1 < k))
        return out, more

    return wrapped


def _chain(probe: Probe, fn):
    def wrapped(draft, logits, s, gen, q=None):
        out = fn(draft, logits, s, gen, q)
        k = len(draft)
        probe.checks.append((k, len(out) - 1, len(out) - 1 < k))
        return out

    return wrapped


def _tree(probe: Probe, fn, side: str = "target"):
    def wrapped(tree, logits, s, gen, *a, **kw):
        verdict = fn(tree, logits, s, gen, *a, **kw)
        if side == "draft":
            probe.draft_multi += len(verdict.path) > 1
        else:
            probe.checks.append((tree.max_depth, len(verdict.path) - 1, bool(tree.children[verdict.path[-1]])))
        return verdict

    return wrapped


def instrument(method: str, dec, monkeypatch) -> Probe:
    probe = Probe()
    monkeypatch.setattr(base_mod, "verify_chain_reading", _chain_reading(probe, base_mod.verify_chain_reading))
    for mod in (base_mod, heads_mod, lookahead_mod, sdsat_mod, eagle_mod, dflash_mod):
        monkeypatch.setattr(mod, "verify_tree", _tree(probe, mod.verify_tree))
    monkeypatch.setattr(eagle_mod, "verify_chain", _chain(probe, eagle_mod.verify_chain))
    monkeypatch.setattr(dflash_mod, "verify_chain", _chain(probe, dflash_mod.verify_chain))
    monkeypatch.setattr(ouroboros_mod, "verify_tree", _tree(probe, ouroboros_mod.verify_tree, "draft"))
    monkeypatch.setattr(spectr_mod, "verify_tree_iid", _tree(probe, spectr_mod.verify_tree_iid))
    iid = spectr_mod.verify_tree_iid

    def iid_seen(tree, *a, **kw):
        """K-SEQ along the walk down the tree, one entry per depth: (draws there, one of them accepted). (K-SEQ
        runs at every node at once; the walk's nodes are those of the verdict's path.)"""
        verdict = iid(tree, *a, **kw)
        draws = kw["draws"]
        probe.kseq.append([(len(draws[node]), d + 1 < len(verdict.path)) for d, node in enumerate(verdict.path)
                           if draws.get(node)])
        return verdict

    monkeypatch.setattr(spectr_mod, "verify_tree_iid", iid_seen)

    # the committed output, live, for the oracle drafts
    start = dec.begin
    box: dict = {}

    def tracked(*a, **kw):
        st, last = start(*a, **kw)
        box["out"] = st.out.tokens
        return st, last

    dec.begin = tracked
    if method in ("medusa", "firp"):
        cands = dec.candidates
        dec.candidates = lambda drafts, depth: cands(oracle(box["out"], max(1, depth)), depth)
    if method == "sdsat":
        read = dec.draft_logits

        def drafts_seen(rows, before, token):
            # made inside the producing forward's verification, before it is recorded (the next one may use them);
            # the depth of the main chain they follow (before = the committed tokens + that chain); -1: the prefill
            producing = len(before) - len(box["out"]) if before else -1
            probe.reads.append((len(probe.checks) + (producing >= 0), producing))
            committed = [*before, int(token)]  # the oracle reads the token on the host (test code only)
            return read(oracle(committed, len(rows)), before, token)

        dec.draft_logits = drafts_seen
    if method == "ouroboros":
        phrases_for = dec.phrases_for

        def phrases_seen(draft, room):
            out = phrases_for(draft, room)
            probe.phrases += bool(out)
            return out

        dec.phrases_for = phrases_seen
    return probe


def fused_deep(probe: Probe) -> bool:
    """sdsat: whether a verification accepted >= 2 drafts read from the adaptive tokens that an earlier
    *verification* forward (one with a candidate tree) appended: the fused variant's own path."""
    return any(depth > 0 and n < len(probe.checks) and probe.checks[n][1] >= 2 for n, depth in probe.reads)


# ---------------------------------------------------------------------------------------------- the test
def test_the_deep_test_covers_every_distribution_method():
    assert {METHOD_OF.get(c, c) for c in PARAMS} | {"ar", "medusa", "firp"} == set(DISTRIBUTION)
    assert set(CASES) == set(DISTRIBUTION) - {"ar"} | set(METHOD_OF)


def _independent(flat: torch.Tensor, width: int) -> torch.Tensor:
    """The product of a joint's marginals: the same tokens, their dependence broken."""
    joint = flat.reshape([V] * width)
    out = torch.ones(())
    for i in range(width):
        out = out[..., None] * joint.sum(dim=[d for d in range(width) if d != i])
    return out.reshape(-1)


@pytest.mark.stat  # exact joints at temperature 1 (~300k prefixes) and 200 simulated tests per triple
@pytest.mark.parametrize("setting", ["t1", "warped"])
@pytest.mark.parametrize("length,groups", [(5, GROUPS), (6, GROUPS_OF["sdsat_k5"])])
def test_the_triples_detect_a_ten_percent_contamination(setting, length, groups):
    """Power: with N samples from (1 - 0.1) P + 0.1 Q, Q = P's marginals made independent, the test rejects (p <=
    1e-3) in >= 90% of 200 simulated runs, for every triple tested; and it accepts P itself in >= 98%."""
    g = torch.Generator().manual_seed(0)
    for group, flat in exact_joints(setting, length, groups).items():
        cells = as_cells(flat, len(group))
        for q, eps, want in ((_independent(flat, len(group)), 0.10, 0.90), (flat, 0.0, 0.02)):
            mix = ((1 - eps) * flat + eps * q).float()
            rejected = 0
            for _ in range(200):
                counts = torch.bincount(torch.multinomial(mix, N[setting], replacement=True, generator=g),
                                        minlength=len(mix))
                obs = Counter({as_key(int(x), len(group)): int(counts[x]) for x in counts.nonzero().flatten()})
                rejected += chi_square_p(obs, cells, N[setting])[0] <= 1e-3
            if eps:
                assert rejected / 200 >= want, (setting, group, rejected)
            else:
                assert rejected / 200 <= want, (setting, group, rejected)


@pytest.mark.stat  # N = 2000-2400 samples of 5-7 tokens per case and setting: the power the module doc states
@pytest.mark.parametrize("setting", ["t1", "warped"])
@pytest.mark.parametrize("case", CASES)
def test_later_token_triples_follow_the_target_distribution(case, setting, monkeypatch, one_thread):
    method, s0, n = METHOD_OF.get(case, case), SETTINGS[setting], N[setting]
    length, groups = LENGTH.get(case, T), GROUPS_OF.get(case, GROUPS)
    target = tiny_vocab(0)
    # (lean forwards: the logits of transformers' up to rounding, at ~60% of the time per sample)
    draft = CachedModel(near_draft(), name="draft", forward_impl="lean") if METHODS.get(method).needs_draft else None
    fitted = {"eagle3": eagle_deep, "dflash": dflash_deep}
    params = {**({"path": fitted[method]()} if method in fitted else drafter_params(method, target)),
              **PARAMS.get(case, {})}
    if case == "sdsat":
        params["tree"] = depth2_tree()
    if case == "dflash_vocab":
        params["draft_vocab"] = vocab_deep()
    if case == "dflash_tree":
        params["tree"] = depth3_tree()
    dec = build_decoder(method, CachedModel(target, forward_impl="lean"), None, draft, **params)
    probe = instrument(method, dec, monkeypatch)
    obs: dict[tuple[int, ...], Counter] = {g: Counter() for g in groups}
    seen: Counter = Counter()
    for i in range(n):
        s = SamplingConfig(temperature=s0.temperature, top_k=s0.top_k, top_p=s0.top_p, seed=5000 + i)
        probe.reset()
        res = dec.generate(PROMPT, length, Stopper(), s)
        assert len(res.tokens) == length
        for g in groups:
            obs[g][tuple(res.tokens[j - 1] for j in g)] += 1
        ends = [sum(res.accepted[: j + 1]) for j in range(len(res.accepted))]  # tokens committed after each forward
        seen["pair"] += T - 1 not in ends  # no forward ended at token 4: tokens 4 and 5 came from one forward
        seen["deep_accept"] += any(acc >= 2 for _, acc, _ in probe.checks)  # >= 2 drafted tokens accepted at once
        seen["deep_reject"] += any(acc >= 1 and rej for _, acc, rej in probe.checks)  # residual at depth >= 2
        seen["depth5"] += any(acc >= 4 for _, acc, _ in probe.checks)  # the depth-5 node verified
        seen["all5"] += any(acc >= 5 for _, acc, _ in probe.checks)
        seen["resampled"] += any(acc >= 1 for _, acc, _ in probe.checks[1:])
        below = [c for walk in probe.kseq for c in walk[1:] if c[0] >= 2]  # K-SEQ below the root, >= 2 draws
        seen["kseq_accept"] += any(ok for _, ok in below)
        seen["kseq_residual"] += any(not ok for _, ok in below)
        seen["draft_multi"] += probe.draft_multi > 0
        seen["phrases"] += probe.phrases > 0
        seen["from_phrases"] += bool(res.extras.get("accepted_from_phrases"))
        seen["fused_deep"] += fused_deep(probe)
    exact = exact_joints(setting, max(max(g) for g in groups), groups)
    for g in groups:
        p, dof = chi_square_p(obs[g], as_cells(exact[g], len(g)), n)
        print(case, setting, g, f"p={p:.4f} dof={dof}", dict(seen))
        assert dof >= 35, dof
        assert p > 1e-3, (case, setting, g, p, dof)

    # the deep paths ran (observed counts are several times these floors)
    floor = n // 30
    assert seen["pair"] >= floor, seen  # tokens 4 and 5 drafted / verified together
    if method == "jacobi":  # re-sampled guesses (iterations after a block's first) accepted
        assert seen["resampled"] >= floor // 3, seen
        return
    assert seen["deep_accept"] >= floor and seen["deep_reject"] >= floor, seen
    if method == "spectr":
        assert seen["kseq_accept"] >= floor and seen["kseq_residual"] >= floor // 3, seen
    if method == "ouroboros":
        assert seen["draft_multi"] >= floor and seen["phrases"] >= floor and seen["from_phrases"] >= floor // 3, seen
    if case == "sdsat":
        assert seen["fused_deep"] >= floor // 3, seen
    if case == "sdsat_k5":
        assert seen["depth5"] >= floor and seen["all5"] >= floor // 3, seen
