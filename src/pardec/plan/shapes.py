"""The plan's units and records (Arch, Plan) and the model shapes it counts on the meta device."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pardec.config import ConfigError, ModelConfig, to_dataclass
from pardec.recipes import (
    shipped_config,
)

GB = 1e9
CAPACITIES_GB = (40, 80, 141)
OVERHEAD = 0.10
DEFAULT_WORLD = 8  # training ranks when a recipe documents no `--nproc_per_node N`
MAX_GPUS = 8  # the most GPUs a device_map split is tried over for the fits columns
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1}
CONTEXT_MARGIN = 64  # tokens of draft window / verification rows on top of prompt + max_new_tokens
#: longest prompt of each task in tokens (an estimate from the task's prompt, conservative; --prompt-tokens overrides)
PROMPT_TOKENS = {"humaneval": 600, "wmt16": 256, "mt_bench": 512, "spider": 1024, "sharegpt": 1024,
                 "code_search_net": 256, "python_docstrings": 256}
COMPONENTS = ("weights", "grads", "optimizer", "gathered", "frozen", "activations", "logits", "kv", "overhead")


@dataclass
class Arch:
    """A model's shape, counted on its meta-device build."""

    hub_id: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated: bool = True  # a gated (SwiGLU) MLP: gate and up projections

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """K and V of every layer for one token."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass
class Plan:
    """One recipe's per-GPU memory (``components`` in bytes)."""

    recipe: str
    kind: str  # cllm | draft | drafter | sdsat (training) | eval
    world: int  # training ranks; evaluation: GPUs the target is split over
    zero: int | None  # ZeRO stage (0 = plain DDP); None for evaluation
    model: str
    params: int  # the target's parameter count
    trainable: int
    components: dict[str, float]
    notes: list[str] = field(default_factory=list)
    gpus_needed: dict[int, int | None] = field(default_factory=dict)  # device_map splits: GPUs per capacity

    @property
    def total(self) -> float:
        return sum(self.components.values())

    def fits(self, capacity_gb: float) -> bool:
        return self.total <= capacity_gb * GB

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["components_gb"] = {k: round(v / GB, 3) for k, v in out.pop("components").items()}
        out["total_gb"] = round(self.total / GB, 3)
        out["fits"] = {str(c): self.fits(c) for c in CAPACITIES_GB}
        out["gpus_needed"] = {str(c): n for c, n in self.gpus_needed.items()}
        return out


# ------------------------------------------------------------------------------------------- architectures
#: architectures of models built in code (``source: tiny_random``), by the key :func:`in_memory` gives them
_IN_MEMORY: dict[str, Any] = {}


def in_memory(model: dict[str, Any]) -> str:
    """The key the plan's shape functions (:func:`arch`, :func:`draft_params`, ...) take for a model built in code
    (a ``model`` section of ``source: tiny_random``: the size a plan is measured at on the CPU)."""
    from pardec.models.loading import load_tokenizer_only, tiny_random_config  # heavy: torch, transformers

    cfg = to_dataclass(ModelConfig, model, "model")
    config = tiny_random_config(cfg, len(load_tokenizer_only(cfg)))
    key = f"{cfg.name}:{hashlib.sha256(config.to_json_string().encode()).hexdigest()[:12]}"
    _IN_MEMORY[key] = config
    return key


@functools.cache
def _meta_model(hub_id: str):
    import torch  # heavy: torch
    from transformers import AutoConfig, AutoModelForCausalLM  # heavy: transformers

    if hub_id in _IN_MEMORY:
        cfg = _IN_MEMORY[hub_id]
    else:
        path = shipped_config(hub_id)
        if not path.is_file():
            raise ConfigError(f"no config.json for {hub_id!r}: add the hub's config.json as {path}")
        cfg = AutoConfig.from_pretrained(str(path.parent))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def arch(hub_id: str) -> Arch:
    model = _meta_model(hub_id)
    c = model.config
    heads = c.num_attention_heads
    return Arch(hub_id=hub_id, params=sum(p.numel() for p in model.parameters()), layers=c.num_hidden_layers,
                hidden=c.hidden_size, heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                intermediate=c.intermediate_size, vocab=c.vocab_size,
                gated=any(n.endswith("mlp.gate_proj.weight") for n, _ in model.named_parameters()))


def lora_params(hub_id: str, r: int, targets: Sequence[str]) -> int:
    """LoRA adapter parameters: ``r x (in + out)`` for every Linear whose name ends in a target module."""
    from torch import nn  # heavy: torch

    return sum(r * (m.in_features + m.out_features) for n, m in _meta_model(hub_id).named_modules()
               if isinstance(m, nn.Linear) and n.split(".")[-1] in set(targets))


def draft_params(hub_id: str, layers: int, vocab_size: int, freeze_embeddings: bool) -> tuple[int, int]:
    """(all, trainable) parameters of kind draft's student: ``layers`` of the target's decoder layers, its embeddings
    and a head over ``vocab_size`` kept ids (:class:`pardec.models.draft.DraftForCausalLM`, built on the meta device)."""
    import torch  # heavy: torch

    from pardec.models.draft import DraftConfig, DraftForCausalLM  # heavy: torch, transformers

    t = _meta_model(hub_id).config.to_dict()
    for k in ("model_type", "architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        t.pop(k, None)
    t["num_hidden_layers"] = layers
    with torch.device("meta"):
        student = DraftForCausalLM(DraftConfig(**t, draft_vocab=list(range(vocab_size))))
    total = sum(p.numel() for p in student.parameters())
    frozen = student.model.embed_tokens.weight.numel() if freeze_embeddings else 0
    return total, total - frozen


def drafter_params(hub_id: str, options: dict[str, Any]) -> int:
    """The parameters of the drafter a ``drafter`` section describes (its type's ``from_section``,
    :mod:`pardec.models.drafter_types`, built on the meta device)."""
    import torch  # heavy: torch

    from pardec.models.drafter_types import drafter_class  # heavy: torch, transformers

    cfg = _meta_model(hub_id).config
    with torch.device("meta"):
        d = drafter_class(options["type"]).from_section(cfg, options)
    return sum(p.numel() for p in d.parameters())
