"""Drafters trained on the target itself, which draft K future tokens from one target forward:

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
  low/mid/high target features and the token embedding, with a reduced draft vocabulary (``heads.type: eagle3``).
* :class:`~pardec.models.dflash.DFlashDraft` (DFlash, Chen et al. 2026): a few target-width layers that fill a block
  of mask slots in one forward from the fused features of several target layers (``heads.type: dflash``).

All save to a directory: ``drafter.json`` (kind, the base model's name and shape, K, layers, training facts) and
``drafter.safetensors``. :func:`load_drafter` checks the shape against the target (hidden size, vocabulary,
layer count) and raises one line naming both when they differ.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pardec.config import ConfigError
from pardec.jsonl import read_versioned
from pardec.models.drafter_types import TargetParts, drafter_class, only, register_drafter
from pardec.models.pseudo import PSEUDO_ATTENTION

FORMAT = "pardec-drafter"
VERSION = 1


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
            raise ConfigError(f"heads.head_rank={head_rank} is out of range: it must be an integer in 1.."
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
        hidden, vocab, _ = _shape(base_config)
        head = target.lm_head.weight if target.lm_head is not None else None
        heads = cls(hidden, vocab, o.get("num_heads", 3), o.get("num_blocks", 1), o.get("head_rank"), head)
        return heads.init_from(target.lm_head) if target.lm_head is not None else heads

    @classmethod
    def from_heads(cls, base_config, heads: dict[str, Any], target: TargetParts | None = None) -> MedusaHeads:
        """From a ``heads`` config section (``target``: the target's parts it starts from; none: a memory plan's
        meta-device build)."""
        return cls.fresh(base_config, target or TargetParts(), {"num_heads": heads.get("num_heads", 3),
                                                      "num_blocks": heads.get("num_blocks", 1),
                                                      "head_rank": heads.get("head_rank")})

    @classmethod
    def from_saved(cls, meta: dict[str, Any], state: dict, base_config) -> MedusaHeads:
        """Full heads: a low-rank-trained drafter is saved merged (its ``head_rank`` is a training fact)."""
        hidden, vocab, _ = _shape(base_config)
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
        return p(hidden.to(p.weight.device, p.weight.dtype))  # a split target hands states from any of its devices

    def meta(self) -> dict[str, Any]:
        return {"layers": self.layers, "attention": self.attention}

    @classmethod
    def fresh(cls, base_config, target: TargetParts, options: dict[str, Any]) -> FirpProjections:
        """Identity projections reading the states entering ``layers`` (checked against the target's layers)."""
        o = only(options, cls.kind, ("layers", "attention"))
        hidden, vocab, n_layers = _shape(base_config)
        layers = list(o.get("layers") or [])
        bad = [x for x in layers if not 0 <= x < n_layers]
        if bad:
            raise ConfigError(f"firp layers={layers} is out of range: the model has layers 0..{n_layers - 1}")
        return cls(hidden, vocab, layers, o.get("attention", "real"))

    @classmethod
    def from_heads(cls, base_config, heads: dict[str, Any], target: TargetParts | None = None) -> FirpProjections:
        """From a ``heads`` config section (``target``: the target's parts it starts from; none: a memory plan's
        meta-device build)."""
        return cls.fresh(base_config, target or TargetParts(), {"layers": heads.get("layers"),
                                                      "attention": heads.get("attention", "real")})

    @classmethod
    def from_saved(cls, meta: dict[str, Any], state: dict, base_config) -> FirpProjections:
        # drafters saved before the attention key existed were trained with pseudo attention
        return cls.fresh(base_config, TargetParts(), {"layers": list(meta["layers"]),
                                                      "attention": meta.get("attention", "pseudo")})


Drafter = nn.Module  # any registered drafter model (pardec.models.drafter_types)


def new_drafter(kind: str, base_config, *, lm_head: nn.Linear | None = None, embed: nn.Embedding | None = None,
                **options: Any) -> Drafter:
    """A fresh drafter of type ``kind`` (:mod:`pardec.models.drafter_types`) for a model with config
    ``base_config``; ``lm_head``, ``embed``: the target's, which some types start from (Medusa's heads and EAGLE-3's
    head its LM head, DFlash's mask embedding its mean embedding row); ``options``: the type's own (Medusa
    ``num_heads``, ``num_blocks``; FIRP ``layers``, ``attention``; EAGLE-3 ``layers``, ``vocab``; DFlash ``layers``
    and ``dflash``: :meth:`DFlashConfig.for_target` options)."""
    return drafter_class(kind).fresh(base_config, TargetParts(lm_head=lm_head, embed=embed), options)


def num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def save_drafter(drafter: Drafter, out_dir: str | Path, base_config, base_name: str,
                 extra: dict[str, Any] | None = None) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden, vocab, n_layers = _shape(base_config)
    meta = {"format": FORMAT, "version": VERSION, "kind": drafter.kind, "base_model": base_name,
            "hidden_size": hidden, "vocab_size": vocab, "num_hidden_layers": n_layers, "k": drafter.k,
            **drafter.meta(), "parameters": num_parameters(drafter), **(extra or {})}
    saved = getattr(drafter, "saved_state", drafter.state_dict)()  # a type may save a merged form
    state = {k: v.detach().contiguous().cpu() for k, v in saved.items()}
    save_file(state, str(out / "drafter.safetensors"))
    (out / "drafter.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def read_meta(path: str | Path, key: str = "method.path") -> dict[str, Any]:
    """``drafter.json`` of a drafter directory; one-line errors for a missing or foreign directory."""
    f = Path(path) / "drafter.json"
    if not f.is_file():
        raise ConfigError(f"{key}={str(path)!r} holds no trained drafter (no drafter.json); train one with "
                          f"python -m train +experiment=heads_medusa_smollm2 (or heads_firp_smollm2)")
    return read_versioned(f, FORMAT, VERSION, ConfigError, key)


def load_drafter(path: str | Path, base_config, kind: str, key: str = "method.path") -> tuple[Drafter, dict]:
    """Load a saved drafter for a target with config ``base_config``; every mismatch is one line naming both."""
    meta = read_meta(path, key)
    if meta.get("kind") != kind:
        raise ConfigError(f"{key}={str(path)!r} holds {meta.get('kind')!r} weights; this method needs {kind!r}")
    hidden, vocab, n_layers = _shape(base_config)
    for name, want in (("hidden_size", hidden), ("vocab_size", vocab), ("num_hidden_layers", n_layers)):
        if meta.get(name) != want:
            raise ConfigError(
                f"{key}={str(path)!r} was trained for another model ({meta.get('base_model')!r}: {name} "
                f"{meta.get(name)}); the target has {name} {want}")
    state = load_file(str(Path(path) / "drafter.safetensors"))
    drafter: Drafter = drafter_class(kind).from_saved(meta, state, base_config)
    drafter.load_state_dict(state)
    return drafter.eval(), meta


def _shape(cfg) -> tuple[int, int, int]:
    return int(cfg.hidden_size), int(cfg.vocab_size), int(cfg.num_hidden_layers)
