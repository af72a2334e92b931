"""Method ``dflash`` (a DFlash drafter's block, verified as a chain): greedy output equals ``ar`` token for token on
every forward implementation, with blocks accepted several deep; the incremental context cache equals the context
computed at once; the block is one non-causal forward; bad settings are refused. Sampling: the distribution tests
(``test_distribution.py``, ``test_distribution_deep.py``); host reads: ``test_verify_device.py``."""

from __future__ import annotations

import shutil

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import build_decoder
from pardec.decoding.dflash import ContextCache
from pardec.decoding.tree_search import save_tree
from pardec.models.cached import CachedModel
from pardec.models.dflash import DFlashConfig, default_layers
from pardec.models.drafters import load_drafter, new_drafter
from pardec.models.vocab import DraftVocab
from pardec.testing.graphs import cpu_graphs
from tests.conftest import tiny
from tests.decoding.drafters import _eagle_sequences, drafter_dir, vocab_dir

SETTINGS = [{}, {"block_size": 3}, {"num_speculative_tokens": 1}]


@pytest.fixture(scope="module")
def fitted():
    lm = tiny(1, layers=4)
    return lm, drafter_dir(lm.model, "dflash"), _eagle_sequences(lm.model)


@pytest.fixture
def fresh_dynamo():
    """The compiled rows' graphs of this test do not count against the recompile limit of later tests in the same
    process (torch.compile's per-code-object limit, fullgraph)."""
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("impl", ["hf", "lean", "cpu_graphs"])
def test_greedy_dflash_equals_ar_and_accepts_deep(fitted, impl, fresh_dynamo):
    lm, path, seqs = fitted
    cm = CachedModel(lm.model, forward_impl=cpu_graphs() if impl == "cpu_graphs" else impl)
    ar = build_decoder("ar", cm, lm.tokenizer)
    fresh = torch.randint(0, lm.model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    settings = SETTINGS if impl == "lean" else SETTINGS[:1]
    for prompt in (seqs[0][:3], seqs[1][:5], fresh):
        ref = ar.generate(prompt, 30).tokens
        for params in settings:
            res = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path), **params).generate(prompt, 30)
            assert res.tokens == ref, (prompt, params)
            assert res.extras["rounds"] == res.target_forwards - 1
            if prompt is not fresh and not params:  # the contexts the drafter was fitted on, the whole block
                assert max(res.accepted) >= 3, res.accepted  # >= 2 drafted tokens accepted at once
                assert res.extras["accepted_by_slot"][1] > 0


def test_layerwise_fusion_and_a_mask_token_row_decode_exactly():
    lm = tiny(2, layers=4)
    cm = CachedModel(lm.model, forward_impl="lean")
    ref = build_decoder("ar", cm).generate([3, 1, 4, 1, 5], 20).tokens
    for options in ({"fusion": "layerwise", "num_layers": 3}, {"mask_token_id": 7, "block_size": 5}):
        d = new_drafter("dflash", lm.model.config, embed=lm.model.model.embed_tokens, dflash=options)
        assert hasattr(d, "layer_mix") == (options.get("fusion") == "layerwise")
        assert hasattr(d, "mask_embedding") == ("mask_token_id" not in options)
        res = build_decoder("dflash", cm, None, d).generate([3, 1, 4, 1, 5], 20)
        assert res.tokens == ref


@torch.inference_mode()
def test_the_context_cache_equals_the_context_at_once(fitted):
    """Entries appended round by round (prefill, then each round's accepted tokens) equal every layer's keys/values
    computed over all the features at once; the block forward with the cache equals it with those."""
    lm, path, seqs = fitted
    d, _ = load_drafter(path, lm.model.config, "dflash")
    cm = CachedModel(lm.model, forward_impl="lean")
    ids = torch.tensor([seqs[0][:20]])
    feats = cm.forward(ids, hidden_layer=tuple(d.config.layer_ids)).hidden[0]
    cache = ContextCache(d, 32, ids.device, d.dtype)
    for lo, hi in ((0, 7), (7, 8), (8, 13), (13, 20)):
        cache.append(feats[lo:hi])
    whole = d.context_kv(feats[None], torch.arange(20))
    for (k, v), (k2, v2) in zip(cache.view(), whole):
        torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5)
    x = d.block_inputs(cm.inner().embed_tokens, torch.tensor([seqs[0][20]]), 4)
    torch.testing.assert_close(d(x, torch.arange(20, 24), cache.view()), d(x, torch.arange(20, 24), whole))


@torch.inference_mode()
def test_the_block_is_non_causal_and_sees_only_the_context():
    """Changing a later slot's input changes an earlier slot's output (bidirectional inside the block); a mask
    that hides the block's later slots from the earlier ones is a different computation."""
    lm = tiny(0, layers=4)
    d = new_drafter("dflash", lm.model.config, embed=lm.model.model.embed_tokens,
                    dflash={"num_layers": 2, "block_size": 4})
    h = d.config.hidden_size
    ctx = d.context_kv(torch.randn(1, 6, len(d.config.layer_ids) * h), torch.arange(6))
    x = torch.randn(1, 4, h)
    y = x.clone()
    y[0, 3] += 1.0
    a, b = d(x, torch.arange(6, 10), ctx), d(y, torch.arange(6, 10), ctx)
    assert not torch.allclose(a[0, 0], b[0, 0])  # slot 0 sees slot 3
    causal = torch.cat([torch.ones(4, 6, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool).tril()], 1)
    c, e = d(x, torch.arange(6, 10), ctx, causal), d(y, torch.arange(6, 10), ctx, causal)
    torch.testing.assert_close(c[0, 0], e[0, 0])


