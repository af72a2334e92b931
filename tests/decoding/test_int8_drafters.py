"""dtype=int8: the hidden-state drafters' linears run int8 too (``method.int8_weights``,
``pardec.models.drafters.place``), batch-1 and batched, while the output stays int8 ``ar``'s token for token; fp32
targets and ``int8_weights=null`` keep them in floats; a bad scheme is refused before any drafter loads. A DFlash
draft vocabulary on an int8 target is the target's int8 head's rows, each kept logit bitwise the whole head's."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import build_decoder
from pardec.decoding.batch import build_batched, run_batch
from pardec.models.cached import CachedModel
from pardec.models.loading import load_model
from pardec.models.quant.int8 import is_int8, weight_scheme
from tests.conftest import tiny
from tests.decoding.drafters import drafter_params, vocab_dir
from tests.models.forward.test_invariant import _cfg

PROMPTS = [[1, 504, 1812], [3, 9, 27, 81, 243]]


@pytest.fixture(scope="module")
def int8_target():
    """Per-token int8 with invariant attention: every verified row bitwise ``ar``'s one-token step."""
    return load_model(_cfg("invariant", "int8", hidden=64)).model  # tiny(0)'s shape: its drafter fits


@pytest.mark.parametrize("method", ["dflash", "eagle3", "medusa"])
def test_an_int8_target_gets_an_int8_drafter_and_the_output_stays_ar(method, int8_target):
    m = int8_target
    params = drafter_params(method, m)
    if method == "eagle3":
        params["mode"] = "chain"
    ar = [build_decoder("ar", CachedModel(m)).generate(p, 16).tokens for p in PROMPTS]
    dec = build_decoder(method, CachedModel(m), **params)
    assert weight_scheme(dec.drafter) == "per_token"  # the method's default (conf/method/<method>.yaml)
    runs = [dec.generate(p, 16) for p in PROMPTS]
    assert [r.tokens for r in runs] == ar
    if method == "medusa":  # untrained test heads: whether one of their drafts is accepted in 16 tokens is luck, which
        assert sum(r.drafted for r in runs) > 0  # differs between CPUs' int8 kernels (none on an AVX2-only EPYC)
    else:  # the fitted drafters' int8 drafts were accepted, not only the target's tokens
        assert sum(r.draft_accepted for r in runs) > 0
    floats = build_decoder(method, CachedModel(m), **params, int8_weights=None)
    assert not is_int8(floats.drafter)
    assert [floats.generate(p, 16).tokens for p in PROMPTS] == ar
    batched = build_batched(method, m, 2, 64, **params)
    assert weight_scheme(batched.drafter) == "per_token"
    assert [r.tokens for r in run_batch(batched, PROMPTS, 16).results] == ar


def test_an_int8_dflash_draft_vocabulary_is_the_int8_heads_rows(int8_target):
    m = int8_target
    v = int(m.config.vocab_size)
    ids = sorted(set(range(0, v, 2)) | {t for p in PROMPTS for t in p})
    params = {**drafter_params("dflash", m), "draft_vocab": vocab_dir(ids, v)}
    dec = build_decoder("dflash", CachedModel(m), **params)
    head = dec.drafter.lm_head
    assert type(head) is type(m.lm_head) and head.weight.dtype == torch.int8
    x = torch.randn(3, m.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(head(x), m.lm_head(x)[:, ids])
    ar = [build_decoder("ar", CachedModel(m)).generate(p, 16).tokens for p in PROMPTS]
    assert [dec.generate(p, 16).tokens for p in PROMPTS] == ar
    batched = build_batched("dflash", m, 2, 64, **params)
    assert batched.drafter.config.draft_vocab_size == len(ids)
    assert [r.tokens for r in run_batch(batched, PROMPTS, 16).results] == ar


def test_a_float_target_keeps_its_drafter_in_floats_and_a_given_drafter_is_copied(int8_target):
    lm = tiny(0)
    dec = build_decoder("dflash", CachedModel(lm.model), **drafter_params("dflash", lm.model))
    assert not is_int8(dec.drafter) and dec.drafter.dtype == torch.float32
    given = dec.drafter
    on_int8 = build_decoder("dflash", CachedModel(int8_target), draft=given, int8_weights="weight_only")
    assert weight_scheme(on_int8.drafter) == "weight_only"
    assert not is_int8(given)  # the drafter handed in is not quantized in place


@pytest.mark.parametrize("method", ["dflash", "eagle3", "medusa", "firp"])
def test_a_bad_scheme_is_refused_naming_the_choices(method):
    lm = tiny(0)
    with pytest.raises(ConfigError, match=r"method.int8_weights='int4' is not valid; choose one of: weight_only, "
                                          r"per_channel, per_tensor, per_token or null"):
        build_decoder(method, CachedModel(lm.model), path="/nonexistent", int8_weights="int4")
    if method != "firp":
        with pytest.raises(ConfigError, match=r"method.int8_weights='int4'"):
            build_batched(method, lm.model, 2, 64, path="/nonexistent", int8_weights="int4")
