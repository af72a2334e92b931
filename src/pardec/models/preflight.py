"""Checks before any weights load: whether a model's weights can be had (a local directory, the hub's cache, the
hub itself) in one line and in seconds, its config.json when at hand, and whether a draft tokenizes exactly like
its target (their tokenizers read without weights)."""

from __future__ import annotations

import json
from pathlib import Path

from huggingface_hub import constants, try_to_load_from_cache
from transformers import PreTrainedTokenizerBase

from pardec.config import ConfigError, ModelConfig
from pardec.hub import MODEL_OFFLINE_VARS, hub_reachable, offline_var
from pardec.models.loading import cache_dir_for, load_tokenizer_only


def hub_offline() -> bool:
    """Whether the Hugging Face hub is switched off for models (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    return bool(constants.HF_HUB_OFFLINE) or offline_var(MODEL_OFFLINE_VARS) is not None


def _hub_cached(repo: str, revision: str | None) -> bool:
    return isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str)


def read_config_json(cfg: ModelConfig) -> dict | None:
    """The model's config.json as a dict when it is at hand without loading weights (a local directory, a GGUF
    already dequantized, a hub model in the local cache); None otherwise (tiny random models have none)."""
    f: Path | str | None = None
    if cfg.source == "local":
        f = Path(cfg.path or "") / "config.json"
    elif cfg.source in ("gguf", "gguf_package"):
        f = cache_dir_for(cfg) / "config.json"
    elif cfg.source == "hub" and cfg.path:
        f = try_to_load_from_cache(cfg.path, "config.json", revision=cfg.revision)
    if not isinstance(f, (str, Path)) or not Path(f).is_file():
        return None
    return json.loads(Path(f).read_text())


def check_available(cfg: ModelConfig, key: str = "model") -> None:
    """Fail in seconds, with one line, when the weights of ``cfg`` cannot be had: a local dir that does not exist
    (naming ``cfg.missing_hint``, the fix), a hub model neither cached nor reachable. ``key``: the config
    section (``model`` or ``draft``) the error names."""
    where = f"{key} {cfg.name!r}"
    if cfg.source == "local":
        if not cfg.path or cfg.path == "???":
            raise ConfigError(f"{where} needs {key}.path=<dir>" + (f"; {cfg.missing_hint}" if cfg.missing_hint else ""))
        if not (Path(cfg.path) / "config.json").is_file():
            what = "is not a directory" if not Path(cfg.path).is_dir() else "holds no config.json"
            hint = cfg.missing_hint or f"pass {key}.path=<a model directory>"
            raise FileNotFoundError(f"{where}: {key}.path={cfg.path} {what}; {hint}")
    elif cfg.source == "hub":
        if not cfg.path or cfg.path == "???":
            raise ConfigError(f"{where} needs {key}.path=<org/name> (a Hugging Face hub id)")
        if _hub_cached(cfg.path, cfg.revision):
            return
        if hub_offline():
            raise ConfigError(f"{where}: hub model {cfg.path} is not in the local Hugging Face cache and the hub is "
                              f"off (HF_HUB_OFFLINE); download it first or use {key}=local {key}.path=<dir>")
        if not hub_reachable():
            raise ConfigError(f"{where}: hub model {cfg.path} is not in the local Hugging Face cache and the hub "
                              f"cannot be reached (no network); download it elsewhere and use {key}=local "
                              f"{key}.path=<dir>")


#: special tokens a draft must share with its target (pad is not compared: loading sets it to EOS when unset)
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "unk_token_id")


def tokenizer_difference(a: PreTrainedTokenizerBase, b: PreTrainedTokenizerBase) -> str | None:
    """What makes two tokenizers produce different ids (vocabulary mapping, special-token ids), or None."""
    va, vb = a.get_vocab(), b.get_vocab()
    if va != vb:
        moved = sum(va[t] != vb[t] for t in va.keys() & vb.keys())
        return f"vocabularies differ ({len(va)} vs {len(vb)} tokens, {moved} shared tokens with other ids)"
    for attr in SPECIAL_IDS:
        if getattr(a, attr) != getattr(b, attr):
            return f"{attr} {getattr(a, attr)} vs {getattr(b, attr)}"
    return None


def check_same_tokenizer(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft must tokenize exactly like its target: compare their tokenizers (loaded without weights)."""
    diff = tokenizer_difference(load_tokenizer_only(target), load_tokenizer_only(draft))
    if diff:
        raise ConfigError(f"draft {draft.name!r} ({draft.path or draft.source}) does not share the tokenizer of "
                          f"model {target.name!r} ({target.path or target.source}): {diff}")
