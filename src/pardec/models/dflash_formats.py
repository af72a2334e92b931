"""DFlash drafters in the published checkpoint layouts, next to pardec's own (:mod:`pardec.models.heads`); the facts
and their sources are in ``docs/dflash_reference.md`` §4.

* ``pardec``: ``drafter.json`` (``kind: dflash``) + ``drafter.safetensors``;
* ``dflash``: the z-lab release (``z-lab/*-DFlash-b16`` on the Hub, loaded there with ``trust_remote_code``):
  ``config.json`` is a ``Qwen3Config`` (``model_type: qwen3``, ``num_hidden_layers`` = draft layers) plus
  ``architectures: ["DFlashDraftModel"]``, ``num_target_layers``, ``block_size`` (top level in the Qwen3/LLaMA
  releases, inside ``dflash_config`` in later ones) and ``dflash_config: {mask_token_id, target_layer_ids}``, the
  target layer ids counting layer *outputs* from 0 (z-lab reads ``hidden_states[id + 1]``, pardec's ``id + 1``);
  weights ``model.safetensors``: ``layers.{i}.*``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` (no
  embedding, no head: the target's);
* ``speculators``: vLLM's ``speculators`` 0.9 ``dflash`` format: ``config.json`` with ``speculators_model_type:
  "dflash"``, ``transformer_layer_config`` (a Qwen3 config dict), ``block_size``, ``target_hidden_size``,
  ``aux_hidden_state_layer_ids`` (``hidden_states`` indices: pardec's convention), ``mask_token_id``,
  ``draft_vocab_size`` and ``speculators_config``; weights ``model.safetensors`` with the same body names.

A drafter with a learned mask embedding (pardec's, for targets without a spare mask row such as SmolLM2) stores it as
``mask_embedding`` [H] in both external layouts, with ``mask_token_id`` null in the config: pardec reads it back;
the engines' loaders expect a mask token id (the export names this; ``docs/dflash.md``). A reduced draft vocabulary
(``speculators``' optional ``draft_vocab_size`` < the target's, with its own ``lm_head.weight`` [K, H] and EAGLE-3's
``d2t``/``t2d`` maps) loads into a draft with its own head (:class:`~pardec.models.dflash.DFlashDraft`) and
exports back the same way; the z-lab layout has none (its drafts share the target's head), so such a draft is
refused there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pardec.config import ConfigError
from pardec.models.checkpoints import (
    clean_scaling,
    dtype_name,
    listing,
    look,
    read_json,
    read_weights,
    resolve,
    rope_of,
)
from pardec.models.dflash import DFlashConfig, DFlashDraft, default_layers
from pardec.models.drafters import load_drafter
from pardec.models.vocab import DraftVocab

log = logging.getLogger(__name__)

FORMATS = ("pardec", "dflash", "speculators")
ZLAB_ARCHITECTURE = "DFlashDraftModel"  # z-lab's config.json; vLLM's registry and SGLang's EntryClass name it
SPECULATORS_ARCHITECTURE = "DFlashSpeculator"
SPECULATORS_VERSION = "0.9.0"
#: keys a checkpoint may hold that pardec does not use (the target's own embedding and head; speculators'
#: training-only verifier copies)
IGNORED_KEYS = ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: the pardec-only tensors (learned mask embedding; DFlare's per-layer mix)
PARDEC_KEYS = ("mask_embedding", "layer_mix")


def detect(path: str | Path, key: str = "draft.path") -> str:
    """Which format the directory ``path`` holds: ``pardec`` (``drafter.json``), ``speculators``
    (``speculators_model_type: dflash``) or ``dflash`` (a ``DFlashDraftModel`` architecture or a ``dflash_config``);
    anything else raises one line naming the directory and its files."""
    fmt, files, cfg, archs = look(path, key, "dflash")
    if fmt is not None:
        return fmt
    if cfg is not None and (ZLAB_ARCHITECTURE in archs or "dflash_config" in cfg):
        return "dflash"
    raise ConfigError(f"{key}={str(path)!r} is not a DFlash checkpoint: found {listing(files)}; expected drafter.json "
                      f"(pardec), config.json with speculators_model_type 'dflash' (speculators), or config.json with "
                      f"architectures [{ZLAB_ARCHITECTURE!r}] / a dflash_config (the z-lab release)")


def load_dflash(path_or_hub_id: str | Path, target_config, key: str = "draft.path") -> tuple[DFlashDraft, dict]:
    """A DFlash drafter in any of :data:`FORMATS` (a directory or a Hub id) for a target with ``target_config``:
    (the module in fp32, eval mode; meta: ``source_format``, ``path``, ``dflash`` (the config dict), ``layer_ids``,
    ``dtype``, ``ignored_keys``). Every mismatch with the target and every inconsistency of the checkpoint raises
    one line naming both values."""
    path = resolve(path_or_hub_id, key)
    fmt = detect(path, key)
    if fmt == "pardec":
        drafter, meta = load_drafter(path, target_config, "dflash", key)
        return drafter, {**meta, "source_format": fmt, "path": str(path), "layer_ids": list(drafter.config.layer_ids)}
    where = f"{key}={str(path_or_hub_id)!r}"
    cfg = read_json(path / "config.json", key)
    state, weights_name = read_weights(path, "speculators", where)
    config = _config(cfg, fmt, state, target_config, where)
    ignored = sorted(k for k in state if k in IGNORED_KEYS and not (config.reduced and k == "lm_head.weight"))
    for k in ignored:
        del state[k]
    drafter = DFlashDraft(config, _vocab(state, config, where))
    want = {k: tuple(v.shape) for k, v in drafter.state_dict().items()}
    have = {k: tuple(v.shape) for k, v in state.items()}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected)}"] if unexpected else [])
        raise ConfigError(f"{where}: {weights_name} does not fit a DFlash draft of {config.num_hidden_layers} layers: "
                          f"{'; '.join(parts)}")
    wrong = [f"{k} {have[k]} (expected {want[k]})" for k in want if have[k] != want[k]]
    if wrong:
        raise ConfigError(f"{where}: {weights_name} has misshapen weights: {', '.join(wrong)}")
    dtype = state["norm.weight"].dtype
    drafter.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    meta = {"source_format": fmt, "path": str(path), "dflash": config.to_dict(), "layer_ids": list(config.layer_ids),
            "dtype": dtype_name(dtype), "ignored_keys": ignored}
    log.info("%s: loaded a DFlash drafter (%s format, %d layers, block %d, target layers %s)", where, fmt,
             config.num_hidden_layers, config.block_size, config.layer_ids)
    return drafter.float().eval(), meta


def _config(cfg: dict, fmt: str, state: dict, target_config, where: str) -> DFlashConfig:
    """The :class:`DFlashConfig` of a z-lab or speculators ``config.json``, checked against the target."""
    t_hidden, t_vocab, t_layers = (int(target_config.hidden_size), int(target_config.vocab_size),
                                   int(target_config.num_hidden_layers))
    dcfg = cfg.get("dflash_config") or {}
    if fmt == "speculators":
        layer = cfg.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ConfigError(f"{where}: config.json has no transformer_layer_config dict (a speculators dflash "
                              f"config.json always has one)")
        ids = cfg.get("aux_hidden_state_layer_ids")
        layer_ids = None if ids is None else [int(i) for i in ids]
        mask_id = cfg.get("mask_token_id")
        block = cfg.get("block_size")
        draft_vocab = cfg.get("draft_vocab_size")
        if draft_vocab is not None and not 2 <= int(draft_vocab) <= t_vocab:
            raise ConfigError(f"{where}: draft_vocab_size {draft_vocab} is out of range for a target vocabulary of "
                              f"{t_vocab} ids")
        if cfg.get("sliding_window_non_causal") or layer.get("sliding_window"):
            _refuse_sliding(layer, where)
    else:
        layer = cfg
        ids = dcfg.get("target_layer_ids", cfg.get("target_layer_ids"))
        layer_ids = None if ids is None else [int(i) + 1 for i in ids]  # z-lab: layer outputs from 0
        draft_vocab = None  # (z-lab's drafts share the target's head)
        mask_id = dcfg.get("mask_token_id", cfg.get("mask_token_id"))
        block = dcfg.get("block_size", cfg.get("block_size"))
        n_target = cfg.get("num_target_layers")
        if n_target is not None and int(n_target) != t_layers:
            raise ConfigError(f"{where}: the drafter was made for a target of {n_target} layers "
                              f"(num_target_layers); the target has {t_layers}")
        _refuse_sliding(layer, where)
    hidden = int(layer["hidden_size"])
    if hidden != t_hidden:
        raise ConfigError(f"{where}: the draft's hidden_size {hidden} differs from the target's hidden_size {t_hidden} "
                          f"(DFlash's drafts are of the target's width and share its embedding and head)")
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if target_hidden != t_hidden:
        raise ConfigError(f"{where}: the draft was made for a target of hidden_size {target_hidden}; the target has "
                          f"hidden_size {t_hidden}")
    vocab = int(layer.get("vocab_size") or t_vocab)
    if vocab != t_vocab:
        raise ConfigError(f"{where}: the draft was made for a vocabulary of {vocab} ids; the target has vocab_size "
                          f"{t_vocab}")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: the draft's hidden_act={act!r} is not supported (pardec's draft MLP is 'silu')")
    n = int(layer["num_hidden_layers"])
    if layer_ids is None:
        layer_ids = default_layers(t_layers, n)
    fc = state.get("fc.weight")
    if fc is not None and fc.shape[1] != len(layer_ids) * t_hidden:
        raise ConfigError(f"{where}: fc.weight reads {fc.shape[1]} features; {len(layer_ids)} target layers "
                          f"{layer_ids} of width {t_hidden} give {len(layer_ids) * t_hidden}")
    bad = [i for i in layer_ids if not 0 <= i < t_layers]
    if bad:
        raise ConfigError(f"{where}: target layers {layer_ids} (pardec's convention: the states entering them) are out "
                          f"of range: the target's states enter layers 0..{t_layers - 1}")
    if block is None:
        raise ConfigError(f"{where}: config.json names no block_size (top level or dflash_config)")
    if mask_id is None and "mask_embedding" not in state:
        raise ConfigError(f"{where}: config.json names no mask_token_id and the weights hold no mask_embedding")
    heads = int(layer["num_attention_heads"])
    theta, scaling = rope_of(layer)
    return DFlashConfig(
        hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_hidden_layers=n,
        num_attention_heads=heads, num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), vocab_size=vocab, target_hidden_size=target_hidden,
        layer_ids=layer_ids, block_size=int(block), mask_token_id=None if "mask_embedding" in state else int(mask_id),
        fusion="layerwise" if "layer_mix" in state else "concat", rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 4096),
        draft_vocab_size=None if draft_vocab is None or int(draft_vocab) == t_vocab else int(draft_vocab))


def _vocab(state: dict, config: DFlashConfig, where: str) -> DraftVocab | None:
    """The reduced draft vocabulary of a checkpoint's ``d2t`` (and ``t2d``), checked; None for a whole-vocabulary
    draft."""
    if not config.reduced:
        return None
    if "d2t" not in state or "lm_head.weight" not in state:
        missing = [k for k in ("lm_head.weight", "d2t") if k not in state]
        raise ConfigError(f"{where}: draft_vocab_size {config.draft_vocab_size} of {config.vocab_size} needs the draft's "
                          f"own head and id map; the weights lack {', '.join(missing)}")
    try:
        vocab = DraftVocab.from_maps(state["d2t"], state.get("t2d"), config.vocab_size)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if len(vocab) != config.draft_vocab_size:
        raise ConfigError(f"{where}: d2t maps {len(vocab)} ids; config.json says draft_vocab_size "
                          f"{config.draft_vocab_size}")
    state.setdefault("t2d", vocab.t2d)
    return vocab


def _refuse_sliding(layer: dict, where: str) -> None:
    """pardec's DFlash layers attend to the whole context: sliding-window drafts (z-lab's later Qwen3.5 releases)
    are refused by name."""
    types = [t for t in layer.get("layer_types") or [] if t != "full_attention"]
    if types or (layer.get("use_sliding_window") and layer.get("sliding_window")):
        raise ConfigError(f"{where}: the drafter has sliding-window layers ({sorted(set(types)) or 'use_sliding_window'}); "
                          f"pardec's DFlash layers attend to the whole context (full_attention only)")


# ---------------------------------------------------------------------------------------------- export
def qwen3_layer_dict(c: DFlashConfig, dtype: torch.dtype) -> dict[str, Any]:
    """The draft's layers as a ``Qwen3Config`` dict (transformers 4.x ``rope_theta``/``rope_scaling`` and 5.x
    ``rope_parameters`` alike)."""
    scaling = clean_scaling(c.rope_scaling)
    name = dtype_name(dtype)
    return {"model_type": "qwen3", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "rope_theta": c.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})},
            "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False, "use_cache": True,
            "use_sliding_window": False, "sliding_window": None,
            "layer_types": ["full_attention"] * c.num_hidden_layers, "torch_dtype": name, "dtype": name}


def zlab_config_json(c: DFlashConfig, dtype: torch.dtype, num_target_layers: int) -> dict[str, Any]:
    """``config.json`` of the z-lab layout (target layer ids as z-lab counts them: pardec's minus one)."""
    ids = [i - 1 for i in c.layer_ids]
    return {"architectures": [ZLAB_ARCHITECTURE], **qwen3_layer_dict(c, dtype),
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "num_target_layers": int(num_target_layers),
            "block_size": c.block_size,
            "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": ids, "block_size": c.block_size}}


def speculators_config_json(c: DFlashConfig, dtype: torch.dtype, verifier: str | None,
                            verifier_architectures: list[str]) -> dict[str, Any]:
    """``config.json`` of a ``speculators`` 0.9 ``DFlashSpeculatorConfig`` save."""
    name = dtype_name(dtype)
    return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "dflash",
            "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": qwen3_layer_dict(c, dtype),
            "draft_vocab_size": c.draft_vocab_size or c.vocab_size, "block_size": c.block_size,
            "target_hidden_size": c.target_hidden_size,
            "aux_hidden_state_layer_ids": list(c.layer_ids), "mask_token_id": c.mask_token_id,
            "sliding_window_non_causal": False, "sample_from_anchor": False,
            "speculators_config": {
                "algorithm": "dflash",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size - 1,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
            "torch_dtype": name, "dtype": name}
