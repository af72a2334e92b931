"""Trained drafters on disk, whatever their type: a fresh one (:func:`new_drafter`), :func:`save_drafter` to a
directory (``drafter.json``: kind, the base model's name and shape, K, the type's own facts, training facts; and
``drafter.safetensors``), :func:`read_meta` and :func:`load_drafter`, which checks the shape against the target (hidden
size, vocabulary, layer count) and raises one line naming both when they differ. Each looks the type up in
:mod:`pardec.models.drafter_types` and names none."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from pardec.config import INT8_WEIGHTS, ConfigError, check_choice
from pardec.jsonl import read_versioned
from pardec.models.drafter_types import TargetParts, drafter_class
from pardec.models.quant.int8 import is_int8, quantize

FORMAT = "pardec-drafter"
VERSION = 1


def base_shape(cfg) -> tuple[int, int, int]:
    """(hidden size, vocabulary, layers) of a target's config: what a drafter is made for."""
    return int(cfg.hidden_size), int(cfg.vocab_size), int(cfg.num_hidden_layers)


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
    hidden, vocab, n_layers = base_shape(base_config)
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
    hidden, vocab, n_layers = base_shape(base_config)
    for name, want in (("hidden_size", hidden), ("vocab_size", vocab), ("num_hidden_layers", n_layers)):
        if meta.get(name) != want:
            raise ConfigError(
                f"{key}={str(path)!r} was trained for another model ({meta.get('base_model')!r}: {name} "
                f"{meta.get(name)}); the target has {name} {want}")
    state = load_file(str(Path(path) / "drafter.safetensors"))
    drafter: Drafter = drafter_class(kind).from_saved(meta, state, base_config)
    drafter.load_state_dict(state)
    return drafter.eval(), meta


def check_int8_weights(value: str | None, key: str = "method.int8_weights") -> None:
    """One line naming the choices unless ``value`` names an int8 scheme (:data:`~pardec.config.INT8_WEIGHTS`) or
    is None: what a decoder checks before any model loads."""
    check_choice(key, value, INT8_WEIGHTS, or_null=True)


def place(drafter: Drafter, target: nn.Module, device, int8_weights: str | None) -> Drafter:
    """``drafter`` on ``device`` in ``target``'s dtype, in eval mode, for decoding. When ``target`` runs int8 linears
    (``dtype=int8``) and ``int8_weights`` names a scheme, the drafter's linears run int8 too, as a draft model's do
    in that mode (``conf/draft/local.yaml``): a copy is quantized (the given drafter stays as it was). Its drafts
    may change; the output does not (the target verifies them). None keeps the drafter in the target's float dtype."""
    drafter = drafter.to(device, target.dtype).eval()
    if int8_weights is not None and is_int8(target):
        drafter = quantize(copy.deepcopy(drafter), int8_weights)
    return drafter
