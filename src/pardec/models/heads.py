"""Medusa's heads and FIRP's projections: drafters trained on the target itself, which draft K future tokens from one
target forward (the other drafter types of that kind live beside them, registered the same way):

* :class:`MedusaHeads` (Medusa-1, Cai et al. 2024): K heads on the last hidden state (after the final norm); head
  ``k`` (1-based) = ``ResBlock^n`` then its own ``Linear(H, V)``, and predicts the token ``k + 1`` positions after
  the one the hidden state belongs to (the target's own LM head predicts the next one). ``ResBlock(x) = x +
  SiLU(Wx + b)`` with ``W, b`` zero-initialised and each head's linear copied from the target's LM head, so an
  untrained head starts as the target's next-token head (Medusa's initialisation). ``head_rank=r`` (beyond the
  paper) trains each head's linear as the target's LM head plus a rank-``r`` update (:class:`LowRankHead`); it is
  saved merged, so decoders read it as any Medusa drafter, and its difference from the target's head is exactly of
  rank ``r`` (what the zoo stores).
* :class:`FirpProjections` (FIRP, Wu et al. 2024): K linear maps ``h -> W_i h + b_i``; map ``i`` (1-based) turns
  the hidden state of the last real token ``j`` entering layer ``t_i`` into the pseudo hidden state of position
  ``j + i``, which then runs through layers ``t_i..L-1``, the final norm and the target's own LM head
  (:meth:`pardec.models.cached.CachedModel.forward_pseudo`). Initialised as the identity (``W = I, b = 0``).
  ``attention`` records what the pseudo states saw in training: ``real`` (FIRP §3.3: real states and themselves;
  the default) or ``pseudo`` (also the anchor's earlier pseudo states; drafters saved before the key existed were
  trained so, and load as ``pseudo``).

* :class:`~pardec.models.eagle.Eagle3Draft` (EAGLE-3, Li et al. 2025): one decoder layer over the fused
  low/mid/high target features and the token embedding, with a reduced draft vocabulary (``drafter.type: eagle3``).
* :class:`~pardec.models.dflash.DFlashDraft` (DFlash, Chen et al. 2026): a few target-width layers that fill a block
  of mask slots in one forward from the fused features of several target layers (``drafter.type: dflash``).

Every drafter type saves and loads through :mod:`pardec.models.drafters` (``drafter.json`` + ``drafter.safetensors``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pardec.config import ConfigError
from pardec.models.drafter_types import TargetParts, only, register_drafter
from pardec.models.drafters import base_shape
from pardec.models.pseudo import PSEUDO_ATTENTION


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class LowRankHead(nn.Module):
    """A Medusa head's linear trained as ``base + lora_b @ lora_a`` (LoRA's parametrisation: ``lora_a`` random,
    ``lora_b`` zero, so training starts from the target's head): ``base`` is the target's LM head, shared and not
    trained (a buffer, not saved); :attr:`weight` is the merged matrix a saved drafter holds."""

    def __init__(self, base: torch.Tensor, rank: int):
        super().__init__()
        vocab, hidden = base.shape
        self.register_buffer("base", base, persistent=False)
        self.lora_a = nn.Parameter(torch.empty(rank, hidden, device=base.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = nn.Parameter(torch.zeros(vocab, rank, device=base.device))

    @property
    def weight(self) -> torch.Tensor:
        return self.base + self.lora_b @ self.lora_a

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.base.to(x.dtype)) + nn.functional.linear(
            nn.functional.linear(x, self.lora_a), self.lora_b)


@register_drafter("medusa")
class MedusaHeads(nn.Module):
    kind = "medusa"

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int, num_blocks: int = 1,
                 head_rank: int | None = None, lm_head: torch.Tensor | None = None):
        """``head_rank``: each head's linear a :class:`LowRankHead` over ``lm_head`` (the target's LM-head weight;
        zeros where none is given, as a memory plan's meta build); None: a full ``Linear(H, V)`` (Medusa-1)."""
        super().__init__()
        if num_heads < 1:
            raise ConfigError(f"medusa num_heads={num_heads} is out of range: it must be an integer >= 1")
        if head_rank is not None and not 1 <= head_rank <= min(hidden_size, vocab_size):
            raise ConfigError(f"drafter.head_rank={head_rank} is out of range: it must be an integer in 1.."
                              f"{min(hidden_size, vocab_size)} (or null: a full head, as Medusa-1)")
        self.hidden_size, self.vocab_size, self.num_heads, self.num_blocks = hidden_size, vocab_size, num_heads, num_blocks
        self.head_rank = head_rank
        if head_rank is not None:
            base = (lm_head.detach() if lm_head is not None else torch.zeros(vocab_size, hidden_size))

            def last() -> nn.Module:
                return LowRankHead(base, head_rank)
        else:
            def last() -> nn.Module:
                return nn.Linear(hidden_size, vocab_size, bias=False)
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_blocks)], last()) for _ in range(num_heads))

    @property
    def k(self) -> int:
        return self.num_heads

    def init_from(self, lm_head: nn.Linear) -> MedusaHeads:
        with torch.no_grad():
            for head in self.heads:
                if isinstance(head[-1], nn.Linear):  # (a LowRankHead starts at its base, the target's head)
                    head[-1].weight.copy_(lm_head.weight)
        return self

    def saved_state(self) -> dict[str, torch.Tensor]:
        """What :func:`save_drafter` writes: the state dict, each low-rank head merged into its ``weight``."""
        state = {k: v for k, v in self.state_dict().items() if ".lora_" not in k}
        for i, head in enumerate(self.heads):
            if isinstance(head[-1], LowRankHead):
                state[f"heads.{i}.{len(head) - 1}.weight"] = head[-1].weight.detach()
        return state

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] final-norm hidden states -> [..., K, V] logits (head k: the token k + 1 positions ahead)."""
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def meta(self) -> dict[str, Any]:
        return {"num_heads": self.num_heads, "num_blocks": self.num_blocks,
                **({"head_rank": self.head_rank} if self.head_rank is not None else {})}

    @classmethod
    def fresh(cls, base_config, target: TargetParts, options: dict[str, Any]) -> MedusaHeads:
        """Each head's linear starts as the target's LM head (when given): Medusa's initialisation."""
        o = only(options, cls.kind, ("num_heads", "num_blocks", "head_rank"))
        hidden, vocab, _ = base_shape(base_config)
        head = target.lm_head.weight if target.lm_head is not None else None
        heads = cls(hidden, vocab, o.get("num_heads", 3), o.get("num_blocks", 1), o.get("head_rank"), head)
        return heads.init_from(target.lm_head) if target.lm_head is not None else heads

    @classmethod
    def from_section(cls, base_config, options: dict[str, Any], target: TargetParts | None = None) -> MedusaHeads:
        """From a ``drafter`` config section (``target``: the target's parts it starts from; none: a memory plan's
        meta-device build)."""
        return cls.fresh(base_config, target or TargetParts(), {"num_heads": options.get("num_heads", 3),
                                                      "num_blocks": options.get("num_blocks", 1),
                                                      "head_rank": options.get("head_rank")})

    @classmethod
    def from_saved(cls, meta: dict[str, Any], state: dict, base_config) -> MedusaHeads:
        """Full heads: a low-rank-trained drafter is saved merged (its ``head_rank`` is a training fact)."""
        hidden, vocab, _ = base_shape(base_config)
        return cls(hidden, vocab, int(meta["num_heads"]), int(meta.get("num_blocks", 1)))


