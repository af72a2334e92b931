"""Shared by the CLLM tests: the Jacobi collection over a list of prompts, results in order (the collection streams
them: :func:`pardec.training.cllm.collect.jacobi_stream`)."""

from __future__ import annotations

import torch

from pardec.models.cached import CachedModel
from pardec.training.cllm.collect import jacobi_stream


def jacobi_trajectories(
    cm: CachedModel,
    prompts: list[list[int]],
    block_size: int,
    max_new_tokens: int,
    eos_ids: set[int],
    generators: list[torch.Generator],
    max_iters: int | None = None,
    batch_size: int | None = None,
    guess_from: str = "context",
) -> list[dict]:
    """:func:`jacobi_stream` over a list of prompts (all in one batch unless ``batch_size``), results in order."""
    if min((len(p) for p in prompts), default=1) < 1:
        raise ValueError("empty prompt")
    out: list[dict] = [{}] * len(prompts)
    for i, r in jacobi_stream(cm, zip(range(len(prompts)), prompts, generators), batch_size or len(prompts),
                              block_size, max_new_tokens, eos_ids, max_iters, guess_from):
        out[i] = r
    return out
