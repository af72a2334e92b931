"""DraftForCausalLM on a tiny random Llama: exact copy of the target, reduced head, cache, save/load, generate."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import pardec.models  # noqa: F401  (registers pardec_draft)
from pardec.config import ModelConfig
from pardec.models.cached import CachedModel
from pardec.models.compat import cache_kw
from pardec.models.draft import DraftForCausalLM, build_draft
from pardec.models.loading import load_model
from pardec.models.vocab import choose_vocab
from tests.conftest import tiny

IDS = torch.tensor([[5, 17, 923, 44, 8, 301, 12], [7, 7, 1000, 2, 90, 4, 11]])  # [2, 7]


def test_all_layers_full_vocab_reproduce_the_target():
    t = tiny().model
    d = build_draft(t, [0, 1], list(range(t.config.vocab_size)))
    assert isinstance(d, DraftForCausalLM) and not d.config.tie_word_embeddings
    # same weights, same ops; CPU matmul kernels may order sums differently between calls (~1e-7)
    torch.testing.assert_close(d(IDS).logits, t(IDS).logits, rtol=0, atol=1e-6)
    # cached: prefill 4 tokens, then 3 more, same as the target's cached run
    outs = []
    for m in (t, d):
        cache = DynamicCache(config=m.config)
        m(IDS[:, :4], **cache_kw(m, cache), use_cache=True)
        outs.append(m(IDS[:, 4:], **cache_kw(m, cache), use_cache=True, logits_to_keep=2).logits)
    assert outs[0].shape == (2, 2, t.config.vocab_size)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)


def test_reduced_vocab_and_layer_subset():
    t = tiny(layers=3).model
    keep = [0, 2, 5, 100, 4000]
    d = build_draft(t, [2, 0], keep)
    assert [layer.self_attn.layer_idx for layer in d.model.layers] == [0, 1]  # re-indexed for the cache
    assert torch.equal(d.model.layers[0].mlp.up_proj.weight, t.model.layers[2].mlp.up_proj.weight)
    hidden = d.model(IDS).last_hidden_state  # [2, 7, H]
    want = hidden @ t.lm_head.weight[keep].T  # the target head's rows
    logits = d(IDS).logits  # [2, 7, V]
    assert torch.allclose(logits[..., keep], want, atol=1e-6)
    rest = torch.ones(t.config.vocab_size, dtype=torch.bool)
    rest[keep] = False
    assert (logits[..., rest] == torch.finfo(torch.float32).min).all() and logits.isfinite().all()
    assert torch.equal(d(IDS, draft_logits=True).logits, logits[..., keep])
    assert torch.softmax(logits, -1)[..., rest].sum() == 0
    with pytest.raises(ValueError, match="out of range"):
        build_draft(t, [3], keep)


def test_save_load_generate_and_assist(tmp_path):
    lm = tiny()
    t = lm.model
    d = build_draft(t, [1], choose_vocab(Counter({923: 5, 44: 2}), 512, [lm.tokenizer.eos_token_id],
                                        t.config.vocab_size))
    d.save_pretrained(tmp_path / "d")
    lm.tokenizer.save_pretrained(tmp_path / "d")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "d")
    assert type(loaded) is DraftForCausalLM and loaded.config.draft_vocab == d.config.draft_vocab
    assert torch.equal(loaded(IDS).logits, d(IDS).logits)
    via_pardec = load_model(ModelConfig(name="local", source="local", path=str(tmp_path / "d"), device="cpu"))
    assert torch.equal(via_pardec.model(IDS).logits, d(IDS).logits)
    # the seam's cached forward and HF generate / assisted generation
    cm = CachedModel(loaded)
    assert cm.prefill(IDS[:1]).isfinite().all()
    out = loaded.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert set(out[0, 7:].tolist()) <= set(d.config.draft_vocab)
    ref = t.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assisted = t.generate(IDS[:1], max_new_tokens=6, do_sample=False, pad_token_id=0, assistant_model=loaded)
    assert torch.equal(assisted, ref)  # greedy assisted generation is lossless


def test_choose_vocab():
    counts = Counter({50: 9, 7: 9, 3: 1, 999: 4})
    assert choose_vocab(counts, 4, [2], 1000) == [2, 7, 50, 999]
    assert choose_vocab(counts, 8, [], 1000) == [0, 1, 2, 3, 4, 7, 50, 999]
    with pytest.raises(ValueError, match="out of range"):
        choose_vocab(counts, 1, [], 1000)
