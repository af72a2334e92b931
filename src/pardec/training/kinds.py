"""Experiment kinds: the registry (:data:`KINDS`, "did you mean" errors like METHODS and TASKS), the :class:`Kind`
base, the spec fields every kind shares, and the checks of the config sections every kind reads the same way.

An experiment names its kind (``kind: cllm``); the kind is a package under :mod:`pardec.training` that registers a
:class:`Kind` subclass holding only what differs: its spec (a :class:`Spec` subclass), its validation and its
stages. ``stage=all`` runs a kind's stages in order; stages listed in :attr:`Kind.rank0_stages` run on rank 0 only.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf

from pardec import CONF_DIR, on_cuda
from pardec.config import ConfigError, ModelConfig, check_choice, check_types, to_dataclass
from pardec.registry import Registry

#: the built-in kinds, one package each (imported by :func:`load_kinds`)
BUILTIN = ("cllm", "draft", "drafter", "sdsat")
#: keys of the ``trainer`` section handled by the app; every other key is a field of the kind's config
APP_KEYS = ("lora", "deepspeed", "model_dtype", "resume_from_checkpoint")
LORA_KEYS = ("enabled", "r", "alpha", "dropout", "target_modules")

KINDS: Registry[type[Kind]] = Registry("experiment kind")


def register_kind(name: str, *, aliases: tuple[str, ...] = ()):
    return KINDS.register(name, aliases=aliases)


def load_kinds() -> Registry[type[Kind]]:
    """:data:`KINDS` with every built-in kind registered (importing their packages)."""
    for name in BUILTIN:
        importlib.import_module(f"pardec.training.{name}")
    return KINDS


@dataclass
class Spec:
    """What every kind's spec holds (each kind adds its own sections)."""

    experiment: str
    stage: str
    model: ModelConfig
    deepspeed: Path | None
    model_dtype: str
    resume: bool | str | None
    logger: dict
    threads: int
    config: dict  # the whole resolved config (for W&B)
    trainer: dict  # the kind's config keyword arguments (a BaseConfig subclass)
    lora: dict | None  # LoRA settings when enabled (kinds that support it)
    device: str  # the top-level ``device`` key: auto | cuda (checked usable) | cpu (a GPU recipe rehearsed)


class Kind:
    """One experiment kind. Subclasses set ``name``, ``stages`` (in the order ``stage=all`` runs them) and
    ``config_cls`` (their :class:`~pardec.training.base.BaseConfig`), and implement :meth:`validate` and one method
    ``stage_<name>(spec, run_dir, dist)`` per stage, whose result goes into the summary under the stage's name."""

    name: ClassVar[str]
    stages: ClassVar[tuple[str, ...]]
    rank0_stages: ClassVar[tuple[str, ...]] = ()
    example: ClassVar[str] = ""  # an experiment to point at in errors about missing sections

    @classmethod
    def stage_choices(cls) -> tuple[str, ...]:
        return (*cls.stages, "all")

    def validate(self, cfg: DictConfig, name: str) -> Spec:
        """The spec of experiment ``name`` from ``cfg``, checked before anything heavy loads (the fields every kind
        shares through :func:`common_fields`)."""
        raise NotImplementedError

    def run(self, spec: Spec, run_dir: Path, ranks) -> dict[str, Any]:
        """Run the stages ``spec.stage`` names; the summary of each stage under its name."""
        todo = self.stages if spec.stage == "all" else (spec.stage,)
        out: dict[str, Any] = {}
        for stage in todo:
            if stage in self.rank0_stages and ranks.rank != 0:
                continue
            with stage_peak(spec) as peak:
                out[stage] = getattr(self, f"stage_{stage}")(spec, run_dir, ranks)
            if peak.bytes is not None and isinstance(out[stage], dict):
                out[stage]["peak_memory"] = peak.record()
        return out

    # -- helpers for validate -------------------------------------------------------------------
    def sections(self, cfg: DictConfig, *names: str) -> list[dict]:
        """The named sections of ``cfg`` as plain dicts; a missing one raises naming an example experiment."""
        out = []
        for key in names:
            if not isinstance(cfg.get(key), DictConfig):
                raise ConfigError(f"a {self.name} experiment needs a `{key}` section (see "
                                  f"conf/experiment/{self.example}.yaml)")
            out.append(OmegaConf.to_container(cfg[key], resolve=True))
        return out


def stage_peak(spec: Spec):
    """The peak memory of a stage of ``spec``: on a CUDA device always (the allocator's own count), on the CPU with
    ``measure_memory=true`` (:class:`~pardec.metrics.memory.StagePeak`); what :mod:`pardec.plan` is checked against."""
    import torch  # heavy: validation imports this module before any model loads  (heavy: torch)

    from pardec.metrics.memory import StagePeak  # heavy: torch

    cuda = spec.device != "cpu" and on_cuda() and torch.backends.cuda.is_built()
    return StagePeak(cuda=cuda, host=bool(spec.config.get("measure_memory")))


