"""evaluation.spec.check_placement: each model's forward is checked where it will run, before any weights load; a
split target refuses the forwards that cannot follow it, its draft keeps its own (``draft_forward_impl``)."""

from __future__ import annotations

import pytest

from pardec.config import ConfigError, ModelConfig, RunConfig
from pardec.evaluation.spec import check_placement
from pardec.testing import VirtualCUDA

SPLIT = ModelConfig(name="yi_34b", source="hub", path="01-ai/Yi-34B", device_map="auto")
DRAFT = ModelConfig(name="yi_6b", source="hub", path="01-ai/Yi-6B")


@pytest.mark.parametrize("impl", ["lean", "compiled", "cudagraph"])
def test_a_split_target_refuses_forwards_that_cannot_follow_it(impl):
    with VirtualCUDA(devices=8), pytest.raises(ConfigError, match=f"forward_impl={impl} cannot run 'yi_34b': it is "
                                                                 "split over several GPUs.*use forward_impl=auto or hf"):
        check_placement(SPLIT, DRAFT, RunConfig(forward_impl=impl))


def test_the_draft_of_a_split_target_may_be_graphed():
    with VirtualCUDA(devices=8):
        for impl in ("auto", "hf"):
            devices = check_placement(SPLIT, DRAFT, RunConfig(forward_impl=impl, draft_forward_impl="cudagraph"))
            assert [d.type for d in devices] == ["cuda", "cuda"]
        with pytest.raises(ConfigError, match="draft_forward_impl=lean cannot run 'yi_34b'"):
            check_placement(SPLIT, SPLIT, RunConfig(forward_impl="hf", draft_forward_impl="lean"))


def test_cudagraph_without_cuda_is_refused_before_loading():
    tiny = ModelConfig(name="tiny_random", source="tiny_random")
    with pytest.raises(ConfigError, match="forward_impl=cudagraph replays CUDA graphs but 'tiny_random' runs on cpu"):
        check_placement(tiny, None, RunConfig(forward_impl="cudagraph"))
    with pytest.raises(ConfigError, match="draft_forward_impl=cudagraph .* runs on cpu"):
        check_placement(tiny, tiny, RunConfig(forward_impl="auto", draft_forward_impl="cudagraph"))
    with pytest.raises(ConfigError, match="model.device=cuda but no CUDA device is usable here"):
        check_placement(ModelConfig(name="m", source="tiny_random", device="cuda"), None, RunConfig())
    with pytest.raises(ConfigError, match="draft_forward_impl='fast' is not valid; choose one of: None, auto, hf"):
        RunConfig(draft_forward_impl="fast")


def test_a_draft_asking_for_cuda_is_named():
    tiny = ModelConfig(name="tiny_random", source="tiny_random")
    with pytest.raises(ConfigError, match="^draft.device=cuda but no CUDA device is usable here.*draft.device=auto"):
        check_placement(tiny, ModelConfig(name="d", source="tiny_random", device="cuda"), RunConfig())
