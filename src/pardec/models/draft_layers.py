"""Pieces the hidden-state drafters share (EAGLE-3's :mod:`pardec.models.eagle`, DFlash's :mod:`pardec.models.dflash`):
the rotary rotation, the target's rotary settings, a SwiGLU MLP with Llama/Qwen3 names and a scaled-dot-product
attention over prepended keys/values. Nothing here knows a drafter; the lean forward uses the same rotation."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

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


class SavedConfig:
    """A draft's dataclass config as drafter.json keeps it: ``to_dict``, and ``from_dict`` reading the fields it knows
    (a key written by a later pardec is ignored)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})


def add_projections(attn: nn.Module, in_size: int, c) -> None:
    """The q/k/v/o projections (no bias) of an attention over ``in_size`` input features with ``c``'s heads,
    key/value heads and head size, as ``attn.q_proj`` .. ``attn.o_proj`` (and ``heads``, ``kv_heads``,
    ``head_dim``)."""
    attn.heads, attn.kv_heads, attn.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    attn.q_proj = nn.Linear(in_size, c.num_attention_heads * c.head_dim, bias=False)
    attn.k_proj = nn.Linear(in_size, c.num_key_value_heads * c.head_dim, bias=False)
    attn.v_proj = nn.Linear(in_size, c.num_key_value_heads * c.head_dim, bias=False)
    attn.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