def test_default_layers_follow_dflashs_rule():
    # z-lab build_target_layer_ids: Qwen3-8B (36 layers, 5 draft layers) -> outputs [1, 9, 17, 25, 33]; pardec
    # counts the states entering a layer: +1
    assert default_layers(36, 5) == [2, 10, 18, 26, 34]
    assert default_layers(32, 1) == [17]
    assert default_layers(30, 5) == [2, 9, 15, 21, 28]
    assert default_layers(4, 2) == [0, 3]


def test_bad_settings_are_refused(fitted):
    lm, path, _ = fitted
    cm = CachedModel(lm.model)
    with pytest.raises(ConfigError, match="method 'dflash' needs a DFlash drafter"):
        build_decoder("dflash", cm, None, None)
    with pytest.raises(ConfigError, match=r"method.block_size=5 is out of range: .* blocks of 4 \(choose 2..4\)"):
        build_decoder("dflash", cm, None, None, path=str(path), block_size=5)
    with pytest.raises(ConfigError, match="num_speculative_tokens=3 is out of range: a block of 3 proposes at most 2"):
        build_decoder("dflash", cm, None, None, path=str(path), block_size=3, num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="block_size"):
        build_decoder("dflash", cm, None, None, path=str(path), block_size=1)
    other = tiny(0, layers=2)
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        build_decoder("dflash", CachedModel(other.model), None, None, path=str(path))
    with pytest.raises(ConfigError, match="dflash fusion='mix' is not valid"):
        DFlashConfig.for_target(lm.model.config, fusion="mix")
    with pytest.raises(ConfigError, match="mask_token_id=99999 is out of range"):
        DFlashConfig.for_target(lm.model.config, mask_token_id=99999)


def test_sampled_dflash_runs_and_reports_its_rounds(fitted):
    lm, path, seqs = fitted
    dec = build_decoder("dflash", CachedModel(lm.model), None, None, path=str(path))
    res = dec.generate(seqs[0][:3], 24, sampling=SamplingConfig(temperature=1.0, seed=3))
    rounds = res.extras["rounds"]
    assert len(res.tokens) == 24 and rounds == res.target_forwards - 1
    # the prompt's context, one block per round (none when only the target's token fits), the accepted tokens'
    # context after every round but the last
    assert 2 * rounds - 1 <= res.draft_forwards <= 2 * rounds


def _kept(lm, seqs) -> list[int]:
    """A draft vocabulary of about half the tiny vocabulary: every id of the fitted contexts, then every third id."""
    v = int(lm.model.config.vocab_size)
    return sorted(set(seqs[0][:40]) | set(seqs[1][:40]) | set(range(0, v, 3)))


@torch.inference_mode()
def test_a_draft_vocabulary_drafts_its_ids_through_the_target_heads_rows_and_the_output_stays_ar(fitted):
    lm, path, seqs = fitted
    v = int(lm.model.config.vocab_size)
    ids = _kept(lm, seqs)
    assert 8 < len(ids) < v
    cm = CachedModel(lm.model, forward_impl="lean")
    ar = build_decoder("ar", cm, lm.tokenizer)
    whole = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path))
    small = build_decoder("dflash", cm, lm.tokenizer, whole.drafter, draft_vocab=vocab_dir(ids, v))
    assert not hasattr(whole.drafter, "lm_head") and not whole.drafter.config.reduced  # the given one unchanged
    d = small.drafter
    assert d.config.draft_vocab_size == len(ids) and d.lm_head.weight.shape == (len(ids), d.config.hidden_size)
    for prompt in (seqs[0][:3], seqs[1][:5]):
        res = small.generate(prompt, 30)
        assert res.tokens == ar.generate(prompt, 30).tokens
        assert res.extras["draft_vocab_size"] == len(ids)
        assert max(res.accepted) >= 3, res.accepted  # the fitted contexts' ids are kept: drafts accepted deep
    # the mechanism: the kept ids' logits are the whole head's, the drafts the whole argmax over the kept ids
    cache = ContextCache(whole.drafter, 64, torch.device("cpu"), torch.float32)
    feats = cm.forward(torch.tensor([seqs[0][:12]]), hidden_layer=whole.layers).hidden[0]
    cache.append(feats)
    x = whole.drafter.block_inputs(cm.inner().embed_tokens, torch.tensor([seqs[0][12]]), 4)
    out = whole.drafter(x, torch.arange(12, 16), cache.view())[0, 1:]
    full = whole.drafter.logits(out, cm.lm_head)  # [3, V]
    mine = d.logits(out, cm.lm_head)  # [3, K]
    kept = torch.tensor(ids)
    torch.testing.assert_close(mine, full[:, kept])
    assert torch.equal(d.to_target(mine.argmax(-1)), kept[full[:, kept].argmax(-1)])
    spread = d.full_logits(mine)
    assert spread.shape == full.shape and torch.equal(spread[:, kept], mine)
    assert bool((spread[:, [i for i in range(v) if i not in ids]] == torch.finfo(spread.dtype).min).all())
    sampled = small.generate(seqs[0][:3], 20, sampling=SamplingConfig(temperature=1.0, seed=4))
    assert len(sampled.tokens) == 20


