"""`pld` specifics: the draft cut by measured costs (``num_pred_by_cost``), and its errors."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.models.cost import CostTable
from tests.conftest import tiny

PROMPT = [1, 504, 1812, 77, 900]


def _table(ms: dict[int, float]) -> CostTable:
    return CostTable("tiny", "fp32", 100, ms, machine={"cpu": "test"})


def _oracle(lm, ref: list[int], **params):
    """A pld whose lookup always proposes the next 10 tokens of the reference (every draft token accepted)."""
    dec = build_decoder("pld", CachedModel(lm.model), lm.tokenizer, **params)
    dec.propose = lambda seq: torch.tensor(ref[seq.numel() - len(PROMPT):][:10], dtype=torch.long)
    return dec


def test_num_pred_by_cost_keeps_the_output_and_follows_the_table():
    lm = tiny(0)
    ref = build_decoder("ar", CachedModel(lm.model), lm.tokenizer).generate(PROMPT, 60, Stopper(lm.tokenizer))
    full = _oracle(lm, ref.tokens).generate(PROMPT, 60, Stopper(lm.tokenizer))
    assert full.tokens == ref.tokens and max(full.accepted[1:]) == 11  # 10 drafted + the target's own
    # 5 rows cost what one does, 6 and more ten times as much: every draft is cut to 4 tokens
    dec = _oracle(lm, ref.tokens, num_pred_by_cost=True)
    dec.target.cost = _table({1: 1.0, 2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0, 8: 10.0, 16: 10.0})
    res = dec.generate(PROMPT, 60, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens
    assert res.accepted[1:-1] == [5] * (len(res.accepted) - 2)
    # a flat table: the whole draft
    dec = _oracle(lm, ref.tokens, num_pred_by_cost=True)
    dec.target.cost = _table({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0, 16: 1.0})
    assert dec.generate(PROMPT, 60, Stopper(lm.tokenizer)).accepted == full.accepted


def test_num_pred_by_cost_with_real_lookups_equals_ar():
    lm = tiny(0)
    ref = build_decoder("ar", CachedModel(lm.model), lm.tokenizer).generate(PROMPT, 80, Stopper(lm.tokenizer))
    dec = build_decoder("pld", CachedModel(lm.model), lm.tokenizer, num_pred_by_cost=True)
    dec.target.cost = _table({1: 1.0, 2: 1.3, 3: 1.9, 4: 1.4, 8: 1.5, 16: 2.0})
    assert dec.generate(PROMPT, 80, Stopper(lm.tokenizer)).tokens == ref.tokens


def test_num_pred_by_cost_needs_a_cost_table():
    lm = tiny(0)
    dec = build_decoder("pld", CachedModel(lm.model), lm.tokenizer, num_pred_by_cost=True)
    with pytest.raises(ConfigError, match="num_pred_by_cost=true needs this machine's forward-cost table"):
        dec.generate(PROMPT, 8, Stopper(lm.tokenizer))
