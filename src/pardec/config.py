"""Structured configs: dataclasses that validate types and ranges of what Hydra composed.

Hydra composes YAML; :func:`to_dataclass` turns a section into one of these (OmegaConf checks the types,
``__post_init__`` the ranges) so a bad value fails before any model loads, naming the key and the valid choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

DTYPES = ("fp32", "bf16", "fp16")
MODEL_SOURCES = ("hub", "local", "gguf_package", "gguf", "tiny_random")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A config value is out of range or of the wrong type."""


def _key(section: str, key: str) -> str:
    return f"{section}.{key}" if section else key


def _choice(section: str, key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(f"{_key(section, key)}={value!r} is not valid; choose one of: {', '.join(map(str, choices))}")


def _at_least(section: str, key: str, value: float, low: float) -> None:
    if value < low:
        raise ConfigError(f"{_key(section, key)}={value!r} is out of range: it must be >= {low}")


@dataclass
class ModelConfig:
    name: str = "smollm2_135m"
    source: str = "gguf_package"  # hub | local | gguf_package | gguf | tiny_random
    path: str | None = None  # hub id, local dir, or GGUF file / package name
    gguf_file: str | None = None  # file name inside ``path`` (GGUF sources)
    revision: str | None = None
    dtype: str = "fp32"
    device: str = "auto"
    attn_implementation: str = "sdpa"
    chat: bool | None = None  # use the chat template; None = when the tokenizer has one
    cache_dir: str | None = None  # where dequantized GGUF weights are cached (default data/models/<name>)
    adapter: str | None = None  # a peft (LoRA) adapter dir applied on top of the base weights
    # tiny_random only
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    seed: int = 0
    tokenizer: str | None = None  # tiny_random: model config name whose tokenizer to use
    missing_hint: str | None = None  # local source: how to make ``path`` exist (named by the error when it does not)

    def __post_init__(self) -> None:
        _choice("model", "source", self.source, MODEL_SOURCES)
        _choice("model", "dtype", self.dtype, DTYPES)
        _choice("model", "device", self.device, DEVICES)
        _choice("model", "attn_implementation", self.attn_implementation, ("sdpa", "eager"))
        _at_least("model", "layers", self.layers, 1)
        _at_least("model", "hidden", self.hidden, 8)


@dataclass
class SamplingConfig:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        _at_least("sampling", "temperature", self.temperature, 0.0)
        _at_least("sampling", "top_k", self.top_k, 0)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"sampling.top_p={self.top_p!r} is out of range: it must be in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class DatasetConfig:
    name: str = "humaneval"
    path: str | None = None  # local file overriding the hub
    hub_id: str | None = None
    hub_config: str | None = None
    split: str = "test"
    prompt_style: str = "auto"  # auto | chat | base
    extra: dict = field(default_factory=dict)  # task-specific options

    def __post_init__(self) -> None:
        _choice("dataset", "prompt_style", self.prompt_style, ("auto", "chat", "base"))


@dataclass
class BenchConfig:
    baseline: str = "ar"
    include_hf: bool = False
    # more methods run as roles on the same prompts in the same run: "name" or "name:key=value:key=value"
    # (e.g. "sps:adaptive=true"); they are summarised beside the peers under ``peers.<name[:...]>``
    also: list[str] = field(default_factory=list)
    warmup: int = 1  # warm-up generations per method before timing
    warmup_tokens: int = 16

    def __post_init__(self) -> None:
        _at_least("bench", "warmup", self.warmup, 0)
        _at_least("bench", "warmup_tokens", self.warmup_tokens, 1)


@dataclass
class RunConfig:
    """Top-level keys of ``conf/evaluate.yaml``."""

    n_samples: int | None = None  # None = the whole dataset
    max_new_tokens: int = 256
    threads: int = 2
    seed: int = 0
    resume: bool = False
    timeout_s: float = 10.0  # sandbox wall-clock limit per program
    stop_at_eos: bool = True
    repeats: int = 1
    dtype: str = "fp32"

    def __post_init__(self) -> None:
        _at_least("", "repeats", self.repeats, 1)
        _choice("", "dtype", self.dtype, DTYPES)
        if self.n_samples is not None:
            _at_least("", "n_samples", self.n_samples, 1)
        _at_least("", "max_new_tokens", self.max_new_tokens, 1)
        _at_least("", "threads", self.threads, 1)
        _at_least("", "timeout_s", self.timeout_s, 0.1)


D = TypeVar("D")


def to_dataclass(cls: type[D], section: DictConfig | dict | None, where: str) -> D:
    """Validate a config section against ``cls``; unknown keys and bad types raise :class:`ConfigError`."""
    data = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section or {})
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid keys: {', '.join(sorted(known))}")
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), data)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad value in {where}: {e.msg if hasattr(e, 'msg') else e}") from None
