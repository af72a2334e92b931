"""Rotary position embeddings as the Llama / Qwen families apply them: the half-split rotation, and a transformers
config's rotary settings (theta and scaling). The target's lean forward and the hidden-state drafters (EAGLE-3,
DFlash) both rotate with these."""

from __future__ import annotations

import torch


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
