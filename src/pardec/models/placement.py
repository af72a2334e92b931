"""Where a model goes: ``model.device`` resolved (``auto``; under a launcher of several processes, this rank's GPU
or group of GPUs), ``from_pretrained``'s placement arguments for ``model.device_map``, and TF32."""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from pardec.config import ConfigError, ModelConfig


def resolve_device(device: str, env: Mapping[str, str] | None = None, split: bool = False,
                   key: str = "model.device") -> torch.device:
    """``model.device`` as a torch device: ``auto`` is CUDA when available, else the CPU. Under a launcher of several
    processes (``WORLD_SIZE`` > 1 in ``env``, default the environment: torchrun, accelerate launch, deepspeed)
    ``auto`` and ``cuda`` mean this process's GPU: :func:`rank_gpu`, or with ``split`` (this run's target is spread
    over the rank's group of GPUs with ``model.device_map``) the first GPU of that group, :func:`rank_gpus`, so that
    the ranks do not all load onto GPU 0 nor into each other's groups; ``cuda:<i>`` and ``cpu`` are kept as
    written. (With ``model.device_map`` the weights are placed by accelerate, not moved to this one device.)"""
    env = os.environ if env is None else env
    cuda = torch.cuda.is_available()
    if device == "cuda" and not cuda:
        raise ConfigError(f"{key}=cuda but no CUDA device is usable here (torch.cuda.is_available() is false); "
                          f"use {key}=auto or cpu")
    if device in ("auto", "cuda") and cuda and int(env.get("WORLD_SIZE", 1)) > 1:
        group = rank_gpus(env) if split else None
        return torch.device("cuda", group[0] if group else rank_gpu(env))
    if device == "auto":
        return torch.device("cuda" if cuda else "cpu")
    return torch.device(device)


def rank_devices(target: ModelConfig, draft: ModelConfig | None,
                 env: Mapping[str, str] | None = None) -> tuple[torch.device, torch.device | None]:
    """Where this rank's target (its first GPU when ``model.device_map`` splits it) and draft go, resolved before
    any weights load. Under several processes a split target's rank owns a disjoint group of the node's GPUs
    (:func:`rank_gpus`; an uneven split is an error) and its draft lives on that group's first GPU, not on
    ``cuda:LOCAL_RANK``, which may be inside another rank's group."""
    split = bool(target.device_map)
    return (resolve_device(target.device, env, split),
            resolve_device(draft.device, env, split, "draft.device") if draft is not None else None)


def rank_gpu(env: Mapping[str, str]) -> int:
    """The GPU of this rank: ``LOCAL_RANK``, or 0 where the launcher shows each process one GPU of its own
    (``CUDA_VISIBLE_DEVICES`` per rank); a ``LOCAL_RANK`` beyond the visible GPUs is an error naming both."""
    local, n = int(env.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if n == 1:
        return 0
    if local >= n:
        raise RuntimeError(f"LOCAL_RANK={local} but this node shows {n} GPUs: launch at most {n} processes per node "
                           f"(torchrun --nproc_per_node {n}) or set model.device=cuda:<i>")
    return local


def rank_gpus(env: Mapping[str, str] | None = None) -> list[int] | None:
    """The GPUs this process may spread a model over with ``model.device_map`` when a launcher runs several processes
    on the node (``LOCAL_WORLD_SIZE``, else ``WORLD_SIZE``, > 1): the node's visible GPUs split into equal contiguous
    groups, group ``LOCAL_RANK``. None under one process (every visible GPU). Where each process is shown fewer GPUs
    than there are processes (``CUDA_VISIBLE_DEVICES`` per rank) it keeps all it sees; a split that is not even is an
    error naming both counts."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", 1)))
    if local_world <= 1:
        return None
    n, local = torch.cuda.device_count(), int(env.get("LOCAL_RANK", 0))
    if n < local_world:
        return list(range(n))
    if n % local_world:
        raise ConfigError(f"model.device_map under {local_world} processes per node: {n} visible GPUs do not split "
                          f"evenly among them; launch a number of processes that divides {n}, or show each its own "
                          f"GPUs with CUDA_VISIBLE_DEVICES")
    k = n // local_world
    return list(range(local * k, (local + 1) * k))


def placement(cfg: ModelConfig, env: Mapping[str, str] | None = None) -> dict:
    """``from_pretrained``'s placement arguments for ``model.device_map``: the map, and under several processes per
    node a ``max_memory`` naming only this rank's GPUs (:func:`rank_gpus`), so that the ranks' models do not all
    spread over every GPU. Empty without ``device_map``."""
    if not cfg.device_map:
        return {}
    out: dict = {"device_map": cfg.device_map}
    gpus = rank_gpus(env)
    if gpus:  # (none visible, e.g. CPU ranks: no max_memory, which would send every weight to disk)
        out["max_memory"] = {g: torch.cuda.mem_get_info(g)[0] for g in gpus}  # free memory, as accelerate's default
    return out


def set_tf32(enabled: bool) -> None:
    """Let fp32 matmuls and convolutions on Ampere+ GPUs run in TF32 (the ``tf32`` config key, default on): ~10-bit
    mantissa products with fp32 accumulation, several times faster. No effect on the CPU or on bf16/fp16 runs."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled
