"""transformers' generate() peers: nothing leaks from the model's generation_config, counts are real, the
prompt-lookup and assisted variants equal `ar` under greedy decoding, NaN logits raise."""

from __future__ import annotations

import copy

import pytest
import torch

from pardec.config import ConfigError, ModelConfig, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.hf_generate import HFAssisted, HFPromptLookup
from pardec.models.cached import CachedModel, NonFiniteLogitsError
from pardec.models.loading import load_model
from tests.conftest import tiny

CODE = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return"


def _leaky(eos: int) -> torch.nn.Module:
    """A copy of the tiny model whose own generation_config would stop at ``eos`` and sample with top_k=50."""
    model = copy.deepcopy(tiny(0).model)
    model.generation_config.eos_token_id = eos
    model.generation_config.top_k = 50
    model.generation_config.repetition_penalty = 2.0
    return model


def test_model_eos_and_penalties_do_not_leak_into_greedy_generate():
    lm = tiny(0)
    ids = lm.tokenizer(CODE)["input_ids"]
    ref = build_decoder("ar", CachedModel(lm.model), lm.tokenizer).generate(ids, 24, Stopper(lm.tokenizer))
    early = ref.tokens[3]  # a token the model emits early on: the leaky generation_config calls it EOS
    cm = CachedModel(_leaky(early))
    res = build_decoder("hf_generate", cm, lm.tokenizer).generate(ids, 24, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens and res.stop_reason == "length"  # empty Stopper: no EOS stop at all
    assert res.target_forwards == 24 and res.accepted == [1] * 24
    stopped = build_decoder("hf_generate", cm, lm.tokenizer).generate(ids, 24, Stopper(lm.tokenizer, {early}))
    cut = ref.tokens.index(early) + 1
    assert stopped.tokens == ref.tokens[:cut] and stopped.stop_reason == "eos"
    assert cm.model.generation_config.eos_token_id == early  # the model's own config is restored


def _ranks(model, prompt: list[int], new: list[int]) -> list[int]:
    """Rank of each generated token under the model's logits at its position (0 = argmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + new])).logits[0, len(prompt) - 1 : -1]  # [N, V]
    picked = logits.gather(1, torch.tensor(new)[:, None])  # [N, 1]
    return (logits > picked).sum(1).tolist()


def test_top_k_zero_means_no_top_k_under_sampling():
    lm = tiny(0)
    model = _leaky(lm.tokenizer.eos_token_id)
    model.generation_config.repetition_penalty = 1.0  # keep the ranks comparable with plain logits
    cm, ids = CachedModel(model), lm.tokenizer(CODE)["input_ids"]

    def ranks(top_k: int) -> list[int]:
        s = SamplingConfig(temperature=1.0, top_k=top_k, seed=3)
        res = build_decoder("hf_generate", cm, lm.tokenizer).generate(ids, 40, Stopper(lm.tokenizer), s)
        assert len(res.tokens) == 40
        return _ranks(model, ids, res.tokens)

    # a random tiny model is nearly uniform over 49k tokens: without top-k nearly every sample ranks >= 50
    assert sum(r >= 50 for r in ranks(0)) > 30
    assert max(ranks(50)) < 50  # the control: an explicit top_k=50 is applied


@pytest.fixture(scope="module")
def twin() -> CachedModel:
    """A draft that is a separate copy of the target (seed 0): it proposes exactly the target's tokens."""
    return CachedModel(load_model(ModelConfig(name="tiny_random", source="tiny_random", seed=0)).model)


@pytest.mark.parametrize("prompt", [CODE, "The quick brown fox jumps over the lazy dog. " * 6])
def test_peers_equal_ar_with_real_counts(prompt, twin):
    lm = tiny(0)
    cm, tok = CachedModel(lm.model), lm.tokenizer
    ids, stop = tok(prompt)["input_ids"], Stopper(tok)
    ref = build_decoder("ar", cm, tok).generate(ids, 33, stop)
    for name, params, draft in [("hf_generate", {}, None), ("hf_pld", {}, None),
                                ("hf_pld", {"prompt_lookup_num_tokens": 3, "max_matching_ngram_size": 1}, None),
                                ("hf_assisted", {}, CachedModel(tiny(1).model)),
                                ("hf_assisted", {"num_assistant_tokens": 4, "num_assistant_tokens_schedule":
                                                 "heuristic", "assistant_confidence_threshold": 0.0}, twin)]:
        res = build_decoder(name, cm, tok, draft, **params).generate(ids, 33, stop)
        assert res.tokens == ref.tokens, (name, params)
        assert len(res.accepted) == res.target_forwards and sum(res.accepted) == 33
        assert 0 <= res.draft_accepted <= res.drafted
        if name == "hf_assisted":
            assert res.draft_forwards >= res.target_forwards - 1 and res.draft_s > 0
        else:
            assert res.draft_forwards == 0 and res.draft_s == 0.0
    # the twin draft is always right: every drafted token is accepted and forwards commit several tokens
    res = build_decoder("hf_assisted", cm, tok, twin, num_assistant_tokens=5,
                        assistant_confidence_threshold=0.0).generate(ids, 33, stop)
    assert res.tokens == ref.tokens and res.target_forwards == 6  # 6 tokens per forward: 5 drafted + 1
    assert res.drafted == res.draft_accepted > 0
    assert max(res.accepted) == 6 and res.draft_accepted == sum(a - 1 for a in res.accepted)
    assert twin.model.generation_config.num_assistant_tokens is None  # draft settings restored after the call


def test_stop_string_inside_a_multi_token_forward(twin):
    lm = tiny(0)
    cm, tok = CachedModel(lm.model), lm.tokenizer
    ids = tok(CODE)["input_ids"]
    free = build_decoder("ar", cm, tok).generate(ids, 30, Stopper(tok))
    stop = Stopper(tok, (), [tok.decode(free.tokens[9:11])])  # a string ending somewhere mid-output
    ref = build_decoder("ar", cm, tok).generate(ids, 30, stop)
    assert ref.stop_reason == "stop_string"
    res = build_decoder("hf_assisted", cm, tok, twin, num_assistant_tokens=6,
                        assistant_confidence_threshold=0.0).generate(ids, 30, stop)
    assert res.tokens == ref.tokens and res.stop_reason == "stop_string"
    assert res.target_forwards < len(ref.tokens)  # it did commit several tokens per forward


def test_nan_logits_raise_naming_the_model():
    model = copy.deepcopy(tiny(0).model)
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.fill_(float("nan"))
    tok = tiny(0).tokenizer
    dec = build_decoder("hf_generate", CachedModel(model), tok)
    with pytest.raises(NonFiniteLogitsError, match=r"target model .* NaN/inf logits at sequence position \d+"):
        dec.generate(tok(CODE)["input_ids"], 8, Stopper(tok))
    with pytest.raises(NonFiniteLogitsError):
        dec.generate(tok(CODE)["input_ids"], 8, Stopper(tok), SamplingConfig(temperature=1.0))


def test_parameters_are_checked_and_assisted_needs_a_draft():
    with pytest.raises(ConfigError, match="prompt_lookup_num_tokens=0 is out of range"):
        HFPromptLookup(None, prompt_lookup_num_tokens=0)
    with pytest.raises(ConfigError, match="num_assistant_tokens_schedule='fast' is not valid"):
        HFAssisted(None, num_assistant_tokens_schedule="fast")
    with pytest.raises(ConfigError, match="assistant_confidence_threshold=1.5"):
        HFAssisted(None, assistant_confidence_threshold=1.5)
    with pytest.raises(ConfigError, match="needs a draft model"):
        build_decoder("hf_assisted", CachedModel(tiny(0).model), tiny(0).tokenizer)


def test_hf_names_a_forward_not_a_method():
    """"hf" is the forward (``forward_impl=hf``); the method is ``hf_generate``, and the old alias is refused naming
    the valid methods."""
    from pardec.decoding.base import METHODS
    from pardec.registry import UnknownNameError

    assert METHODS.get("hf_generate").name == "hf_generate"
    with pytest.raises(UnknownNameError, match=r"unknown method 'hf'\..*Valid methods: .*\bhf_generate\b"):
        METHODS.get("hf")
