"""Pieces the hidden-state drafters share (EAGLE-3's :mod:`pardec.models.eagle`, DFlash's :mod:`pardec.models.dflash`):
the rotary rotation, the target's rotary settings, a SwiGLU MLP with Llama/Qwen3 names and a scaled-dot-product
attention over prepended keys/values. Nothing here knows a drafter; the lean forward uses the same rotation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding applied to ``x`` [.., D] with tables ``cos``/``sin`` (broadcast): the half-split
    rotation of Llama/Qwen (``rotate_half``)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def rope_settings(config) -> tuple[float, dict | None]:
    """(rope_theta, scaling part or None) of a transformers config (``rope_parameters`` on transformers 5, the
    older ``rope_theta`` / ``rope_scaling`` fields otherwise)."""
    rope = getattr(config, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    return theta, rope_scaling(rope or getattr(config, "rope_scaling", None) or {})


def rope_scaling(rope: dict) -> dict | None:
    """A ``rope_parameters`` dict's scaling part (None when plain rotary)."""
    if not rope or rope.get("rope_type", "default") == "default":
        return None
    return {k: v for k, v in rope.items() if k != "rope_theta"}


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases (Llama / Qwen3 MLP; module names as theirs)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
