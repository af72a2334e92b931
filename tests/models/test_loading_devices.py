"""pardec.models.loading.resolve_device: each rank of a multi-process launch on its own GPU (CUDA faked)."""

from __future__ import annotations

import pytest
import torch

from pardec.models.loading import resolve_device


def _gpus(monkeypatch, n: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: n)


def test_one_process_resolves_as_it_always_did(monkeypatch):
    _gpus(monkeypatch, 0)
    assert resolve_device("auto", {}) == torch.device("cpu")
    assert resolve_device("auto", {"WORLD_SIZE": "4", "LOCAL_RANK": "3"}) == torch.device("cpu")  # no CUDA: CPU ranks
    with pytest.raises(RuntimeError, match="no CUDA device"):
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