@register_drafter("firp")
class FirpProjections(nn.Module):
    kind = "firp"

    def __init__(self, hidden_size: int, vocab_size: int, layers: list[int], attention: str = "real"):
        super().__init__()
        if attention not in PSEUDO_ATTENTION:
            raise ConfigError(f"firp attention={attention!r} is not valid; choose one of: "
                              f"{', '.join(PSEUDO_ATTENTION)}")
        self.attention = attention
        if len(layers) < 1:
            raise ConfigError(f"firp layers={layers} is not valid: K = len(layers) must be >= 1")
        if list(layers) != sorted(layers):
            raise ConfigError(f"firp layers={layers} is not valid: the layers must be nondecreasing")
        self.hidden_size, self.vocab_size, self.layers = hidden_size, vocab_size, [int(x) for x in layers]
        self.proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in layers)
        with torch.no_grad():
            for p in self.proj:
                p.weight.copy_(torch.eye(hidden_size))
                p.bias.zero_()

    @property
    def k(self) -> int:
        return len(self.layers)

    def forward(self, i: int, hidden: torch.Tensor) -> torch.Tensor:
        """Projection ``i`` (0-based: the pseudo state ``i + 1`` positions ahead of its anchor)."""
        p = self.proj[i]
        return p(hidden.to(p.bias.device, p.bias.dtype))  # a split target hands states from any of its devices (the
        # bias: a float tensor also when the linear is int8, pardec.models.drafters.place)

    def meta(self) -> dict[str, Any]:
        return {"layers": self.layers, "attention": self.attention}

    @classmethod
    def fresh(cls, base_config, target: TargetParts, options: dict[str, Any]) -> FirpProjections:
        """Identity projections reading the states entering ``layers`` (checked against the target's layers)."""
        o = only(options, cls.kind, ("layers", "attention"))
        hidden, vocab, n_layers = base_shape(base_config)
        layers = list(o.get("layers") or [])
        bad = [x for x in layers if not 0 <= x < n_layers]
        if bad:
            raise ConfigError(f"firp layers={layers} is out of range: the model has layers 0..{n_layers - 1}")
        return cls(hidden, vocab, layers, o.get("attention", "real"))

    @classmethod
    def from_section(cls, base_config, options: dict[str, Any], target: TargetParts | None = None) -> FirpProjections:
        """From a ``drafter`` config section (``target``: the target's parts it starts from; none: a memory plan's
        meta-device build)."""
        return cls.fresh(base_config, target or TargetParts(), {"layers": options.get("layers"),
                                                      "attention": options.get("attention", "real")})

    @classmethod
    def from_saved(cls, meta: dict[str, Any], state: dict, base_config) -> FirpProjections:
        # drafters saved before the attention key existed were trained with pseudo attention
        return cls.fresh(base_config, TargetParts(), {"layers": list(meta["layers"]),
                                                      "attention": meta.get("attention", "pseudo")})
