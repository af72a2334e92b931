"""model.cpu_prepack (pardec.models.quant.packed): bf16 CPU linears prepacked for oneDNN compute bitwise what F.linear
computes, row by row independently; loading packs bf16 CPU models for inference only (not for training, not when
switched off, not other dtypes); tied weights stay tied; every forward impl runs them (the compiled step as an opaque
op); a CPU without AMX-bf16 packs nothing. All but the last need a CPU with AMX-bf16."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pardec.config import ModelConfig
from pardec.models.cached import CachedModel
from pardec.models.loading import load_model, trainable
from pardec.models.quant import packed
from tests.models.forward.test_compiled import needs_compiler
from tests.models.forward.test_lean import _script

needs_bf16 = pytest.mark.skipif(not packed.supported(),
                                reason="packing is on only on CPUs with AMX-bf16 (where it was measured); this CPU has "
                                       "none, so nothing is packed here (tested below)")

TINY = ModelConfig(name="tiny_random", source="tiny_random", device="cpu", dtype="bf16")


@needs_bf16
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_is_bitwise_f_linear_and_each_row_independent_of_the_others(bias):
    torch.manual_seed(0)
    lin = nn.Linear(576, 1536, bias=bias).to(torch.bfloat16)  # one of SmolLM2's MLP shapes
    p = packed.PackedLinear(lin)
    with torch.inference_mode():
        for shape in [(1, 576), (5, 576), (1, 5, 576), (2, 3, 576), (17, 576)]:
            x = torch.randn(*shape).to(torch.bfloat16)
            assert torch.equal(p(x), F.linear(x, lin.weight, lin.bias)), shape
        x = torch.randn(6, 576).to(torch.bfloat16)
        x[2] *= 50  # a row far larger than the others changes nothing for them
        alone = torch.cat([p(x[i : i + 1]) for i in range(6)])
        assert torch.equal(p(x), alone)


@needs_bf16
def test_loading_packs_bf16_cpu_models_for_inference_only():
    lm = load_model(TINY)
    assert packed.is_packed(lm.model)
    assert all(type(m) is not nn.Linear for m in lm.model.modules())
    for cfg in (replace(TINY, cpu_prepack=False), trainable(TINY, "bf16"), replace(TINY, dtype="fp32")):
        m = load_model(cfg).model
        assert not packed.is_packed(m), cfg
    assert trainable(TINY, "bf16").device == "cpu"


@needs_bf16
def test_packed_models_give_bitwise_the_logits_of_unpacked_ones_under_every_forward_impl():
    plain = load_model(replace(TINY, cpu_prepack=False)).model
    pk = load_model(TINY).model
    for impl in ("hf", "lean"):
        with torch.inference_mode():
            for a, b in zip(_script(CachedModel(plain, forward_impl=impl)), _script(CachedModel(pk, forward_impl=impl))):
                assert torch.equal(a, b), impl


@needs_bf16
@needs_compiler
def test_the_compiled_step_runs_packed_linears_as_an_opaque_op():
    pk = load_model(TINY).model
    plain = load_model(replace(TINY, cpu_prepack=False)).model
    lean = _script(CachedModel(pk, forward_impl="lean"))
    comp = _script(CachedModel(pk, forward_impl="compiled"))
    for a, b, c in zip(lean, comp, _script(CachedModel(plain, forward_impl="compiled"))):
        assert torch.equal(b, c)  # packed or not, the compiled step computes the same bits
        # (the compiled step fuses the bf16 glue differently from the lean forward: one bf16 rounding step apart)
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=8e-3)


@needs_bf16
def test_a_tied_head_stays_tied_to_the_embeddings():
    m = load_model(replace(TINY, cpu_prepack=False)).model
    m.lm_head.weight = m.get_input_embeddings().weight  # tied, as SmolLM2's is
    assert packed.prepack(m) > 0
    assert isinstance(m.lm_head, packed.PackedLinear)
    assert m.lm_head.weight is m.get_input_embeddings().weight
    h = torch.randn(3, m.config.hidden_size).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(m.lm_head(h), F.linear(h, m.get_input_embeddings().weight))


def test_a_cpu_without_amx_bf16_packs_nothing(monkeypatch):
    monkeypatch.setattr(packed, "supported", lambda: False)
    m = load_model(TINY).model
    assert not packed.is_packed(m)
    assert packed.prepack(m) == 0


def test_only_bf16_cpu_linears_can_be_packed():
    with pytest.raises(ValueError, match="bf16 CPU linears.*float32"):
        packed.PackedLinear(nn.Linear(4, 4))
