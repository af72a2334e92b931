"""Every decoder, whole generations, on a virtual CUDA device (pardec.testing): a tensor created on the CPU
that meets the model's CUDA tensors, or a CPU generator sampling for them, fails here as it would on a GPU; and
the tokens equal those of the same run on the CPU (the values are real, so greedy and seeded sampling agree)."""

from __future__ import annotations

import pytest

from pardec.config import SamplingConfig
from pardec.decoding import METHODS, Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.testing import VirtualCUDA
from tests.conftest import noisy, tiny
from tests.decoding.drafters import drafter_params

SAMPLINGS = {"greedy": SamplingConfig(), "sampled": SamplingConfig(temperature=1.0, top_k=20, top_p=0.9, seed=3)}


def _generate(method: str, sampling: SamplingConfig, n: int = 20, model=None, **params):
    lm = tiny(0)
    model = model or lm.model
    draft = CachedModel(noisy(0), name="draft:noisy") if METHODS.get(method).needs_draft else None
    dec = build_decoder(method, CachedModel(model), lm.tokenizer, draft,
                        **{**drafter_params(method, lm.model), **params})
    ids = lm.tokenizer("def fibonacci(n):\n    return")["input_ids"]
    return dec.generate(ids, n, Stopper(lm.tokenizer), sampling)


@pytest.mark.parametrize("sampling", ["greedy", pytest.param("sampled", marks=pytest.mark.slow)])
@pytest.mark.parametrize("method", METHODS.names())
def test_decoder_runs_on_cuda(method, sampling):
    s = SAMPLINGS[sampling]
    on_cpu = _generate(method, s)
    noisy(0)  # built (and cached) outside the mode: its noise is CPU work of the test, not of the decoder
    with VirtualCUDA() as vc:
        vc.place(tiny(0).model)
        vc.place(noisy(0))
        on_cuda = _generate(method, s)
    assert on_cuda.tokens == on_cpu.tokens
    assert on_cuda.target_forwards == on_cpu.target_forwards


def test_draft_and_target_on_different_gpus():
    """A draft on its own GPU (cuda:1) next to the target (cuda:0): drafts cross devices explicitly."""
    on_cpu = _generate("sps", SAMPLINGS["sampled"])
    with VirtualCUDA(devices=2) as vc:
        vc.place(tiny(0).model, "cuda:0")
        vc.place(noisy(0), "cuda:1")
        on_cuda = _generate("sps", SAMPLINGS["sampled"])
    assert on_cuda.tokens == on_cpu.tokens


@pytest.mark.parametrize("method", ["jacobi", "lookahead", pytest.param("ouroboros", marks=pytest.mark.slow), "medusa",
                                    "firp", "sdsat"])
def test_decoder_runs_on_a_target_split_over_two_gpus(method):
    """``model.device_map=auto`` splits a big target over GPUs (layer 0 on cuda:0, layer 1 and the head on cuda:1
    here): tree masks, logits_at, drafter heads and cache compaction must follow each layer's device."""
    import copy

    from accelerate.hooks import remove_hook_from_submodules

    from tests.models.test_virtual_cuda import _split

    s = SAMPLINGS["greedy"]
    model = copy.deepcopy(tiny(0).model)
    on_cpu = _generate(method, s, model=model)
    noisy(0)
    with VirtualCUDA(devices=2) as vc:
        _split(model, vc)
        vc.place(noisy(0), "cuda:0")
        on_cuda = _generate(method, s, model=model)
        remove_hook_from_submodules(model)
    assert on_cuda.tokens == on_cpu.tokens
