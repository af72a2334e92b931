"""pardec.models.placement.resolve_device: each rank of a multi-process launch on its own GPU (CUDA faked)."""

from __future__ import annotations

import pytest
import torch

from pardec.models.placement import resolve_device


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_one_process_resolves_as_it_always_did(monkeypatch):
    _gpus(monkeypatch, 0)
    assert resolve_device("auto", {}) == torch.device("cpu")
    assert resolve_device("auto", {"WORLD_SIZE": "4", "LOCAL_RANK": "3"}) == torch.device("cpu")  # no CUDA: CPU ranks
    with pytest.raises(ValueError, match="model.device=cuda but no CUDA device is usable here"):  # a ConfigError
        resolve_device("cuda", {})
    _gpus(monkeypatch, 8)
    assert resolve_device("auto", {}) == torch.device("cuda")
    assert resolve_device("cuda", {"LOCAL_RANK": "3"}) == torch.device("cuda")  # no WORLD_SIZE: one process
    assert resolve_device("cpu", {"WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == torch.device("cpu")


def test_each_rank_gets_its_local_gpu(monkeypatch):
    _gpus(monkeypatch, 8)
    env = {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3"}  # second node, fourth process
    assert resolve_device("auto", env) == torch.device("cuda", 3)
    assert resolve_device("cuda", env) == torch.device("cuda", 3)
    assert resolve_device("cuda:5", env) == torch.device("cuda", 5)  # written out: kept
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)  # the environment by default
    with pytest.raises(RuntimeError, match="LOCAL_RANK=8 but this node shows 8 GPUs"):
        resolve_device("auto", {"WORLD_SIZE": "16", "LOCAL_RANK": "8"})
    _gpus(monkeypatch, 1)  # the launcher shows each process its own GPU (CUDA_VISIBLE_DEVICES per rank)
    assert resolve_device("auto", {"WORLD_SIZE": "8", "LOCAL_RANK": "5"}) == torch.device("cuda", 0)


def test_device_map_ranks_split_the_nodes_gpus(monkeypatch):
    from pardec.config import ConfigError, ModelConfig
    from pardec.models.placement import placement, rank_gpus

    _gpus(monkeypatch, 8)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda g: (1000 + g, 2000))
    assert rank_gpus({}) is None and rank_gpus({"WORLD_SIZE": "1"}) is None  # one process: every GPU
    assert rank_gpus({"WORLD_SIZE": "4", "LOCAL_RANK": "2"}) == [4, 5]
    assert rank_gpus({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == [4, 5, 6, 7]  # 2 nodes
    assert rank_gpus({"WORLD_SIZE": "8", "LOCAL_RANK": "7"}) == [7]
    with pytest.raises(ConfigError, match="8 visible GPUs do not split evenly among them; launch a number of "
                                          "processes that divides 8"):
        rank_gpus({"WORLD_SIZE": "3", "LOCAL_RANK": "0"})
    cfg = ModelConfig(name="yi_34b", source="hub", path="01-ai/Yi-34B", device_map="auto")
    assert placement(cfg, {}) == {"device_map": "auto"}
    assert placement(cfg, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == {
        "device_map": "auto", "max_memory": {4: 1004, 5: 1005, 6: 1006, 7: 1007}}
    assert placement(ModelConfig(name="m", source="hub", path="x/y"), {"WORLD_SIZE": "2"}) == {}  # no device_map
    _gpus(monkeypatch, 0)  # CPU ranks (a rehearsal): accelerate places the model itself, nothing goes to disk
    assert placement(cfg, {"WORLD_SIZE": "2", "LOCAL_RANK": "1"}) == {"device_map": "auto"}
    _gpus(monkeypatch, 2)  # each of 4 processes shown its own 2 GPUs (CUDA_VISIBLE_DEVICES per rank): all of them
    assert rank_gpus({"WORLD_SIZE": "4", "LOCAL_RANK": "3"}) == [0, 1]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_a_split_targets_rank_owns_a_disjoint_group_with_its_draft_in_it(world):
    """torchrun with ``model.device_map`` on an 8-GPU node (VirtualCUDA): rank r's target spreads over its own
    group of 8 / world GPUs and its draft sits on the group's first, never inside another rank's group (before:
    on cuda:LOCAL_RANK, inside rank 0's group for rank 1 of 4)."""
    from pardec.config import ModelConfig
    from pardec.models.placement import rank_devices, rank_gpus
    from pardec.testing import VirtualCUDA

    target = ModelConfig(name="yi_34b", source="hub", path="01-ai/Yi-34B", device_map="auto")
    draft = ModelConfig(name="yi_6b", source="hub", path="01-ai/Yi-6B")
    with VirtualCUDA(devices=8):
        owned: list[set[int]] = []
        for local in range(world):
            env = {"WORLD_SIZE": str(world), "RANK": str(local), "LOCAL_RANK": str(local)}
            group = rank_gpus(env) or list(range(8))
            t, d = rank_devices(target, draft, env)
            assert t.type == d.type == "cuda" and (d.index or 0) == group[0] == (t.index or 0)
            owned.append(set(group))
        assert sum(len(g) for g in owned) == 8 and set().union(*owned) == set(range(8))  # disjoint, all used
        # without device_map each rank keeps its LOCAL_RANK's GPU, as before
        plain = ModelConfig(name="m", source="hub", path="x/y")
        assert rank_devices(plain, draft, {"WORLD_SIZE": "4", "LOCAL_RANK": "3"}) == (torch.device("cuda", 3),) * 2