def test_a_bad_draft_vocabulary_is_one_line_before_any_model(fitted, tmp_path):
    lm, path, seqs = fitted
    v = int(lm.model.config.vocab_size)
    with pytest.raises(ConfigError, match=r"method.draft_vocab='.*empty' holds no drafter weights \(drafter"):
        build_decoder("dflash", None, None, None, path=str(path), draft_vocab=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"has no draft vocabulary \(no d2t map\): name a drafter with one"):
        build_decoder("dflash", None, None, None, path=str(path), draft_vocab=str(path))  # DFlash's own: none
    other = vocab_dir(list(range(0, v + 8, 2)), v + 8)
    with pytest.raises(ConfigError, match=rf"a draft vocabulary over {v + 8} ids does not fit a drafter for a "
                                          rf"vocabulary of {v}"):
        build_decoder("dflash", CachedModel(lm.model), None, None, path=str(path), draft_vocab=other)
    d, _ = load_drafter(path, lm.model.config, "dflash")
    small = build_decoder("dflash", CachedModel(lm.model), None, d, draft_vocab=vocab_dir(_kept(lm, seqs), v))
    from pardec.models.dflash import restrict_vocab

    with pytest.raises(ConfigError, match="already predicts over a reduced vocabulary"):
        restrict_vocab(small.drafter, DraftVocab(range(4), v), lm.model.lm_head)


#: rank paths over a block of 4's three slots: two candidates for slot 1, the top-1 chain three deep
TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


@pytest.mark.parametrize("impl", ["hf", "lean"])
def test_greedy_dflash_over_a_rank_tree_equals_ar_and_its_chain_tree_equals_the_chain(fitted, impl, tmp_path):
    """``method.tree``: the slots' top-ranked tokens as a static tree, verified in one forward: exact, accepted
    deep on the fitted contexts, cut to fewer slots when fewer are asked for; a tree of the top-1 chain decodes
    exactly as the chain mode does, forward for forward."""
    lm, path, seqs = fitted
    cm = CachedModel(lm.model, forward_impl=impl)
    ar = build_decoder("ar", cm, lm.tokenizer)
    tree = str(save_tree(tmp_path / "T6.json", "T6", TREE))
    chain = str(save_tree(tmp_path / "C3.json", "C3", [[0], [0, 0], [0, 0, 0]]))
    fresh = torch.randint(0, lm.model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    for prompt in (seqs[0][:3], seqs[1][:5], fresh):
        ref = ar.generate(prompt, 30).tokens
        res = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path), tree=tree).generate(prompt, 30)
        assert res.tokens == ref, prompt
        assert (res.extras["tree"], res.extras["tree_nodes"]) == ("T6", 6)
        assert res.extras["rounds"] == res.target_forwards - 1 and res.drafted <= 6 * res.extras["rounds"]
        if prompt is not fresh:
            assert max(res.accepted) >= 3, res.accepted
        one = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path), tree=tree, num_speculative_tokens=1)
        cut = one.generate(prompt, 30)
        assert cut.tokens == ref and cut.extras["tree_nodes"] == 2 and max(cut.accepted) <= 2
        as_chain = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path), tree=chain).generate(prompt, 30)
        plain = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path)).generate(prompt, 30)
        assert as_chain.tokens == ref and as_chain.accepted == plain.accepted


def test_a_rank_tree_in_trees_by_name_and_bad_trees_one_line(fitted, tmp_path):
    lm, path, seqs = fitted
    mine = tmp_path / "drafter"
    shutil.copytree(path, mine)
    save_tree(mine / "trees" / "T6.json", "T6", TREE)  # where the drafter's eval stage writes its searched trees
    cm = CachedModel(lm.model, forward_impl="lean")
    res = build_decoder("dflash", cm, None, None, path=str(mine), tree="T6").generate(seqs[0][:3], 20)
    assert res.tokens == build_decoder("ar", cm).generate(seqs[0][:3], 20).tokens and res.extras["tree"] == "T6"
    with pytest.raises(ConfigError, match=r"method.tree='T9' is not a tree file or a known name; choose chain, a "
                                          r"JSON file, or one of: T6"):
        build_decoder("dflash", None, None, None, path=str(mine), tree="T9")  # before any model
    deep = str(save_tree(tmp_path / "D4.json", "D4", [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]]))
    with pytest.raises(ConfigError, match="deeper|depth"):  # a block of 4 drafts 3 slots
        build_decoder("dflash", CachedModel(lm.model), None, None, path=str(path), tree=deep)

