"""``sdsat``: both greedy variants token-exact with forced (oracle) drafts and with wrong ones, the exact number of
tokens per forward each variant reaches, the nucleus candidate trees (the reference code's official shape and
pardec's caterpillar), the paper's accept rate (accepted / adaptive tokens) by hand, sampling distributions with
both shapes, and its one-line errors."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from pardec.config import ConfigError, ModelConfig, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.sdsat import OFFICIAL_TREES, SDSAT, official_tree
from pardec.decoding.tree_search import save_tree, validate_paths
from pardec.models.cached import CachedModel
from tests.conftest import tiny
from tests.decoding.stubs import TableLM
from tests.decoding.test_distribution import PROMPT, exact_joint, tiny_vocab
from tests.stats import chi_square_p

ADAPTIVE = 511  # a tiny random model's last id stands in for a trained adaptive token


def _setup(seed=0):
    lm = tiny(seed)
    cm = CachedModel(lm.model)
    ids = lm.tokenizer("def fibonacci(n):\n    return")["input_ids"]
    return lm, cm, ids


def _shape(k: int) -> str:
    """The default (official) tree where the reference code has one for ``k``, else the caterpillar."""
    return "official" if k in OFFICIAL_TREES else "caterpillar"


def _oracle(dec: SDSAT, ref: list[int], wrong_at: int | None = None):
    """Drafts = the reference continuation after the committed tokens (one-hot logits): the rows follow ``token``,
    which follows ``before``; ``wrong_at``: depth (1-based) whose draft is made wrong."""

    def draft_logits(rows, before, token):
        k, v = rows.shape
        out = torch.full((k, v), -10.0)
        for j in range(k):
            i = len(before) + 1 + j
            tok = ref[i] if i < len(ref) else 0
            if wrong_at == j + 1:
                tok = (tok + 1) % (v - 1)
            out[j, tok] = 10.0
        return out

    dec.draft_logits = draft_logits
    return dec


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("variant", ["two_step", "fused"])
def test_oracle_drafts_reach_the_most_tokens_per_forward(variant, k):
    lm, cm, ids = _setup()
    n = 40
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, n).tokens
    assert ADAPTIVE not in ref
    dec = _oracle(build_decoder("sdsat", cm, lm.tokenizer, k=k, variant=variant, tree=_shape(k),
                                adaptive_ids=[ADAPTIVE]), ref)
    res = dec.generate(ids, n)
    assert res.tokens == ref and res.stop_reason == "length"
    # prefill commits 1 token and drafts k; two-step: verify (k+1), draft (1), verify (k+1) ...; fused: k+1 each
    want, done, verify = [1], 1, True
    while done < n:
        step = min(k + 1 if verify or variant == "fused" else 1, n - done)
        want.append(step)
        done += step
        verify = variant == "fused" or not verify
    assert res.accepted == want
    assert cm.length == len(ids) + n - 1  # no adaptive token stayed in the cache
    assert ADAPTIVE not in cm.tokens


@pytest.mark.parametrize("variant", ["two_step", "fused"])
def test_a_wrong_draft_is_caught(variant):
    lm, cm, ids = _setup(1)
    n, k = 30, 4
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, n).tokens
    dec = _oracle(build_decoder("sdsat", cm, lm.tokenizer, k=k, variant=variant, tree="caterpillar",
                                adaptive_ids=[ADAPTIVE]), ref, wrong_at=3)
    res = dec.generate(ids, n)
    assert res.tokens == ref
    # every verification accepts drafts 1-2 and commits the target's token in place of draft 3
    # (a rejection leaves the fused variant no drafts either: verifying forwards alternate with drafting ones)
    assert set(res.accepted[1:-1:2]) == {3} and set(res.accepted[2:-1:2]) == {1}
    assert res.draft_accepted == 2 * res.extras["verifications"]
    # the paper's accept rate: accepted / adaptive tokens (k per verification; fewer only where fewer tokens remain)
    v = res.extras["verifications"]
    assert k * (v - 1) < res.drafted <= k * v


def test_nucleus_tree_caterpillar():
    lm, cm, _ = _setup()
    dec = build_decoder("sdsat", cm, lm.tokenizer, k=3, top_k=3, top_p=0.9, tree="caterpillar",
                        adaptive_ids=[ADAPTIVE])
    drafts = torch.full((3, 8), -30.0)
    drafts[0, [4, 2, 6]] = torch.tensor([2.0, 1.5, 1.0]).log()  # probs ~ .44 .33 .22: 3 in the nucleus
    drafts[1, 5] = 0.0  # one certain token
    drafts[2, [1, 7]] = torch.tensor([0.95, 0.05]).log()  # the 2nd is outside top_p 0.9
    tree, anchor = dec.candidates(drafts, SamplingConfig(temperature=1.0))
    assert tree.parents == [-1, 0, 0, 0, 1, 4] and tree.labels == [-1, 4, 2, 6, 5, 1]
    assert anchor == 5 and tree.label_path(anchor) == (4, 5, 1)
    greedy, a = dec.candidates(drafts, SamplingConfig())
    assert greedy.labels == [-1, 4, 5, 1] and a == 3  # greedy: the main chain only


@pytest.mark.stat  # a chi-square test over many decodes
def test_fused_sampling_follows_the_target_distribution():
    target = tiny_vocab(0)
    dec = build_decoder("sdsat", CachedModel(target, forward_impl="lean"), None, k=2, variant="fused", top_k=3, tree="caterpillar",
                        adaptive_ids=[15])
    s0 = SamplingConfig(temperature=1.0)
    obs: Counter = Counter()
    drafted = accepted = 0
    n = 1200
    for i in range(n):
        res = dec.generate(PROMPT, 3, Stopper(), SamplingConfig(temperature=1.0, seed=1000 + i))
        obs[tuple(res.tokens)] += 1
        drafted, accepted = drafted + res.drafted, accepted + res.draft_accepted
    p, dof = chi_square_p(obs, exact_joint(target, s0), n)
    assert dof >= 8 and p > 1e-3, (p, dof)
    assert drafted > 0 and 0 < accepted < drafted


def test_errors_are_one_line(tmp_path):
    lm, cm, _ = _setup()
    for params, part in [({"k": 0}, "method.k=0 is out of range"),
                         ({"variant": "tree"}, "method.variant='tree' must be one of 'two_step', 'fused'"),
                         ({"top_p": 0.0}, "method.top_p=0.0 is out of range"),
                         ({"adaptive_ids": []}, "method.adaptive_ids=[] is not valid"),
                         ({"k": 4, "adaptive_ids": [500, 501, 502]}, "method.k=4 is out of range"),
                         ({"adaptive_ids": [10**6]}, "outside the model's vocabulary")]:
        with pytest.raises(ConfigError, match="^[^\n]*$") as e:
            build_decoder("sdsat", cm, lm.tokenizer, **params)
        assert part in str(e.value)
    with pytest.raises(ConfigError, match="has no SDSAT adaptive token.*python -m train \\+experiment=sdsat_smollm2"):
        build_decoder("sdsat", cm, lm.tokenizer)
    # before the model loads: a local model whose config.json has no `sdsat` entry
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    local = ModelConfig(name="plain", source="local", path=str(tmp_path))
    with pytest.raises(ConfigError, match="model 'plain' .* has no SDSAT adaptive token"):
        SDSAT.check_model(local, {})
    SDSAT.check_model(local, {"adaptive_ids": [3]})  # given explicitly: fine
    (tmp_path / "config.json").write_text(json.dumps({"sdsat": {"schema_version": 1, "adaptive_ids": [7], "max_span": 5}}))
    SDSAT.check_model(local, {})


def test_official_trees_are_the_reference_codes():
    """The reference code's tree_depth_5, written out, and the shape of every official tree (depth k)."""
    assert official_tree(5) == [[0], [1], [2], [3],
                                [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0],
                                [0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0],
                                [0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 1, 0], [0, 0, 1, 1],
                                [0, 0, 0, 0, 0], [0, 0, 0, 0, 1], [0, 0, 0, 0, 2]]
    per_depth = {5: [4, 8, 8, 5, 3], 7: [4, 8, 8, 6, 5, 3, 2], 9: [4, 8, 8, 6, 6, 5, 4, 3, 2],
                 11: [4, 8, 8, 8, 6, 6, 6, 5, 4, 3, 2], 13: [4, 8, 8, 8, 8, 8, 6, 6, 6, 5, 4, 3, 2]}
    assert sorted(OFFICIAL_TREES) == sorted(per_depth)
    for k, counts in per_depth.items():
        paths = validate_paths(official_tree(k), max_depth=k)  # prefix-closed, no duplicates
        assert [sum(len(p) == d for p in paths) for d in range(1, k + 1)] == counts
        assert [0] * k in paths  # the main chain reaches depth k


