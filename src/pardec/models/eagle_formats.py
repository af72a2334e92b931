"""EAGLE-3 drafters in the two published checkpoint formats, next to pardec's own (:mod:`pardec.models.heads`).

* ``pardec``: ``drafter.json`` (``kind: eagle3``) + ``drafter.safetensors`` (:func:`pardec.models.drafters.save_drafter`);
* ``eagle3``: the original release (SafeAILab/EAGLE, ``eagle/model/cnets.py`` / ``ea_model.py``): ``config.json``
  is a one-layer ``LlamaConfig`` (``architectures`` e.g. ``["LlamaForCausalLMEagle3"]``, ``vocab_size`` = the
  target's, ``draft_vocab_size``, optionally ``target_hidden_size``); weights ``pytorch_model.bin`` (a
  ``torch.save`` state dict) or ``model.safetensors``, the layer named ``midlayer.*``; the feature layers are not
  stored (the reference hard-codes the states entering layers 2, L // 2, L - 3: :func:`default_layers`; vLLM reads
  a top-level ``eagle_aux_hidden_state_layer_ids``, SGLang ``eagle_config.eagle_aux_hidden_state_layer_ids``);
* ``speculators``: vLLM's ``speculators`` library (0.9): ``config.json`` with ``speculators_model_type: "eagle3"``,
  ``transformer_layer_config`` (a ``LlamaConfig`` dict), ``draft_vocab_size``, ``norm_before_residual``,
  ``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` and ``speculators_config`` (algorithm, proposal
  methods, verifier); weights ``model.safetensors`` with the layer named ``layers.0.*`` (pardec's own names).

Both external formats carry ``fc.weight``, ``norm.weight``, ``lm_head.weight`` and, when the draft vocabulary is
reduced, ``d2t`` (offsets) / ``t2d`` (mask) (:mod:`pardec.models.vocab`); a full-vocabulary draft may omit both.
A stored ``embed_tokens.weight`` is ignored (pardec feeds the target's own embedding).

:func:`load_eagle3` reads any of the three (local directory or Hub id) and checks the checkpoint against the target;
:mod:`pardec.export` writes the external two (:func:`eagle3_files`, :func:`speculators_files`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

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
    weights_file,
)
from pardec.models.drafters import load_drafter
from pardec.models.eagle import Eagle3Config, Eagle3Draft, default_layers
from pardec.models.vocab import DraftVocab

log = logging.getLogger(__name__)

FORMATS = ("pardec", "eagle3", "speculators")
#: the format's own weight files, in the order the original release tries them (``ea_model.py``: the .bin first)
EAGLE3_WEIGHTS = ("pytorch_model.bin", "model.safetensors")
SPECULATORS_WEIGHTS = "model.safetensors"
#: the ``speculators`` release whose saved layout :func:`speculators_files` follows
SPECULATORS_VERSION = "0.9.0"
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"  # the original release's config.json; vLLM and SGLang map it
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
#: keys a checkpoint may hold that pardec does not use: the drafter's copy of the target's embedding, and
#: ``speculators``' training-only verifier head (never saved by 0.9, but harmless if an older save has it)
IGNORED_KEYS = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
#: ``speculators`` options that change the computation and pardec's :class:`Eagle3Draft` does not implement
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


# ---------------------------------------------------------------------------------------------- detect and resolve
def detect(path: str | Path, key: str = "draft.path") -> str:
    """Which format the directory ``path`` holds, from its files: ``pardec`` (``drafter.json``), ``speculators``
    (``config.json`` with ``speculators_model_type``) or ``eagle3`` (``config.json`` naming a draft vocabulary or an
    Eagle3 architecture, and a weights file); anything else raises one line naming the directory and its files."""
    fmt, files, cfg, archs = look(path, key, "eagle3")
    if fmt is not None:
        return fmt
    p = Path(path)
    if cfg is not None and ("draft_vocab_size" in cfg or any("eagle3" in a.lower() for a in archs)) \
            and weights_file(p) is not None:
        return "eagle3"
    hint = (" (config.json has no draft_vocab_size and no Eagle3 architecture: a plain model or an EAGLE-1/2 draft?)"
            if cfg is not None and weights_file(p) is not None else "")
    raise ConfigError(f"{key}={str(path)!r} is not an EAGLE-3 checkpoint: found {listing(files)}{hint}; expected "
                      f"drafter.json (pardec), config.json with speculators_model_type 'eagle3' + {SPECULATORS_WEIGHTS} "
                      f"(speculators), or config.json with draft_vocab_size + {' or '.join(EAGLE3_WEIGHTS)} (eagle3)")


# ---------------------------------------------------------------------------------------------- load
def load_eagle3(path_or_hub_id: str | Path, target_config, key: str = "draft.path") -> tuple[Eagle3Draft, dict]:
    """An EAGLE-3 drafter in any of :data:`FORMATS` for a target with ``target_config``: (the module, in fp32 as
    :func:`pardec.models.drafters.load_drafter` gives it, eval mode; meta). Every mismatch with the target (hidden
    size, vocabulary size, feature layers) and every inconsistency of the checkpoint (d2t vs t2d, missing,
    unexpected or misshapen weights, options pardec does not implement) raises one line naming both values.

    meta: ``source_format``, ``path``, ``eagle3`` (the :class:`Eagle3Config` dict), ``layer_ids``, ``dtype`` (the
    stored weights'), ``ignored_keys``; speculators: also ``speculative_tokens`` and ``verifier``; pardec: its
    ``drafter.json`` too."""
    path = resolve(path_or_hub_id, key)
    fmt = detect(path, key)
    if fmt == "pardec":
        drafter, meta = load_drafter(path, target_config, "eagle3", key)
        return drafter, {**meta, "source_format": fmt, "path": str(path), "layer_ids": list(drafter.config.layer_ids)}
    cfg = read_json(path / "config.json", key)
    where = f"{key}={str(path_or_hub_id)!r}"
    if fmt == "speculators":
        layer, extra = _speculators_layer(cfg, where)
    else:
        layer, extra = cfg, {}
    state, weights_name = read_weights(path, fmt, where)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    ignored = sorted(k for k in state if k in IGNORED_KEYS)
    for k in ignored:
        log.info("%s: ignoring %s %s in %s (pardec uses the target's own embedding)" if k == "embed_tokens.weight"
                 else "%s: ignoring %s %s in %s (training-only)", where, k, tuple(state[k].shape), weights_name)
        del state[k]
    config = _eagle3_config(layer, cfg, extra, state, target_config, where)
    vocab = _vocab(state, config, where)
    drafter = Eagle3Draft(config, vocab)
    _check_state(drafter, state, where, weights_name)
    dtype = state["lm_head.weight"].dtype
    state.setdefault("d2t", vocab.d2t)
    state.setdefault("t2d", vocab.t2d)
    drafter.load_state_dict(state)
    meta = {"source_format": fmt, "path": str(path), "eagle3": config.to_dict(), "layer_ids": list(config.layer_ids),
            "dtype": str(dtype).removeprefix("torch."), "ignored_keys": ignored, **extra}
    log.info("%s: loaded an EAGLE-3 drafter (%s format, draft vocabulary %d of %d, feature layers %s)", where, fmt,
             config.draft_vocab_size, config.vocab_size, config.layer_ids)
    return drafter.eval(), meta


def _speculators_layer(cfg: dict, where: str) -> tuple[dict, dict]:
    """The layer config of a speculators ``config.json`` and its extra facts; refuses what pardec cannot run."""
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError(f"{where}: config.json has no transformer_layer_config dict (a speculators eagle3 "
                          f"config.json always has one)")
    on = [f for f in UNSUPPORTED_FLAGS if cfg.get(f)]
    if on:
        raise ConfigError(f"{where}: the checkpoint uses {', '.join(f'{f}=True' for f in on)}, which pardec's "
                          f"EAGLE-3 draft does not implement (supported: {', '.join(f'{f}=False' for f in on)})")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ConfigError(f"{where}: transformer_layer_config.model_type={model_type!r} is not supported; pardec's "
                          f"EAGLE-3 draft is a Llama layer (model_type 'llama')")
    spec = cfg.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    extra = {"speculative_tokens": methods[0].get("speculative_tokens"), "verifier": spec.get("verifier")}
    return layer, extra


def _eagle3_config(layer: dict, cfg: dict, extra: dict, state: dict, target_config, where: str) -> Eagle3Config:
    """The draft's :class:`Eagle3Config` from a checkpoint's layer config (``layer``; the whole ``config.json``:
    ``cfg``), checked against the target."""
    t_hidden, t_vocab, t_layers = (int(target_config.hidden_size), int(target_config.vocab_size),
                                   int(target_config.num_hidden_layers))
    n = int(layer.get("num_hidden_layers", 1))
    if n != 1:
        raise ConfigError(f"{where}: the draft has num_hidden_layers={n}; pardec's EAGLE-3 draft has exactly 1")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{where}: the draft's hidden_act={act!r} is not supported (pardec's draft MLP is 'silu')")
    hidden = int(layer["hidden_size"])
    if hidden != t_hidden:
        raise ConfigError(f"{where}: the draft's hidden_size {hidden} differs from the target's hidden_size "
                          f"{t_hidden} (pardec feeds the draft the target's own embedding, so they must match)")
    target_hidden = cfg.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
    if int(target_hidden) != t_hidden:
        raise ConfigError(f"{where}: the draft was made for a target of hidden_size {target_hidden}; the target has "
                          f"hidden_size {t_hidden}")
    vocab = layer.get("vocab_size") or cfg.get("vocab_size")
    vocab = int(vocab) if vocab else (int(state["t2d"].numel()) if "t2d" in state else t_vocab)
    if vocab != t_vocab:
        raise ConfigError(f"{where}: the draft was made for a vocabulary of {vocab} ids; the target has vocab_size "
                          f"{t_vocab}")
    head = state.get("lm_head.weight")
    if head is None:
        raise ConfigError(f"{where}: the checkpoint has no lm_head.weight (the draft's own head over its vocabulary)")
    draft_vocab = int(cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or head.shape[0])
    if draft_vocab != head.shape[0]:
        raise ConfigError(f"{where}: config.json says draft_vocab_size {draft_vocab}; lm_head.weight has "
                          f"{head.shape[0]} rows")
    layer_ids = (cfg.get("eagle_aux_hidden_state_layer_ids")
                 or (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids"))
    layer_ids = [int(i) for i in layer_ids] if layer_ids else list(default_layers(t_layers))
    bad = [i for i in layer_ids if not 0 <= i < t_layers]
    if bad:
        raise ConfigError(f"{where}: feature layers {layer_ids} are out of range: the target has layers "
                          f"0..{t_layers - 1}")
    heads = int(layer["num_attention_heads"])
    theta, scaling = rope_of(layer)
    return Eagle3Config(
        hidden_size=hidden, intermediate_size=int(layer["intermediate_size"]), num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads), vocab_size=vocab, draft_vocab_size=draft_vocab,
        target_hidden_size=int(target_hidden), layer_ids=layer_ids, rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
        rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=int(layer.get("max_position_embeddings") or 4096),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)))


def _vocab(state: dict, config: Eagle3Config, where: str) -> DraftVocab:
    """The draft vocabulary of the stored maps (both absent: the full vocabulary, which must then be the size of the
    head)."""
    d2t, t2d = state.get("d2t"), state.get("t2d")
    try:
        if d2t is not None:
            if d2t.numel() != config.draft_vocab_size:
                raise ValueError(f"d2t has {d2t.numel()} entries; draft_vocab_size is {config.draft_vocab_size}")
            return DraftVocab.from_maps(d2t, t2d, config.vocab_size)
        if t2d is not None:
            if t2d.numel() != config.vocab_size:
                raise ValueError(f"t2d has {t2d.numel()} entries; the target vocabulary has {config.vocab_size}")
            ids = torch.nonzero(t2d.bool()).flatten().tolist()
            if len(ids) != config.draft_vocab_size:
                raise ValueError(f"t2d marks {len(ids)} ids; draft_vocab_size is {config.draft_vocab_size}")
            return DraftVocab(ids, config.vocab_size)
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    if config.draft_vocab_size != config.vocab_size:
        raise ConfigError(f"{where}: the checkpoint has no d2t/t2d maps but a reduced draft vocabulary "
                          f"(draft_vocab_size {config.draft_vocab_size} of {config.vocab_size})")
    return DraftVocab.full(config.vocab_size)


def _check_state(drafter: Eagle3Draft, state: dict, where: str, weights_name: str) -> None:
    """Missing, unexpected and misshapen weights, each named (the maps are checked by :func:`_vocab`)."""
    want = {k: tuple(v.shape) for k, v in drafter.state_dict().items() if k not in ("d2t", "t2d")}
    have = {k: tuple(v.shape) for k, v in state.items() if k not in ("d2t", "t2d")}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected)}"] if unexpected else [])
        raise ConfigError(f"{where}: {weights_name} does not fit an EAGLE-3 draft: {'; '.join(parts)}")
    wrong = [f"{k} {have[k]} (expected {want[k]})" for k in want if have[k] != want[k]]
    if wrong:
        raise ConfigError(f"{where}: {weights_name} has misshapen weights: {', '.join(wrong)}")


# ---------------------------------------------------------------------------------------------- files
def target_embedding(target_dir: str | Path, key: str = "--with-embeddings") -> torch.Tensor:
    """The token embedding [V, H] of a target model directory saved with safetensors (one file or an index): the
    tensor whose name ends in ``embed_tokens.weight`` (``model.embed_tokens.weight`` in Llama-family models)."""
    p = Path(target_dir)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        names = {k: p / v for k, v in read_json(index, key)["weight_map"].items()}
    elif (p / "model.safetensors").is_file():
        with safe_open(str(p / "model.safetensors"), framework="pt") as f:
            names = {k: p / "model.safetensors" for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    else:
        raise ConfigError(f"{key}={str(target_dir)!r} holds no model.safetensors (or its index): the target's "
                          f"embedding is read from safetensors files")
    found = sorted(k for k in names if k.endswith("embed_tokens.weight"))
    if not found:
        raise ConfigError(f"{key}={str(target_dir)!r}: no *embed_tokens.weight tensor in its safetensors files")
    with safe_open(str(names[found[0]]), framework="pt") as f:
        return f.get_tensor(found[0])


# ---------------------------------------------------------------------------------------------- export helpers
def external_state(state: dict[str, torch.Tensor], fmt: str, vocab_reduced: bool) -> dict[str, torch.Tensor]:
    """pardec's state dict in ``fmt``'s names (``eagle3``: ``layers.0.`` -> ``midlayer.``); the maps only when the
    draft vocabulary is reduced (both formats' loaders treat absent maps as the identity)."""
    out = {}
    for k, v in state.items():
        if k in ("d2t", "t2d") and not vocab_reduced:
            continue
        if fmt == "eagle3" and k.startswith("layers.0."):
            k = "midlayer." + k[len("layers.0."):]
        out[k] = v.detach().contiguous().cpu()
    return out


def llama_layer_dict(c: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """The draft layer as a ``LlamaConfig`` dict readable by transformers 4.x (``rope_theta`` / ``rope_scaling``)
    and 5.x (``rope_parameters``) alike."""
    scaling = clean_scaling(c.rope_scaling)
    name = dtype_name(dtype)
    return {"model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_hidden_layers": 1, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size, "rope_theta": c.rope_theta, "rope_scaling": scaling,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta, **(scaling or {})},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "use_cache": True,
            "torch_dtype": name, "dtype": name}


def eagle3_config_json(c: Eagle3Config, dtype: torch.dtype) -> dict[str, Any]:
    """``config.json`` of the original release's layout; the feature layers ride along where vLLM (top level) and
    SGLang (``eagle_config``) read them."""
    return {"architectures": [EAGLE3_ARCHITECTURE], **llama_layer_dict(c, dtype),
            "draft_vocab_size": c.draft_vocab_size,
            **({"target_hidden_size": c.target_hidden_size} if c.target_hidden_size != c.hidden_size else {}),
            "norm_before_residual": c.norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": list(c.layer_ids),
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(c.layer_ids), "use_aux_hidden_state": True}}


def speculators_config_json(c: Eagle3Config, dtype: torch.dtype, speculative_tokens: int,
                            verifier: str | None, verifier_architectures: list[str]) -> dict[str, Any]:
    """``config.json`` of a ``speculators`` 0.9 ``Eagle3SpeculatorConfig`` save."""
    name = dtype_name(dtype)
    return {"architectures": [SPECULATORS_ARCHITECTURE], "speculators_model_type": "eagle3",
            "speculators_version": SPECULATORS_VERSION,
            "transformer_layer_config": llama_layer_dict(c, dtype),
            "draft_vocab_size": c.draft_vocab_size, "norm_before_residual": c.norm_before_residual,
            "norm_before_fc": False, "fc_norm": False, "norm_output": False,
            "target_hidden_size": c.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(c.layer_ids),
            "speculators_config": {
                "algorithm": "eagle3",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(speculative_tokens),
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "default_proposal_method": "greedy",
                "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)}},
            "torch_dtype": name, "dtype": name}
