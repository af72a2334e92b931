"""flash_attention_2 takes no custom attention mask: every method declares whether it needs one (``custom_mask``),
the declaration matches what its forwards do, and a config pairing such a method with flash_attention_2 is refused
before anything loads, naming the methods that can use it."""

from __future__ import annotations

import pytest

from pardec.config import ConfigError, ModelConfig, SamplingConfig
from pardec.decoding import METHODS, Stopper, build_decoder
from pardec.decoding.base import check_attention
from pardec.models.cached import CachedModel, FlashAttentionMaskError
from tests.conftest import noisy, tiny
from tests.decoding.drafters import drafter_params


def _needs_mask(method: str) -> bool:
    """Whether a greedy or a sampled generation asks the seam for a custom mask (models flagged as flash)."""
    lm = tiny(0)
    ids = lm.tokenizer("def fibonacci(n):\n    return")["input_ids"]
    for sampling in (SamplingConfig(), SamplingConfig(temperature=1.0, seed=1)):
        target = CachedModel(lm.model)
        draft = CachedModel(noisy(0), name="draft") if METHODS.get(method).needs_draft else None
        for cm in (target, draft):
            if cm is not None:
                cm.flash = True  # the seam's flash-attention guard, on a model that still runs sdpa here
        try:
            build_decoder(method, target, lm.tokenizer, draft, **drafter_params(method, lm.model)).generate(
                ids, 16, Stopper(lm.tokenizer), sampling)
        except FlashAttentionMaskError:
            return True
    return False


@pytest.mark.parametrize("method", METHODS.names())
def test_custom_mask_declarations_match_the_forwards(method):
    assert METHODS.get(method).custom_mask == _needs_mask(method)


def test_flash_attention_is_refused_for_tree_methods_only():
    flash = ModelConfig(name="tiny_random", source="tiny_random", attn_implementation="flash_attention_2")
    for ok in ("ar", "jacobi", "pld", "sps"):
        check_attention(ok, flash, flash)
    with pytest.raises(ConfigError, match=r"model.attn_implementation=flash_attention_2 cannot run method 'medusa'"
                                          r".*sdpa.*jacobi"):
        check_attention("medusa", flash)
    with pytest.raises(ConfigError, match="draft.attn_implementation"):
        check_attention("ouroboros", ModelConfig(name="tiny_random", source="tiny_random"), flash)
    with pytest.raises(ConfigError, match="attn_implementation='bogus' is not valid; choose one of: sdpa, eager, "
                                          "flash_attention_2"):
        ModelConfig(attn_implementation="bogus")
