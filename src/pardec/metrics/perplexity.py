"""Perplexity of a completion under a scoring model (the quality measure for lossy methods)."""

from __future__ import annotations

import math

import torch


@torch.inference_mode()
def completion_nll(model: torch.nn.Module, prompt_ids: list[int], completion_ids: list[int]) -> tuple[float, int]:
    """(summed NLL in nats, token count) of ``completion_ids`` given ``prompt_ids`` in one plain forward."""
    if not completion_ids:
        return 0.0, 0
    dev = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + completion_ids], device=dev)
    logits = model(input_ids=ids, use_cache=False).logits[0, len(prompt_ids) - 1 : -1].float()  # [C, V]
    target = torch.tensor(completion_ids, device=dev)
    nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
    return float(nll), len(completion_ids)


def perplexity(nll_sum: float, n_tokens: int) -> float | None:
    return math.exp(nll_sum / n_tokens) if n_tokens else None
