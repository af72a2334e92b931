"""What the checkpoint formats of pardec's drafters share (EAGLE-3's :mod:`.eagle_formats`, DFlash's
:mod:`.dflash_formats`): a directory or a Hub id resolved, JSON and weight files read in one-line errors, the first
look at a checkpoint directory, and Llama-config helpers (RoPE settings, dtype names)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors.torch import load_file

from pardec.config import ConfigError

#: the weight files a checkpoint directory may hold, in the order they are read
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def look(path: str | Path, key: str, speculators_type: str) -> tuple[str | None, list[str], dict | None, list[str]]:
    """The first look at a checkpoint directory: (``pardec`` for a drafter.json, ``speculators`` for a
    speculators config of ``speculators_type`` (another type raises), else None; its file names; its config.json
    (None without one); the config's architectures). A missing directory raises one line."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key}={str(path)!r} is not a directory")
    files = sorted(f.name for f in p.iterdir())
    if "drafter.json" in files:
        return "pardec", files, None, []
    cfg = read_json(p / "config.json", key) if "config.json" in files else None
    if cfg is not None and "speculators_model_type" in cfg:
        kind = cfg.get("speculators_model_type")
        if kind != speculators_type:
            raise ConfigError(f"{key}={str(path)!r} holds a speculators {kind!r} checkpoint; only "
                              f"{speculators_type!r} loads here")
        return "speculators", files, cfg, []
    return None, files, cfg, [str(a) for a in (cfg or {}).get("architectures") or []]


def listing(files: list[str]) -> str:
    """A directory's files for an error line (the first 12)."""
    return ", ".join(files[:12]) + (f", ... ({len(files)} files)" if len(files) > 12 else "") if files else "no files"


def resolve(path_or_hub_id: str | Path, key: str = "draft.path") -> Path:
    """A local directory as is; else a Hub id (``owner/name``) downloaded with ``huggingface_hub.snapshot_download``
    (config, json and weight files only); else one line saying why not."""
    p = Path(path_or_hub_id).expanduser()
    if p.exists():
        return p
    name = str(path_or_hub_id)
    if not _HUB_ID.match(name):
        raise ConfigError(f"{key}={name!r} is neither a local directory nor a Hub id (owner/name)")

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "pytorch_model.bin"]))
    except Exception as e:  # noqa: BLE001 (offline, no such repo, gated: all one line for the user)
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{key}={name!r} is not a local directory and its Hub download failed "
                          f"({type(e).__name__}: {first})") from None


def read_json(f: Path, key: str) -> dict:
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {f} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{key}: {f} is not a JSON object")
    return data


def weights_file(path: Path) -> Path | None:
    for name in WEIGHT_FILES:
        if (path / name).is_file():
            return path / name
    return None


def read_weights(path: Path, fmt: str, where: str) -> tuple[dict[str, torch.Tensor], str]:
    """(state dict on the CPU, the file's name): ``model.safetensors`` (or its sharded index) before
    ``pytorch_model.bin`` (read with ``weights_only``); ``fmt`` ``speculators`` reads safetensors only."""
    f = weights_file(path)
    if f is None or (fmt == "speculators" and f.name == "pytorch_model.bin"):
        allowed = ("model.safetensors",) if fmt == "speculators" else WEIGHT_FILES
        raise ConfigError(f"{where}: no weights file ({' or '.join(allowed)}) in {path}")
    try:
        if f.name == "model.safetensors":
            return load_file(str(f)), f.name
        if f.name.endswith(".index.json"):
            shards = sorted(set(read_json(f, where)["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for s in shards:
                state.update(load_file(str(path / s)))
            return state, f.name
        state = torch.load(str(f), map_location="cpu", weights_only=True)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 (a truncated or foreign file: one line)
        raise ConfigError(f"{where}: cannot read {f.name} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{where}: {f.name} is not a state dict of tensors")
    return state, f.name


def rope_of(layer: dict) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) of a Llama config dict in either transformers layout: ``rope_parameters``
    (5.x) or ``rope_theta`` + ``rope_scaling`` (4.x; its old ``type`` key read as ``rope_type``)."""
    params = layer.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", layer.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(layer.get("rope_theta", 10000.0))
        scaling = dict(layer.get("rope_scaling") or {})
    return theta, clean_scaling(scaling)


def clean_scaling(scaling: dict | None) -> dict | None:
    """A rope scaling dict with ``rope_type`` (never the old ``type``, never ``rope_theta``); None when plain."""
    if not scaling:
        return None
    s = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")}
    s["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return None if s["rope_type"] == "default" else s


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