def _ranked_drafts(v: int, lists: list[dict[int, float]]) -> torch.Tensor:
    """Draft logits [len(lists), v] whose nucleus at each depth is exactly the listed tokens (probabilities)."""
    out = torch.full((len(lists), v), -1e9)
    for d, row in enumerate(lists):
        for tok, p in row.items():
            out[d, tok] = torch.tensor(p).log()
    return out


def test_official_nucleus_tree_by_hand():
    lm, cm, _ = _setup()
    dec = build_decoder("sdsat", cm, lm.tokenizer, k=5, adaptive_ids=[ADAPTIVE])  # tree=official (default)
    assert dec.tree_name == "official"
    # ranked lists per depth: [4 2 6 8], [5 3 7], [1], [9], [0]: ranks past a list's end drop their nodes
    drafts = _ranked_drafts(12, [{4: .4, 2: .3, 6: .2, 8: .1}, {5: .5, 3: .3, 7: .2}, {1: 1.}, {9: 1.}, {0: 1.}])
    tree, anchor = dec.candidates(drafts, SamplingConfig(temperature=1.0))
    # depth 1: [0] [1] [2] [3] -> 4 2 6 8; depth 2: 00 01 02 10 11 20 21 30 -> 5 3 7 under 4, 5 3 under 2 and 6,
    # 5 under 8; depth 3 (rank 0 only): 000 010 020 100 -> 1 under (4 5), (4 3), (4 7), (2 5); depth 4 (rank 0
    # under a depth-3 rank 0 node of ranks 000 or 001): 0000 -> 9 under (4 5 1) (0010 needs 001, dropped);
    # depth 5: 00000 -> 0 under (4 5 1 9)
    assert tree.parents == [-1, 0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 13, 17]
    assert tree.labels == [-1, 4, 2, 6, 8, 5, 3, 7, 5, 3, 5, 3, 5, 1, 1, 1, 1, 9, 0]
    assert anchor == 18 and tree.label_path(anchor) == (4, 5, 1, 9, 0)
    cut, a = dec.candidates(drafts[:2], SamplingConfig(temperature=1.0))  # fewer tokens left: depth 2 of it
    assert cut.labels == [-1, 4, 2, 6, 8, 5, 3, 7, 5, 3, 5, 3, 5] and a == 5
    greedy, a = dec.candidates(drafts, SamplingConfig())
    assert greedy.labels == [-1, 4, 5, 1, 9, 0] and a == 5  # greedy: the main chain only, whatever the shape


