"""`python -m train +experiment=<name> [stage=collect|train|all] [key=value ...]`: CLLM training end to end.

* ``stage=collect``: Jacobi trajectories of ``model`` on ``dataset`` into ``collect.out_dir``
  (default ``${paths.data_dir}/trajectories/<experiment>``); resumable: rerun the same command after a kill.
* ``stage=train``: :class:`~pardec.training.trainer.CLLMTrainer` on ``<train_data>/trajectories.jsonl``
  (``train_data`` defaults to ``collect.out_dir``); the final model (LoRA merged) and tokenizer go to
  ``<run dir>/final``, loadable with ``python -m evaluate +method=jacobi model=local model.path=<run dir>/final``.
* ``stage=all``: both, in one process.

Several processes (``torchrun --nproc_per_node N -m train ...``): collection is sharded by prompt index and
merged by rank 0; training is data parallel (``trainer.deepspeed=zero2|zero3`` for DeepSpeed). All ranks must
agree on the run directory, so ``run_name`` (the last component of ``hydra.run.dir``) is not a timestamp
there but ``torchrun-<first 8 chars of TORCHELASTIC_RUN_ID>``, which torchrun gives every worker of one launch
(``--standalone`` makes it unique per launch); otherwise pass ``run_name=<name>`` yourself. Only rank 0 writes
``.hydra/`` (``hydra.output_subdir`` is null on the others), creates the W&B run and writes the summary;
every rank logs to ``train.log`` / ``train-rank<r>.log``.

Resume a killed training run: rerun with the same ``run_name`` (or ``hydra.run.dir``) and
``trainer.resume_from_checkpoint=true`` (the latest ``checkpoint-*`` in the run dir) or ``=<checkpoint dir>``.

Experiments declare a ``kind`` (default ``cllm``, the stages above). ``kind: draft`` distils a draft model for
speculative decoding: ``stage=generate|train|eval|all`` (see :func:`run_draft`). ``kind: heads`` self-distils
Medusa heads or FIRP projections on the target, with the same stages (see :func:`run_heads`). ``kind: sdsat``
fine-tunes the model itself to guess several tokens from adaptive tokens (SDSAT): ``stage=mask|train|eval|all``
(see :func:`run_sdsat`).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pardec import CONF_DIR
from pardec.config import ConfigError, DatasetConfig, ModelConfig, to_dataclass
from pardec.training.collect import CollectConfig

log = logging.getLogger("pardec.train")

STAGES = ("collect", "train", "all")
#: experiment kinds (the experiment's top-level ``kind`` key) and their stages
KIND_STAGES = {"cllm": STAGES, "draft": ("generate", "train", "eval", "all"),
               "heads": ("generate", "train", "eval", "all"), "sdsat": ("mask", "train", "eval", "all")}
#: keys of the ``trainer`` group handled here; every other key is a CLLMConfig / TrainingArguments field
APP_KEYS = ("lora", "deepspeed", "model_dtype", "resume_from_checkpoint")
LORA_KEYS = ("enabled", "r", "alpha", "dropout", "target_modules")


# ------------------------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Dist:
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)))


def _run_name() -> str:
    d = Dist.from_env()
    if d.world == 1:
        return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    if run_id in ("", "none"):
        raise ConfigError(f"{d.world} processes need one shared run directory: pass run_name=<name> "
                          "(or launch with `torchrun --standalone`, which gives every rank the same run id)")
    return f"torchrun-{run_id[:8]}"


def register_resolvers() -> None:
    resolvers = {
        "pardec_run_name": _run_name,
        "pardec_rank0": lambda value: value if Dist.from_env().rank == 0 else None,
        "pardec_rank_suffix": lambda: "" if Dist.from_env().rank == 0 else f"-rank{Dist.from_env().rank}",
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


# ------------------------------------------------------------------------------------------- config
@dataclass
class _Spec:
    """What every experiment kind's spec holds (each kind adds its own sections)."""

    experiment: str
    stage: str
    model: ModelConfig
    deepspeed: Path | None
    model_dtype: str
    resume: bool | str | None
    logger: dict
    threads: int
    config: dict  # the whole resolved config (for W&B)


def _run_keys(cfg: DictConfig) -> dict:
    """The spec fields every kind reads the same way: the logger, the thread count and the whole config."""
    return {"logger": OmegaConf.to_container(cfg.get("logger") or {"name": "none"}, resolve=True),
            "threads": int(cfg.get("threads", 2)), "config": OmegaConf.to_container(cfg, resolve=True)}


@dataclass
class TrainSpec(_Spec):
    dataset: DatasetConfig
    collect: CollectConfig
    trainer: dict  # CLLMConfig keyword arguments
    lora: dict | None  # LoRA settings when enabled
    train_data: Path


