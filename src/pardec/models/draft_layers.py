"""Pieces the hidden-state drafters share (EAGLE-3's :mod:`pardec.models.eagle`, DFlash's :mod:`pardec.models.dflash`):
a SwiGLU MLP with Llama/Qwen3 names, the saved-config helper and the attention projections (the rotary embedding
they share with the target's forward: :mod:`pardec.models.rotary`). Nothing here knows a drafter."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def call(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``: the drafters' default ``lin`` (through the module's ``__call__``, so its hooks run:
    DeepSpeed ZeRO-3 gathers a module's partitioned weights in one)."""
    return module(x)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, no biases (Llama / Qwen3 MLP; module names as theirs)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lin=call) -> torch.Tensor:
        """``lin(module, x)``: how each linear is applied (a compiled graph passes its own)."""
        return lin(self.down_proj, F.silu(lin(self.gate_proj, x)) * lin(self.up_proj, x))


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