class _Table(TableLM):
    """TableLM with the attributes SDSAT reads of a model."""

    config = type("Config", (), {"vocab_size": 8})()


def test_accept_rate_is_accepted_over_adaptive_tokens_by_hand():
    # target: t -> t + 1 (certain) for t < 7; prompt [0]: the target writes 1 2 3 4 5 6 ...; adaptive id 7
    target = _Table(8, {t: {t + 1: 1.0} for t in range(7)})
    dec = build_decoder("sdsat", target, None, k=5, adaptive_ids=[7])
    # drafts after the prefill's token 1: ranked lists [3 2], [3 6], [4 6], [1 2], [1 2]; the truth is 2 3 4 5 6
    lists = [{3: .6, 2: .4}, {3: .6, 6: .4}, {4: .6, 6: .4}, {1: .6, 2: .4}, {1: .6, 2: .4}]
    dec.draft_logits = lambda rows, before, token: _ranked_drafts(8, lists)
    res = dec.generate([0], 7, Stopper(), SamplingConfig(temperature=1.0, seed=0))
    assert res.tokens == [1, 2, 3, 4, 5, 6, 7]  # exact: every committed token is the target's certain one
    # the official tree with 2 tokens per depth keeps 2 + 4 + 5 + 4 + 2 = 17 nodes (ranks <= 1); the target takes
    # rank 1 (2) at depth 1, then (1, 0) = 3 and (1, 0, 0) = 4; no depth-4 node under a rank-1 first token: 3 accepted
    # of 5 adaptive tokens (the paper's accept rate 3 / 5), of 17 nodes (node_acceptance 3 / 17)
    assert res.extras["verifications"] == 1 and res.accepted == [1, 4, 1, 1]  # prefill, verify, draft, last
    assert (res.draft_accepted, res.drafted, res.extras["tree_nodes"]) == (3, 5, 17)
    assert res.extras["node_acceptance"] == pytest.approx(3 / 17)
    assert res.draft_accepted / res.drafted == pytest.approx(0.6)