def experiments() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def validate(cfg: DictConfig) -> TrainSpec | DraftSpec | HeadsSpec | SDSATSpec:
    """Check every name and value before anything heavy loads; errors name the key and the valid choices."""
    from pardec.training.trainer import CLLM_KEYS, CLLMConfig, check_options

    name = cfg.get("experiment_name")
    if not name:
        raise ConfigError(f"no experiment given: pass +experiment=<name>; valid experiments: {', '.join(experiments())}")
    kind = cfg.get("kind", "cllm")
    if kind not in KIND_STAGES:
        raise ConfigError(f"kind={kind!r} is not valid; choose one of: {', '.join(KIND_STAGES)}")
    if cfg.stage not in KIND_STAGES[kind]:
        raise ConfigError(f"stage={cfg.stage!r} is not valid for a {kind} experiment; choose one of: "
                          f"{', '.join(KIND_STAGES[kind])}")
    if kind == "draft":
        return validate_draft(cfg, name)
    if kind == "heads":
        return validate_heads(cfg, name)
    if kind == "sdsat":
        return validate_sdsat(cfg, name)
    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    valid = {f.name for f in fields(CLLMConfig) if f.init} | set(APP_KEYS)
    unknown = sorted(set(tcfg) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in trainer; valid: {', '.join(APP_KEYS)}, the CLLM keys "
                          f"({', '.join(CLLM_KEYS)}) and any transformers.TrainingArguments field")
    check_options(tcfg)
    lora = _lora_section(tcfg)
    model, model_dtype, deepspeed, resume = _app_keys(cfg, tcfg)
    return TrainSpec(
        experiment=name, stage=cfg.stage, model=model,
        dataset=to_dataclass(DatasetConfig, cfg.dataset, "dataset"),
        collect=to_dataclass(CollectConfig, cfg.collect, "collect"),
        trainer=tcfg, lora=lora, deepspeed=deepspeed, model_dtype=model_dtype,
        resume=resume, train_data=Path(cfg.train_data),
        **_run_keys(cfg),
    )


def _lora_section(tcfg: dict) -> dict | None:
    """Pop ``trainer.lora`` from ``tcfg`` and check its keys: the settings when enabled, else None."""
    lora = dict(tcfg.pop("lora", None) or {})
    bad = sorted(set(lora) - set(LORA_KEYS))
    if bad:
        raise ConfigError(f"unknown key(s) {bad} in trainer.lora; valid: {', '.join(LORA_KEYS)}")
    return lora if lora.get("enabled") else None


def _app_keys(cfg: DictConfig, tcfg: dict) -> tuple[ModelConfig, str, Path | None, bool | str | None]:
    """Pop the keys of ``trainer`` that pardec.train handles from ``tcfg`` (model_dtype, deepspeed,
    resume_from_checkpoint) and validate them with the model: (model, model_dtype, deepspeed JSON, resume)."""
    model_dtype = tcfg.pop("model_dtype", "fp32")
    deepspeed = _deepspeed_config(tcfg.pop("deepspeed", None))
    resume = tcfg.pop("resume_from_checkpoint", None)
    model = to_dataclass(ModelConfig, cfg.model, "model")
    replace(model, dtype=model_dtype)  # range check of trainer.model_dtype
    return model, model_dtype, deepspeed, resume


def _deepspeed_config(name: str | None) -> Path | None:
    if not name:
        return None
    choices = sorted(p.stem for p in (CONF_DIR / "deepspeed").glob("*.json"))
    if name not in choices:
        raise ConfigError(f"trainer.deepspeed={name!r} is not valid; choose one of: {', '.join(choices)} or null")
    return CONF_DIR / "deepspeed" / f"{name}.json"


# ------------------------------------------------------------------------------------------- stages
def _barrier(d: Dist):
    """A barrier over all ranks (the process group is created on first use), or None for one process."""
    if d.world == 1:
        return None
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(d.local_rank)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.barrier


def run_collect(spec: TrainSpec, d: Dist) -> dict | None:
    from pardec.models.cached import CachedModel
    from pardec.models.loading import load_model
    from pardec.training import shards
    from pardec.training.collect import collect, collection_meta, eos_ids_of, prompts_from_dataset

    # the model (its weights, dtype, chat template choice) and the dataset (source, split, prompt style, extra)
    # fix the prompts and the EOS ids; a resumed collection must match them (checked now, before the model loads)
    identity = {"model": spec.model.identity(), "dataset": asdict(spec.dataset)}
    shards.check_settings(spec.collect.out_dir, collection_meta(spec.collect, identity, set()),
                          spec.collect.overwrite, "collect", "trajectories collected", ignore=("eos_ids",))
    barrier = _barrier(d)
    lm = load_model(spec.model)
    chat = {"auto": lm.chat, "chat": True, "base": False}[spec.dataset.prompt_style]
    prompts = prompts_from_dataset(spec.dataset, lm.tokenizer, chat, spec.collect.max_prompts)
    eos = eos_ids_of(lm.model, lm.tokenizer)
    meta = collection_meta(spec.collect, identity, eos)
    log.info("collecting trajectories of %d prompts into %s (rank %d of %d)", len(prompts), spec.collect.out_dir,
             d.rank, d.world)
    stats = collect(spec.collect, CachedModel(lm.model), eos, prompts, meta, d.rank, d.world, barrier)
    if stats is not None:
        log.info("trajectories: %s", json.dumps(stats))
    return stats


