"""``drafter.type: medusa``: Medusa-1's heads (Cai et al. 2024; the model: :class:`pardec.models.heads.MedusaHeads`),
self-distilled on the target's completions: head ``k`` (0-based) learns the target's distribution ``k + 2``
positions ahead, weighted ``head_decay ** k`` (Medusa's ``medusa_decay_coefficient``: 0.8), each head's linear
started from the target's LM head."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pardec.config import check_at_least, check_range
from pardec.models.drafter_types import TargetParts
from pardec.models.heads import MedusaHeads
from pardec.training.drafter.types import DrafterType, register_drafter_type


@dataclass
class MedusaOptions:
    num_heads: int = field(default=3, metadata={"help": "heads, head k (0-based) predicting the token k + 2 ahead"})
    num_blocks: int = field(default=1, metadata={"help": "residual blocks per head (Medusa-1: 1)"})
    head_decay: float = field(default=0.8, metadata={"help": "head k's loss weighs head_decay ** k (Medusa's "
                                                             "medusa_decay_coefficient)"})
    head_rank: int | None = field(default=None, metadata={"help": "null: each head's linear a full copy of the "
                                                                  "target's LM head (Medusa-1); r: the target's head "
                                                                  "plus a trained rank-r update, saved merged"})

    def __post_init__(self) -> None:
        check_at_least("drafter.num_heads", self.num_heads, 1, integer=True)
        check_at_least("drafter.num_blocks", self.num_blocks, 1, integer=True)
        check_range("drafter.head_decay", self.head_decay, 0, 1, integer=False, open_lo=True)
        if self.head_rank is not None:
            check_at_least("drafter.head_rank", self.head_rank, 1, integer=True)


@register_drafter_type
class MedusaType(DrafterType):
    name = "medusa"
    options = MedusaOptions

    def new(self, spec, base, lm, records: list[dict]) -> tuple[Any, dict]:
        return MedusaHeads.from_section(base.config, spec.drafter, TargetParts(lm_head=base.lm_head)), {}

    def facts(self, options: dict, head_decay: float) -> dict[str, Any]:
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
