"""``heads.type: medusa``: Medusa-1's heads (Cai et al. 2024; the model: :class:`pardec.models.heads.MedusaHeads`),
self-distilled on the target's completions: head ``k`` (0-based) learns the target's distribution ``k + 2``
positions ahead, weighted ``head_decay ** k`` (Medusa's ``medusa_decay_coefficient``: 0.8), each head's linear
started from the target's LM head."""

from __future__ import annotations

from typing import Any

import torch

from pardec.config import check_at_least, check_range
from pardec.models.drafter_types import TargetParts
from pardec.models.heads import MedusaHeads
from pardec.training.heads.types import HeadsType, register_heads_type


@register_heads_type
class MedusaType(HeadsType):
    name = "medusa"
    keys = ("num_heads", "num_blocks", "head_decay")

    def check(self, heads: dict) -> None:
        for key, default in (("num_heads", 3), ("num_blocks", 1)):
            check_at_least(f"heads.{key}", heads.setdefault(key, default), 1, integer=True)
        check_range("heads.head_decay", heads.setdefault("head_decay", 0.8), 0, 1, integer=False, open_lo=True)
        heads["head_decay"] = float(heads["head_decay"])

    def new(self, spec, base, lm, records: list[dict]) -> tuple[Any, dict]:
        return MedusaHeads.from_heads(base.config, spec.heads, TargetParts(lm_head=base.lm_head)), {}

    def facts(self, heads: dict, head_decay: float) -> dict[str, Any]:
        return {"head_decay": head_decay}

    def depth_weights(self, k: int, head_decay: float) -> list[float]:
        return [head_decay**d for d in range(k)]

    def depth_logits(self, base, call, drafter, ids, anchors, *, training: bool, attention: str | None = None,
                     checkpoint: bool = False):
        """The heads sit on the target's last hidden state (after the final norm), computed without gradients:
        nothing to checkpoint."""
        with torch.no_grad():
            hidden = base.model(input_ids=ids).last_hidden_state[:, anchors]
            teacher = base.lm_head(hidden)
        return teacher, call(hidden.to(next(drafter.parameters()).dtype))
