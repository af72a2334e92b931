"""``method.compile=true``: a DFlash round's drafter work (the committed tokens' context entries, then the block) as
one compiled graph (``pardec.models.dflash_compiled``) computes what the eager passes compute, and the output stays
``ar``'s (fp32, int8 with an int8 drafter, a draft vocabulary); bad values are refused in one line."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import build_decoder
from pardec.decoding.batch import build_batched
from pardec.decoding.dflash import ContextCache
from pardec.decoding.tree_search import save_tree
from pardec.models.cached import CachedModel
from pardec.models.dflash_compiled import draft_round
from pardec.models.drafters import load_drafter, new_drafter
from pardec.models.vocab import DraftVocab
from tests.conftest import tiny
from tests.decoding.drafters import _eagle_sequences, drafter_dir, drafter_params, vocab_dir
from tests.decoding.test_dflash import TREE
from tests.models.forward.test_compiled import needs_compiler


@pytest.fixture(scope="module")
def fitted():
    lm = tiny(1, layers=4)
    return lm, drafter_dir(lm.model, "dflash"), _eagle_sequences(lm.model)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    yield
    torch._dynamo.reset()


@torch.inference_mode()
@needs_compiler
def test_a_compiled_round_equals_the_eager_passes(fitted):
    """Round by round (nothing committed, one token, several, a whole block), the compiled round's logits and the
    context entries it wrote equal the eager ``context_kv`` + block forward + head."""
    lm, path, seqs = fitted
    d, _ = load_drafter(path, lm.model.config, "dflash")
    cm = CachedModel(lm.model, forward_impl="lean")
    ids = torch.tensor([seqs[0][:30]])
    feats = cm.forward(ids, hidden_layer=tuple(d.config.layer_ids)).hidden[0]
    width = 4
    eager = ContextCache(d, 40, ids.device, d.dtype)
    graph = ContextCache(d, 40, ids.device, d.dtype, spare=width)
    eager.append(feats[:12])
    graph.append(feats[:12])
    head = lm.model.get_output_embeddings()
    at = 12
    for m in (0, 1, 3, 4, 2):
        pending = feats[at : at + m] if m else None
        if m:
            eager.append(pending)
        at += m
        x = d.block_inputs(cm.inner().embed_tokens, torch.tensor([seqs[0][at]]), width)
        want = d.logits(d(x, torch.arange(at, at + width), eager.view())[0, 1:], head)
        got = draft_round(d, head, graph, pending, x)
        assert graph.length == eager.length == at
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for (k, v), (k2, v2) in zip(graph.view(), eager.view()):
            torch.testing.assert_close(k, k2, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v, v2, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_compiled_dflash_equals_ar_in_one_drafter_pass_a_round(fitted, tmp_path):
    """Chain and rank tree (``method.tree``: the accepted path's features are the next round's pending entries),
    the whole vocabulary and a draft vocabulary."""
    lm, path, seqs = fitted
    cm = CachedModel(lm.model, forward_impl="lean")
    ar = build_decoder("ar", cm, lm.tokenizer)
    v = int(lm.model.config.vocab_size)
    kept = sorted(set(seqs[0][:40]) | set(seqs[1][:40]) | set(range(0, v, 3)))
    tree = str(save_tree(tmp_path / "T6.json", "T6", TREE))
    for params in ({}, {"block_size": 3}, {"draft_vocab": vocab_dir(kept, v)}, {"tree": tree},
                   {"tree": tree, "draft_vocab": vocab_dir(kept, v)}):
        dec = build_decoder("dflash", cm, lm.tokenizer, None, path=str(path), compile=True, **params)
        for prompt in (seqs[0][:3], seqs[1][:5]):
            res = dec.generate(prompt, 30)
            assert res.tokens == ar.generate(prompt, 30).tokens, params
            assert max(res.accepted) >= 3, res.accepted  # the fitted contexts: drafts accepted deep
            # the prompt's context (eager), then one pass a round (none when only the target's token fits)
            assert res.extras["rounds"] <= res.draft_forwards <= res.extras["rounds"] + 1
    sampled = dec.generate(seqs[0][:3], 20, sampling=SamplingConfig(temperature=1.0, seed=4))
    assert len(sampled.tokens) == 20


@needs_compiler
def test_compiled_dflash_on_an_int8_target_equals_int8_ar():
    from tests.decoding.test_int8_drafters import PROMPTS, _cfg, load_model

    m = load_model(_cfg("invariant", "int8", hidden=64)).model
    params = drafter_params("dflash", m)
    dec = build_decoder("dflash", CachedModel(m), **params, compile=True)
    for p in PROMPTS:
        assert dec.generate(p, 16).tokens == build_decoder("ar", CachedModel(m)).generate(p, 16).tokens


@needs_compiler
def test_a_drafter_with_its_own_reduced_head_equals_ar_eager_compiled_and_on_an_int8_target():
    """A drafter trained with its own head over fewer ids (``drafter.draft_vocab_size``): eager and compiled, on an
    fp32 target and an int8 one (its head quantized with its other linears), the output is ``ar``'s."""
    from tests.decoding.test_int8_drafters import PROMPTS, _cfg, load_model

    base = tiny(0).model
    v = int(base.config.vocab_size)
    kept = sorted({int(t) for p in PROMPTS for t in p} | set(range(0, v, 2)))
    torch.manual_seed(0)
    d = new_drafter("dflash", base.config, embed=base.get_input_embeddings(), lm_head=base.get_output_embeddings(),
                    vocab=DraftVocab(kept, v), dflash={"num_layers": 2, "block_size": 4})
    assert d.config.reduced and torch.equal(d.lm_head.weight, base.get_output_embeddings().weight[kept])
    for m in (base, load_model(_cfg("invariant", "int8", hidden=64)).model):  # the int8 target: tiny(0)'s shape
        ar = build_decoder("ar", CachedModel(m))
        for compile in (False, True):
            dec = build_decoder("dflash", CachedModel(m), None, d, compile=compile)
            for p in PROMPTS:
                assert dec.generate(p, 16).tokens == ar.generate(p, 16).tokens, compile


def test_bad_compile_values_are_refused(fitted):
    lm, path, _ = fitted
    with pytest.raises(ConfigError, match=r"method.compile='yes' must be bool \(dflash\(compile: bool = False\)\)"):
        build_decoder("dflash", CachedModel(lm.model), None, None, path=str(path), compile="yes")
    with pytest.raises(ConfigError, match=r"method.compile=true is batch-1 only"):
        build_batched("dflash", lm.model, 2, 64, path=str(path), compile=True)
    with pytest.raises(ConfigError, match=r"method.tree='T6' is batch-1 only"):
        build_batched("dflash", lm.model, 2, 64, path=str(path), tree="T6")