@pytest.mark.parametrize("tree", ["official", "caterpillar"])
def test_both_shapes_are_greedy_exact(tree):
    lm, cm, ids = _setup(2)
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, 25).tokens
    for variant in ("two_step", "fused"):
        res = build_decoder("sdsat", cm, lm.tokenizer, k=5, variant=variant, tree=tree,
                            adaptive_ids=[ADAPTIVE]).generate(ids, 25)
        assert res.tokens == ref, (tree, variant)


@pytest.mark.stat  # a chi-square test over many decodes
@pytest.mark.parametrize("tree,variant", [("official", "two_step"), ("official", "fused"), ("caterpillar", "two_step")])
def test_sampling_follows_the_target_distribution_with_each_shape(tree, variant):
    """The first three tokens of 7-token samples (so the first verification's tree is 5 deep) follow the target."""
    target = tiny_vocab(0)
    dec = build_decoder("sdsat", CachedModel(target, forward_impl="lean"), None, k=5, variant=variant, top_k=4, tree=tree,
                        adaptive_ids=[15])
    s0 = SamplingConfig(temperature=1.0)
    obs: Counter = Counter()
    drafted = accepted = nodes = 0
    n = 1200
    for i in range(n):
        res = dec.generate(PROMPT, 7, Stopper(), SamplingConfig(temperature=1.0, seed=2000 + i))
        obs[tuple(res.tokens[:3])] += 1
        drafted, accepted, nodes = drafted + res.drafted, accepted + res.draft_accepted, nodes + res.extras["tree_nodes"]
    p, dof = chi_square_p(obs, exact_joint(target, s0), n)
    assert dof >= 8 and p > 1e-3, (p, dof)
    assert drafted > 0 and 0 < accepted < drafted and nodes > drafted  # a tree, not a chain


def test_tree_errors_are_one_line_before_a_model(tmp_path):
    deep = tmp_path / "deep.json"
    save_tree(deep, "deep", [[0], [1], [0, 0], [0, 0, 0]])
    for params, part in [({"k": 4}, "method.tree=official has no tree for method.k=4: the reference code's trees "
                                    "have depth k in 5, 7, 9, 11, 13"),
                         ({"k": 2, "tree": str(deep)}, f"method.tree={str(deep)!r} has depth 3, out of range: a "
                                                       "tree's depth must be in [1, 2]"),
                         ({"tree": "medusa"}, "method.tree='medusa' is not valid; choose official, caterpillar or")]:
        with pytest.raises(ConfigError, match="^[^\n]*$") as e:
            SDSAT(None, **params)  # what spec validation runs before any model loads
        assert part in str(e.value)
    assert SDSAT(None, k=3, tree=str(deep)).paths == [[0], [1], [0, 0], [0, 0, 0]]
    assert SDSAT(None, k=7).paths == official_tree(7) and SDSAT(None, k=3, tree="caterpillar").paths is None


@pytest.mark.parametrize("overrides,message", [
    (["method.k=4"], "method.tree=official has no tree for method.k=4"),
    (["method.k=4", "method.tree=caterpillar"], None),
    (["method.tree=chain"], "method.tree='chain' is not valid; choose official, caterpillar or a tree JSON file"),
])
def test_tree_is_checked_by_spec_validation_before_loading(monkeypatch, overrides, message):
    from pardec.evaluation import validate
    from pardec.models import loading
    from tests.evaluation.helpers import cfg_of

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    cfg = cfg_of("+method=sdsat", "model=tiny_random", "method.adaptive_ids=[5]", *overrides)
    if message is None:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
