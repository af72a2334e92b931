"""Verification forwards padded to a cheaper row count (CachedModel.cost, pardec.models.cost): the padding rows
change nothing a caller sees (logits, cache, tokens), and every lossless method still equals greedy `ar`."""

from __future__ import annotations

import pytest
import torch

from pardec.decoding import METHODS, Stopper
from pardec.decoding.base import lossless_under_greedy
from pardec.models.cached import CachedModel
from pardec.models.cost import CostTable
from tests.conftest import tiny
from tests.decoding.test_lossless import _ar, _build
from tests.models.forward.test_compiled import COMPILES

#: every row count from 2 to 7 is padded to 8 (what a machine whose 8-row GEMM is cheapest would measure)
PAD_TO_8 = CostTable("tiny", "fp32", 0, {1: 1.0, **{t: 9.0 for t in range(2, 8)}, 8: 2.0}, machine={})
#: ... and every row count up to 127 to 128 (lookahead's windows and SpecTr's drafts are wider than 8)
PAD_TO_128 = CostTable("tiny", "fp32", 0, {1: 1.0, **{t: 9.0 for t in range(2, 128)}, 128: 2.0}, machine={})
PROMPT = [5, 17, 300, 41, 8, 999, 23, 7, 61]


def _pair(impl: str = "hf"):
    """(unpadded, padded) on forward ``impl``: under ``compiled`` the padded rows run the compiled rows function."""
    plain, padded = CachedModel(tiny(0).model, forward_impl=impl), CachedModel(tiny(0).model, forward_impl=impl)
    padded.cost = PAD_TO_8
    for cm in (plain, padded):
        cm.prefill(torch.tensor([PROMPT]))
    return plain, padded


def _same(a, b):
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


#: transformers' forward, and the compiled rows (pardec.models.forward.compiled.rows_step) the padded rows run through
IMPLS = ["hf", pytest.param("compiled", marks=COMPILES)]


@pytest.mark.parametrize("impl", IMPLS)
def test_a_padded_chain_forward_is_invisible(impl):
    plain, padded = _pair(impl)
    new = torch.tensor([[11, 12, 13]])
    a, b = plain.forward(new, hidden_layer=1), padded.forward(new, hidden_layer=1)
    assert b.logits.shape == a.logits.shape == (1, 3, a.logits.shape[-1])
    _same(a.logits, b.logits)
    _same(a.hidden, b.hidden)
    assert padded.length == plain.length == len(PROMPT) + 3 and padded.tokens == plain.tokens
    assert padded.padded_rows == 5
    for cm in (plain, padded):  # the cache holds no trace of the padding: the next forward agrees too
        cm.truncate(len(PROMPT) + 2)
    _same(plain.forward(torch.tensor([[14, 15]])).logits, padded.forward(torch.tensor([[14, 15]])).logits)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("full", [False, True])
def test_a_padded_tree_forward_with_chosen_logits_is_invisible(full, impl):
    if impl == "compiled":  # its graphs start from a clean slate, whatever compiled before it in this process
        torch._dynamo.reset()
    plain, padded = _pair(impl)
    # a tree: root 0; 1 and 2 children of 0; 3 child of 1
    attend = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    if full:  # the [T, past + T] form
        attend = torch.cat([torch.ones(4, len(PROMPT), dtype=torch.bool), attend], dim=1)
    pos = torch.tensor([0, 1, 1, 2]) + len(PROMPT)
    new = torch.tensor([[20, 21, 22, 23]])
    a = plain.forward(new, positions=pos, attend=attend, logits_at=[1, 3])
    b = padded.forward(new, positions=pos, attend=attend, logits_at=[1, 3])
    assert b.logits.shape == a.logits.shape == (1, 2, a.logits.shape[-1])
    _same(a.logits, b.logits)
    for cm in (plain, padded):
        cm.keep([0, 1, 3])
    assert padded.tokens == plain.tokens and padded.length == plain.length
    _same(plain.forward(torch.tensor([[9, 9]])).logits, padded.forward(torch.tensor([[9, 9]])).logits)


def test_single_rows_and_prefill_are_not_padded():
    _, padded = _pair()
    assert padded.padded_rows == 0  # the prefill
    padded.forward(torch.tensor([[3]]))
    assert padded.padded_rows == 0


@pytest.mark.parametrize("method", ["jacobi", "sps", "lookahead", "ouroboros", "spectr", "medusa", "sdsat"])
def test_lossless_methods_equal_ar_with_padded_verification(method):
    assert lossless_under_greedy(METHODS.get(method))
    lm = tiny(0)
    ids = lm.tokenizer("The quick brown fox jumps over the lazy dog. " * 6)["input_ids"]
    stop = Stopper(lm.tokenizer)
    ref = _ar(CachedModel(lm.model), lm.tokenizer, ids, 30, stop)
    cm = CachedModel(lm.model)
    cm.cost = PAD_TO_128
    res = _build(method, cm, lm.tokenizer, 0, "self").generate(ids, 30, stop)
    assert res.tokens == ref.tokens
    assert cm.padded_rows > 0