# ------------------------------------------------------------------------------------------- shared checks
def experiments() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def common_fields(cfg: DictConfig, name: str, config_cls: type, *, elsewhere: dict[str, str] | None = None,
                  lora: bool = False, no_zero3: str | None = None) -> dict[str, Any]:
    """The :class:`Spec` fields every kind reads the same way: the ``trainer`` section (names and types of the
    ``config_cls`` fields checked; the app's keys popped: model_dtype, deepspeed, resume_from_checkpoint and, where
    ``lora``, lora), the model, the logger, the thread count and the whole config. ``elsewhere``: fields of
    ``config_cls`` that an experiment sets in another section, with the hint the error gives. ``no_zero3``: why
    the kind refuses ``trainer.deepspeed=zero3`` (None: it supports it)."""
    elsewhere = elsewhere or {}
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    app = [k for k in APP_KEYS if lora or k != "lora"]
    own = [k for k in config_cls.own_fields() if k not in elsewhere]
    valid = ({f.name for f in fields(config_cls) if f.init} - set(elsewhere)) | set(app)
    unknown = sorted(set(tcfg) - valid)
    if unknown:
        hints = "".join(f"; {hint}" for hint in elsewhere.values())
        raise ConfigError(f"unknown key(s) {unknown} in trainer; valid: {', '.join(app + own)} and any "
                          f"transformers.TrainingArguments field{hints}")
    check_types(config_cls, {k: v for k, v in tcfg.items() if k not in app}, "trainer")
    config_cls.check_values({k: v for k, v in tcfg.items() if k in own})
    lora_cfg = lora_section(tcfg) if lora else None
    model_dtype = tcfg.pop("model_dtype", "fp32")
    if no_zero3 and tcfg.get("deepspeed") == "zero3":
        raise ConfigError(f"trainer.deepspeed=zero3 is not supported by the {cfg.get('kind')} kind: {no_zero3}; use "
                          f"trainer.deepspeed=zero2 (or null)")
    deepspeed = deepspeed_config(tcfg.pop("deepspeed", None))
    resume = tcfg.pop("resume_from_checkpoint", None)
    if not isinstance(cfg.get("measure_memory", False), bool):
        raise ConfigError(f"measure_memory={cfg.get('measure_memory')!r} is not valid: give true or false")
    model = to_dataclass(ModelConfig, cfg.model, "model")
    device = check_device(cfg.get("device", "auto"), name)
    if device == "cpu":
        model = replace(model, device="cpu")
    replace(model, dtype=model_dtype)  # range check of trainer.model_dtype
    for key, value in (("dtype", model.dtype), ("trainer.model_dtype", model_dtype)):
        if value == "int8":
            raise ConfigError(f"{key}=int8 is an inference mode (int8 linears have no gradients); train in fp32, "
                              f"bf16 or fp16 and evaluate with dtype=int8")
    return {"experiment": name, "stage": cfg.stage, "model": model, "deepspeed": deepspeed,
            "model_dtype": model_dtype, "resume": resume, "trainer": tcfg, "lora": lora_cfg,
            "device": device, "logger": OmegaConf.to_container(cfg.get("logger") or {"name": "none"}, resolve=True),
            "threads": int(cfg.get("threads", 2)), "config": OmegaConf.to_container(cfg, resolve=True)}


def check_device(device: Any, name: str) -> str:
    """The top-level ``device`` key: one of auto | cuda | cpu; ``cuda`` (a GPU recipe) where no CUDA device is usable
    stops here, before anything loads, instead of training on the CPU for days."""
    check_choice("device", device, ("auto", "cuda", "cpu"))
    if device == "cuda" and not on_cuda():
        raise ConfigError(f"experiment {name!r} runs on CUDA GPUs (device=cuda) but no CUDA device is usable here "
                          f"(torch.cuda.is_available() is false); pass device=cpu to run (or rehearse) it on the CPU")
    return device


def lora_section(tcfg: dict) -> dict | None:
    """Pop ``trainer.lora`` from ``tcfg`` and check its keys: the settings when enabled, else None."""
    lora = dict(tcfg.pop("lora", None) or {})
    bad = sorted(set(lora) - set(LORA_KEYS))
    if bad:
        raise ConfigError(f"unknown key(s) {bad} in trainer.lora; valid: {', '.join(LORA_KEYS)}")
    return lora if lora.get("enabled") else None


def deepspeed_config(name: str | None) -> Path | None:
    if not name:
        return None
    choices = sorted(p.stem for p in (CONF_DIR / "deepspeed").glob("*.json"))
    check_choice("trainer.deepspeed", name, choices, or_null=True)
    return CONF_DIR / "deepspeed" / f"{name}.json"


def known(section: dict, keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid: {', '.join(keys)}")


def target_layers(model: ModelConfig) -> int | None:
    """The target's layer count when its config is at hand without loading weights (else None)."""
    from pardec.models.preflight import read_config_json  # heavy: torch, transformers

    if model.source == "tiny_random":
        return model.layers
    config = read_config_json(model)
    return config.get("num_hidden_layers") if config else None


def check_layers(layers: list[int], model: ModelConfig, key: str) -> None:
    """Every index in ``layers`` is a layer of the target (when its layer count is known without loading it)."""
    n_layers = target_layers(model)
    if n_layers is not None and any(not 0 <= i < n_layers for i in layers):
        raise ConfigError(f"{key}={layers} is out of range: the target {model.name} has layers 0..{n_layers - 1}")