def run_train(spec: TrainSpec, run_dir: Path, d: Dist) -> dict[str, Any]:
    from pardec.models.loading import load_model
    from pardec.tracking import Tracker
    from pardec.training.data import CLLMCollator, TrajectoryDataset
    from pardec.training.trainer import CLLMConfig, CLLMTrainer
    from pardec.training.trajectories import load_trajectories

    stats_file = spec.train_data / "stats.json"
    if stats_file.is_file() and not json.loads(stats_file.read_text()).get("complete", True):
        raise ConfigError(f"{spec.train_data} holds an unfinished collection ({stats_file}); "
                          f"finish it first: rerun with stage=collect")
    args = training_args(CLLMConfig, spec, run_dir)  # before the model, as ZeRO-3 requires
    records = load_trajectories(spec.train_data)
    if args.proxy_records >= len(records):
        raise ConfigError(f"trainer.proxy_records={args.proxy_records} leaves nothing to train on: {spec.train_data} "
                          f"holds {len(records)} records")
    held = records[len(records) - args.proxy_records :] if args.proxy_records else []  # the last ones, by index
    records = records[: len(records) - len(held)]
    lm = load_model(replace(spec.model, device="cpu", dtype=spec.model_dtype))  # the Trainer places it
    model = apply_lora(lm.model, spec.lora) if spec.lora else lm.model
    ds = TrajectoryDataset(records, args.loss_type, args.state_sampling, args.max_length, args.seed,
                           args.states_per_sample)
    proxy = TrajectoryDataset(held, "global", "all", args.max_length) if held else None
    trainer = CLLMTrainer(model=model, args=args, train_dataset=ds, eval_dataset=proxy,
                          data_collator=CLLMCollator(lm.tokenizer.pad_token_id), processing_class=lm.tokenizer)
    logger = spec.logger if d.rank == 0 else {"name": "none"}  # one W&B run: rank 0's
    with Tracker(logger, run_dir, spec.config, "train", name=run_dir.name) as tracker:
        result = trainer.train(resume_from_checkpoint=spec.resume)
        final_proxy = trainer.evaluate() if proxy is not None else {}  # the proxy after the last step
        if d.rank == 0:  # the loss and proxy curves (scripts/cllm_report.py plots them)
            (run_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
        final = run_dir / "final"
        save_final(trainer, spec, run_dir, final, d)
        summary = {**result.metrics, **final_proxy, "samples": len(ds), "truncated_samples": ds.n_truncated,
                   "records": len(records), "proxy_records": len(held), "final_model": str(final)}
        tracker.log_summary(summary)
    return summary


def training_args(config_cls: type, spec, run_dir: Path, **extra):
    """``config_cls`` (a TrainingArguments subclass) from ``spec.trainer`` with the app's defaults (output_dir = the
    run dir, report_to = the logger, run_name) and ``spec.deepspeed``. Build it before the model loads: with
    DeepSpeed, DeepSpeed's process group is set up here, which ZeRO-3's zero.Init inside from_pretrained needs."""
    defaults = {"output_dir": str(run_dir), "report_to": spec.logger.get("name", "none"), "run_name": run_dir.name}
    args = config_cls(**{**defaults, **spec.trainer}, **extra,
                      deepspeed=str(spec.deepspeed) if spec.deepspeed else None)
    if spec.deepspeed:
        import deepspeed

        _ = args.device  # torch.distributed, as the Trainer sets it up
        deepspeed.init_distributed()
    return args


def apply_lora(model, lora: dict, **extra):
    """``model`` wrapped by peft with LoRA adapters as ``trainer.lora`` says (r, alpha, dropout, target_modules);
    ``extra``: more ``peft.LoraConfig`` fields (SDSAT: ``trainable_token_indices``, the new tokens' rows)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=lora.get("r", 16), lora_alpha=lora.get("alpha", 32),
                                            lora_dropout=lora.get("dropout", 0.05), task_type="CAUSAL_LM",
                                            target_modules=lora.get("target_modules"), **extra))


def save_final(trainer, spec, run_dir: Path, final: Path, d: Dist, prepare=None) -> None:
    """Full weights + tokenizer into ``final``; with LoRA the adapter goes to ``<run dir>/adapter`` and rank 0
    merges it into a fresh copy of the base weights (works the same under ZeRO-3, where weights are sharded).
    ``prepare(base)``: called on that fresh LoadedModel before the merge, to give it what the training model had
    beyond the base weights (SDSAT: the adaptive tokens in the tokenizer and the embeddings)."""
    from pardec.models.loading import load_model

    trainer.model.config.use_cache = True  # the Trainer turned it off for training; decoding wants it
    if not spec.lora:
        trainer.save_model(str(final))
        return
    adapter = run_dir / "adapter"
    trainer.save_model(str(adapter))
    if d.rank == 0:
        from peft import PeftModel
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()  # training is over: load the base whole, not ZeRO-3 sharded (rank 0 alone)
        base = load_model(replace(spec.model, device="cpu", dtype=spec.model_dtype))
        if prepare is not None:
            prepare(base)
        merged = PeftModel.from_pretrained(base.model, str(adapter)).merge_and_unload()
        merged.save_pretrained(str(final))
        base.tokenizer.save_pretrained(str(final))


# ------------------------------------------------------------------------------------------- kind: draft
#: keys of the ``draft`` section (the draft's shape)
DRAFT_KEYS = ("layers", "vocab_size", "freeze_embeddings")


@dataclass
class DraftSpec(_Spec):
    layers: list[int]
    vocab_size: int
    freeze_embeddings: bool
    loss: str
    gen: Any  # pardec.training.distill.GenerateConfig: the training completions
    eval_gen: list  # one GenerateConfig per held-out source, each with its own out_dir
    eval_context: int
    eval_repeats: int
    trainer: dict  # DistillConfig keyword arguments


def validate_draft(cfg: DictConfig, name: str) -> DraftSpec:
    """Check a ``kind: draft`` config before anything heavy loads (the layer range is checked against the
    target's config when it can be read without loading weights, else when the target loads)."""
    from pardec.training.distill import generate_config
    from pardec.training.distill_trainer import LOSSES, DistillConfig

    for key in ("draft", "distill", "eval"):
        if not isinstance(cfg.get(key), DictConfig):
            raise ConfigError(f"a draft experiment needs a `{key}` section (see conf/experiment/draft_tiny.yaml)")
    draft = OmegaConf.to_container(cfg.draft, resolve=True)
    _known(draft, DRAFT_KEYS, "draft")
    layers = draft.get("layers")
    if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
        raise ConfigError(f"draft.layers={layers!r} is not valid: give a non-empty list of target layer indices")
    vocab_size = draft.get("vocab_size", 8192)
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ConfigError(f"draft.vocab_size={vocab_size!r} is out of range: it must be an integer >= 2")
    distill = OmegaConf.to_container(cfg.distill, resolve=True)
    loss = distill.pop("loss", "fkl")
    gen = generate_config(distill, "distill")
    ev = OmegaConf.to_container(cfg["eval"], resolve=True)
    context, repeats = int(ev.pop("context", 200)), int(ev.pop("repeats", 20))
    if context < 2 or repeats < 1:
        raise ConfigError(f"eval.context={context} / eval.repeats={repeats} out of range: need >= 2 / >= 1")
    eval_gen = _eval_sources(ev)
    tcfg = _trainer_section(cfg, DistillConfig, "loss", "the loss is distill.loss")
    if loss not in LOSSES:
        raise ConfigError(f"distill.loss={loss!r} is not valid; choose one of: {', '.join(LOSSES)}")
    model, model_dtype, deepspeed, resume = _app_keys(cfg, tcfg)
    n_layers = _target_layers(model)
    if n_layers is not None and any(not 0 <= i < n_layers for i in layers):
        raise ConfigError(f"draft.layers={layers} is out of range: the target {model.name} has layers "
                          f"0..{n_layers - 1}")
    return DraftSpec(
        experiment=name, stage=cfg.stage, model=model, layers=layers, vocab_size=vocab_size,
        freeze_embeddings=bool(draft.get("freeze_embeddings", True)), loss=loss, gen=gen, eval_gen=eval_gen,
        eval_context=context, eval_repeats=repeats, trainer=tcfg, deepspeed=deepspeed, model_dtype=model_dtype,
        resume=resume, **_run_keys(cfg),
    )


def _eval_sources(ev: dict) -> list:
    """The ``eval`` generation section of a draft / heads experiment: one GenerateConfig per held-out source, each
    in its own ``<eval.out_dir>/<dataset>``."""
    from pardec.training.distill import generate_config

    eval_all = generate_config(ev, "eval")
    return [replace(eval_all, sources=[s], out_dir=str(Path(eval_all.out_dir) / s.dataset.name))
            for s in eval_all.sources]


def _trainer_section(cfg: DictConfig, config_cls: type, elsewhere: str | None, hint: str,
                     lora: bool = False) -> dict:
    """The ``trainer`` section of a draft / heads / sdsat experiment: ``config_cls`` (a TrainingArguments subclass)
    fields but ``elsewhere`` (a key configured in another section, as ``hint`` says) plus the app's keys (``lora``
    only where ``lora``)."""
    from transformers import TrainingArguments

    tcfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    app = [k for k in APP_KEYS if lora or k != "lora"]
    own = sorted({f.name for f in fields(config_cls) if f.init} - {f.name for f in fields(TrainingArguments)}
                 - {elsewhere})
    valid = ({f.name for f in fields(config_cls) if f.init} - {elsewhere}) | set(app)
    unknown = sorted(set(tcfg) - valid)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in trainer; valid: {', '.join(app + own)} and any "
                          f"transformers.TrainingArguments field ({hint})")
    return tcfg


def _known(section: dict, keys: tuple[str, ...], where: str) -> None:
    unknown = sorted(set(section) - set(keys))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; valid: {', '.join(keys)}")


def _target_layers(model: ModelConfig) -> int | None:
    """The target's layer count when its config is at hand without loading weights (else None)."""
    from pardec.models.loading import read_config_json

    if model.source == "tiny_random":
        return model.layers
    config = read_config_json(model)
    return config.get("num_hidden_layers") if config else None


def run_draft(spec: DraftSpec, run_dir: Path, d: Dist) -> dict[str, Any]:
    """The stages of a draft experiment; returns (and on rank 0 writes) ``train_summary.json``.

    * ``generate``: the target's greedy completions of ``distill.sources`` into ``distill.out_dir``;
    * ``train``: :class:`~pardec.training.distill_trainer.DistillTrainer`; the draft goes to ``<run dir>/final``;
    * ``eval`` (rank 0): completions of the held-out ``eval.sources`` (``<eval.out_dir>/<dataset>``), top-1
      agreement of draft vs target on them and the forward cost ratio, into ``<run dir>/draft_eval.json``.
    """
    from pardec.training import distill_trainer as dt

    summary: dict[str, Any] = {"experiment": spec.experiment, "kind": "draft", "stage": spec.stage,
                               "run_dir": str(run_dir)}
    if spec.stage in ("generate", "all"):
        summary["generate"] = _generate_stage(spec, d)
    if spec.stage in ("train", "all"):
        summary["train"] = dt.train_draft(spec, run_dir, d.rank)
    if spec.stage in ("eval", "all") and d.rank == 0:
        summary["eval"] = dt.evaluate_draft(spec, run_dir)
        print(json.dumps(summary["eval"], indent=2))
    if d.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _generate_stage(spec: DraftSpec | HeadsSpec, d: Dist) -> dict | None:
    """The generate stage of a draft / heads experiment: the target's greedy completions of ``distill.sources``."""
    from pardec.models.loading import load_model
    from pardec.training.distill import run_generation

    barrier = _barrier(d)  # first: it picks this rank's GPU
    lm = load_model(spec.model)
    stats = run_generation(spec.gen, lm, d.rank, d.world, barrier, "distill")
    if stats:
        log.info("completions: %s", json.dumps(stats))
    return stats


# ------------------------------------------------------------------------------------------- kind: heads
#: keys of the ``drafter`` section per drafter kind
HEADS_KEYS = {"medusa": ("kind", "num_heads", "num_blocks", "head_decay"), "firp": ("kind", "layers")}
#: keys of the ``eval`` section of a heads experiment besides the generation keys
HEADS_EVAL_KEYS = ("topk", "budgets")


@dataclass
class HeadsSpec(_Spec):
    drafter: dict  # kind, num_heads, num_blocks (medusa) / layers (firp)
    head_decay: float
    gen: Any  # pardec.training.distill.GenerateConfig: the training completions
    eval_gen: list  # one GenerateConfig per held-out source, each with its own out_dir
    topk: int
    budgets: list[int]
    trainer: dict  # HeadsConfig keyword arguments


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_heads(cfg: DictConfig, name: str) -> HeadsSpec:
    """Check a ``kind: heads`` config before anything heavy loads (FIRP layers against the target's layer count
    when its config can be read without loading weights, else when the drafter is built)."""
    from pardec.training.distill import generate_config
    from pardec.training.heads_trainer import HeadsConfig

    for key in ("drafter", "distill", "eval"):
        if not isinstance(cfg.get(key), DictConfig):
            raise ConfigError(f"a heads experiment needs a `{key}` section (see conf/experiment/medusa_tiny.yaml)")
    drafter = OmegaConf.to_container(cfg.drafter, resolve=True)
    kind = drafter.get("kind")
    if kind not in HEADS_KEYS:
        raise ConfigError(f"drafter.kind={kind!r} is not valid; choose one of: {', '.join(HEADS_KEYS)}")
    _known(drafter, HEADS_KEYS[kind], f"drafter (kind {kind})")
    head_decay = 1.0
    if kind == "medusa":
        for key in ("num_heads", "num_blocks"):
            v = drafter.setdefault(key, 3 if key == "num_heads" else 1)
            if not _int(v) or v < 1:
                raise ConfigError(f"drafter.{key}={v!r} is out of range: it must be an integer >= 1")
        head_decay = drafter.pop("head_decay", 0.8)
        if isinstance(head_decay, bool) or not isinstance(head_decay, (int, float)) or not 0 < head_decay <= 1:
            raise ConfigError(f"drafter.head_decay={head_decay!r} is out of range: it must be a number in (0, 1]")
        head_decay = float(head_decay)
    else:
        layers = drafter.get("layers")
        if not isinstance(layers, list) or not layers or not all(_int(i) for i in layers):
            raise ConfigError(f"drafter.layers={layers!r} is not valid: give a non-empty list of target layer "
                              f"indices (one per pseudo step)")
        if layers != sorted(layers):
            raise ConfigError(f"drafter.layers={layers} is not valid: the layers must be nondecreasing")
    distill = OmegaConf.to_container(cfg.distill, resolve=True)
    gen = generate_config(distill, "distill")
    ev = OmegaConf.to_container(cfg["eval"], resolve=True)
    topk, budgets = ev.pop("topk", 10), ev.pop("budgets", [16, 32, 63])
    if not _int(topk) or topk < 1:
        raise ConfigError(f"eval.topk={topk!r} is out of range: it must be an integer >= 1")
    if not isinstance(budgets, list) or not budgets or not all(_int(b) and b >= 1 for b in budgets):
        raise ConfigError(f"eval.budgets={budgets!r} is not valid: give a non-empty list of integers >= 1 "
                          f"(tree sizes)")
    eval_gen = _eval_sources(ev)
    tcfg = _trainer_section(cfg, HeadsConfig, "head_decay", "head_decay is drafter.head_decay")
    model, model_dtype, deepspeed, resume = _app_keys(cfg, tcfg)
    if kind == "firp":
        n_layers = _target_layers(model)
        if n_layers is not None and any(not 0 <= i < n_layers for i in drafter["layers"]):
            raise ConfigError(f"drafter.layers={drafter['layers']} is out of range: the target {model.name} has "
                              f"layers 0..{n_layers - 1}")
    return HeadsSpec(
        experiment=name, stage=cfg.stage, model=model, drafter=drafter, head_decay=head_decay, gen=gen,
        eval_gen=eval_gen, topk=topk, budgets=budgets, trainer=tcfg, deepspeed=deepspeed, model_dtype=model_dtype,
        resume=resume, **_run_keys(cfg),
    )


def run_heads(spec: HeadsSpec, run_dir: Path, d: Dist) -> dict[str, Any]:
    """The stages of a heads experiment; returns (and on rank 0 writes) ``train_summary.json``.

    * ``generate``: the target's greedy completions of ``distill.sources`` into ``distill.out_dir`` (as kind draft;
      the SmolLM2 experiments share draft_smollm2's);
    * ``train``: :class:`~pardec.training.heads_trainer.HeadsTrainer`; the drafter goes to ``<run dir>/final``;
    * ``eval`` (rank 0): completions of the held-out ``eval.sources`` (``<eval.out_dir>/<dataset>``), per-depth
      rank accuracies of the drafter's candidates, trees for ``eval.budgets`` in ``<run dir>/final/trees``, all
      summarised in ``<run dir>/heads_eval.json``.
    """
    from pardec.training import heads_trainer as ht

    summary: dict[str, Any] = {"experiment": spec.experiment, "kind": "heads", "drafter": spec.drafter["kind"],
                               "stage": spec.stage, "run_dir": str(run_dir)}
    if spec.stage in ("generate", "all"):
        summary["generate"] = _generate_stage(spec, d)
    if spec.stage in ("train", "all"):
        summary["train"] = ht.train_heads(spec, run_dir, d.rank)
    if spec.stage in ("eval", "all") and d.rank == 0:
        result = ht.evaluate_heads(spec, run_dir)
        summary["eval"] = {k: result[k] for k in ("positions", "parameters", "trees")}
        summary["eval"]["topk_accuracy"] = result["overall"]["topk_accuracy"]
        print(json.dumps(summary["eval"], indent=2))
    if d.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


# ------------------------------------------------------------------------------------------- kind: sdsat
#: keys of the ``adaptive`` and ``eval`` sections of an sdsat experiment
ADAPTIVE_KEYS = ("max_span", "diverse")
SDSAT_EVAL_KEYS = ("sources", "max_docs", "stride", "k_max")


@dataclass
class SDSATSpec(_Spec):
    max_span: int  # L: adaptive windows of 1..L tokens
    diverse: bool  # SDSAT-D: one adaptive token per offset
    mask: Any  # pardec.training.masked.MaskConfig (its max_span / diverse are the adaptive section's)
    eval_sources: list  # held-out sources, in masked.parse_sources form
    eval_max_docs: int | None  # sequences per held-out source
    eval_stride: int  # anchors every stride positions
    eval_k_max: int  # adaptive slots per anchor (depths 1..k_max)
    trainer: dict  # SDSATConfig keyword arguments
    lora: dict | None  # LoRA settings when enabled


def _int_at_least(value: Any, low: int, key: str, or_null: bool = False) -> None:
    if or_null and value is None:
        return
    if not _int(value) or value < low:
        raise ConfigError(f"{key}={value!r} is out of range: it must be an integer >= {low}"
                          + (" or null" if or_null else ""))


def validate_sdsat(cfg: DictConfig, name: str) -> SDSATSpec:
    """Check a ``kind: sdsat`` config before anything heavy loads. ``stage=train`` without ``mask`` also checks the
    masked corpus in ``mask.out_dir`` now (finished, this schema version, built with these settings)."""
    from pardec.training import masked as mk
    from pardec.training.sdsat_trainer import SDSATConfig, check_options

    for key in ("adaptive", "mask", "eval"):
        if not isinstance(cfg.get(key), DictConfig):
            raise ConfigError(f"an sdsat experiment needs an `{key}` section (see conf/experiment/sdsat_tiny.yaml)")
    adaptive = OmegaConf.to_container(cfg.adaptive, resolve=True)
    _known(adaptive, ADAPTIVE_KEYS, "adaptive")
    max_span, diverse = adaptive.get("max_span", 5), adaptive.get("diverse", False)
    _int_at_least(max_span, 1, "adaptive.max_span")
    if not isinstance(diverse, bool):
        raise ConfigError(f"adaptive.diverse={diverse!r} is not valid: it must be true or false")
    mask = OmegaConf.to_container(cfg.mask, resolve=True)
    moved = sorted(set(mask) & set(ADAPTIVE_KEYS))
    if moved:
        raise ConfigError(f"mask.{moved[0]} is not a mask key here: set adaptive.{moved[0]} (the tokens and the "
                          f"windows share it)")
    mask_cfg = to_dataclass(mk.MaskConfig, {**mask, "max_span": max_span, "diverse": diverse}, "mask")
    if not mask_cfg.sources:
        raise ConfigError(f"mask.sources is empty: list at least one of {mk.SOURCE_FORMS}")
    ev = OmegaConf.to_container(cfg["eval"], resolve=True)
    _known(ev, SDSAT_EVAL_KEYS, "eval")
    eval_sources = mk.parse_sources(ev.get("sources"), "eval.sources")
    if not eval_sources:
        raise ConfigError(f"eval.sources is empty: list at least one of {mk.SOURCE_FORMS}")
    max_docs, stride, k_max = ev.get("max_docs"), ev.get("stride", 8), ev.get("k_max", max_span)
    _int_at_least(max_docs, 1, "eval.max_docs", or_null=True)
    _int_at_least(stride, 1, "eval.stride")
    _int_at_least(k_max, 1, "eval.k_max")
    if diverse and k_max > max_span:
        raise ConfigError(f"eval.k_max={k_max} is out of range: diverse adaptive tokens exist for depths "
                          f"1..adaptive.max_span={max_span} only")
    tcfg = _trainer_section(cfg, SDSATConfig, None, "w of Eq. 9 is mask_weight", lora=True)
    check_options(tcfg)
    lora = _lora_section(tcfg)
    model, model_dtype, deepspeed, resume = _app_keys(cfg, tcfg)
    if cfg.stage == "train":
        _check_masked(mask_cfg)
    return SDSATSpec(
        experiment=name, stage=cfg.stage, model=model, max_span=max_span, diverse=diverse, mask=mask_cfg,
        eval_sources=eval_sources, eval_max_docs=max_docs, eval_stride=stride, eval_k_max=k_max, trainer=tcfg,
        lora=lora, deepspeed=deepspeed, model_dtype=model_dtype, resume=resume,
        **_run_keys(cfg),
    )


def _check_masked(mask_cfg) -> None:
    """The masked corpus the train stage will read: finished, of this schema version (masked.check_masked_dir) and
    built with the configured masking settings (the model identity and the adaptive ids are checked when the model
    has its tokens)."""
    from pardec.config import settings_diff
    from pardec.training import masked as mk

    meta = mk.check_masked_dir(mask_cfg.out_dir)
    want = mk.mask_meta(mask_cfg, meta.get("model"), mk.adaptive_tokens(mask_cfg.max_span, mask_cfg.diverse),
                        meta.get("adaptive_ids", []))
    diff = settings_diff(meta, json.loads(json.dumps(want)))
    if diff:
        raise ConfigError(f"{mask_cfg.out_dir} holds a masked corpus built with other settings ({'; '.join(diff)}); "
                          f"rebuild it with stage=mask mask.overwrite=true, or use another mask.out_dir")


def run_sdsat(spec: SDSATSpec, run_dir: Path, d: Dist) -> dict[str, Any]:
    """The stages of an sdsat experiment; returns (and on rank 0 writes) ``train_summary.json``.

    * ``mask``: the masked corpus of ``mask.sources`` in ``mask.out_dir`` (:func:`pardec.training.masked.
      run_masking`; tokenizer only, no weights; resumable, sharded over ranks);
    * ``train``: :class:`~pardec.training.sdsat_trainer.SDSATTrainer` (Eq. 9, full fine-tuning or LoRA); the model
      with its adaptive tokens goes to ``<run dir>/final``, loadable with ``python -m evaluate +method=sdsat
      model=local model.path=<run dir>/final``;
    * ``eval`` (rank 0): held-out perplexity (base vs trained) and per-depth adaptive-token accuracy on
      ``eval.sources``, into ``<run dir>/sdsat_eval.json``.
    """
    from pardec.training import sdsat_trainer as st

    summary: dict[str, Any] = {"experiment": spec.experiment, "kind": "sdsat", "stage": spec.stage,
                               "run_dir": str(run_dir)}
    if spec.stage in ("mask", "all"):
        summary["mask"] = _mask_stage(spec, d)
    if spec.stage in ("train", "all"):
        if spec.stage == "all":
            _check_masked(spec.mask)  # what stage=train checks in validate
        summary["train"] = st.train_sdsat(spec, run_dir, d.rank)
    if spec.stage in ("eval", "all") and d.rank == 0:
        result = st.evaluate_sdsat(spec, run_dir)
        summary["eval"] = {k: result["overall"][k] for k in ("tokens", "ppl_base", "ppl_trained", "ppl_ratio")}
        adaptive = result["overall"]["adaptive"]
        summary["eval"].update(accuracy=adaptive["accuracy"],
                               expected_tokens_per_loop=adaptive["expected_tokens_per_loop"])
        print(json.dumps(summary["eval"], indent=2))
    if d.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def _mask_stage(spec: SDSATSpec, d: Dist) -> dict | None:
    from pardec.models.loading import load_tokenizer_only
    from pardec.training.masked import run_masking

    barrier = _barrier(d)
    tok = load_tokenizer_only(spec.model)
    chat = bool(spec.model.chat) if spec.model.chat is not None else bool(getattr(tok, "chat_template", None))
    stats = run_masking(spec.mask, tok, spec.model.identity(), d.rank, d.world, barrier, chat=chat)
    if barrier:
        barrier()  # rank 0 has merged: every rank may read masked.jsonl now
    if stats:
        log.info("masked corpus: %s", json.dumps(stats))
    return stats


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run the stages ``cfg.stage`` names; returns (and on rank 0 writes) ``train_summary.json``."""
    import torch

    spec = validate(cfg)
    d = Dist.from_env()
    torch.set_num_threads(spec.threads)
    if isinstance(spec, DraftSpec):
        return run_draft(spec, run_dir, d)
    if isinstance(spec, HeadsSpec):
        return run_heads(spec, run_dir, d)
    if isinstance(spec, SDSATSpec):
        return run_sdsat(spec, run_dir, d)
    summary: dict[str, Any] = {"experiment": spec.experiment, "stage": spec.stage, "run_dir": str(run_dir)}
    if spec.stage in ("collect", "all"):
        summary["collect"] = run_collect(spec, d)
    if spec.stage in ("train", "all"):
        summary["train"] = run_train(spec, run_dir, d)
    if d.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "train_summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from pardec.config import check_overrides, exit_with_error

    try:
        check_overrides(sys.argv[1:], "train")
    except ConfigError as e:
        exit_with_error(e)

    @hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        try:
            run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ConfigError, KeyError, FileNotFoundError, FileExistsError, ValueError) as e:
            exit_with_error(e)

    _app()
