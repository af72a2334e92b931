"""What every experiment kind's training needs, written once (trl's ``_BaseConfig`` / ``_BaseTrainer`` pattern).

* :func:`ranks_for`: this process's :class:`~pardec.config.Ranks` (rank, world size, local rank from the launcher's
  environment, and the barrier) with the trainer's ``ddp_timeout``;
* :class:`BaseConfig`: a ``transformers.TrainingArguments`` subclass; a kind's config adds its own fields and range
  checks (:meth:`BaseConfig.check_values`). Our collators' keys are not model arguments, so ``remove_unused_columns`` is
  always off;
* :class:`BaseTrainer`: a ``transformers.Trainer`` subclass that owns the scaffolding every kind repeated: loss
  normalisation under gradient accumulation (the kind counts what its loss is a mean over, per accumulation
  window, :meth:`BaseTrainer.window_counts`; the counts are summed over ranks and the loss scaled back up by the
  world size, which DDP / DeepSpeed average over), and per-token sums accumulated between logs and reduced over
  ranks (:meth:`BaseTrainer.add_log_sums`, :meth:`BaseTrainer.log_sums`);
* :func:`training_args`: the config from the experiment's ``trainer`` section, built *before* the model loads:
  under DeepSpeed its process group is set up there, which ZeRO-3's ``zero.Init`` inside ``from_pretrained`` needs;
* :func:`apply_lora`, :func:`save_final` (LoRA merged into a fresh copy of the base weights, also under ZeRO-3) and
  :func:`fit` (W&B tracker, train, resume, log history, timing, summary).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainingArguments
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from pardec import on_cuda
from pardec.config import ConfigError, Ranks, check_at_least
from pardec.models.loading import load_model, trainable
from pardec.tracking import Tracker
from pardec.training import checkpoints
from pardec.training.checkpoints import resume_checkpoint


# ------------------------------------------------------------------------------------------- ranks
def arg_default(name: str) -> Any:
    """TrainingArguments' own default of field ``name``."""
    return next(f.default for f in fields(TrainingArguments) if f.name == name)


#: TrainingArguments' own default of ``ddp_timeout`` (seconds)
DDP_TIMEOUT = arg_default("ddp_timeout")


def ranks_for(trainer: dict[str, Any]) -> Ranks:
    """This process's :class:`~pardec.config.Ranks` (from the launcher's environment) with the ``trainer``
    section's ``ddp_timeout`` (TrainingArguments' default where it sets none) as the timeout of the process group
    its barrier creates, which also carries training."""
    timeout = trainer.get("ddp_timeout", DDP_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"trainer.ddp_timeout={timeout!r} must be a positive number of seconds")
    return Ranks.from_env(timeout_s=float(timeout))


# ------------------------------------------------------------------------------------------- config
@dataclass
class BaseConfig(TrainingArguments):
    """TrainingArguments plus ``max_length`` (every kind's samples are cut to it) and a kind's own fields; subclasses
    extend :meth:`check_values` for their ranges."""

    max_length: int = field(default=1024, metadata={"help": "longer samples are truncated from the left"})

    @classmethod
    def check_values(cls, values: dict[str, Any]) -> None:
        """Range / choice checks of the kind's own fields that ``values`` holds (validation checks the config's
        section with it before anything loads); raise ConfigError naming ``trainer.<key>``."""
        n = values.get("max_length", 2)
        check_at_least("trainer.max_length", n, 2, integer=True)

    def __post_init__(self) -> None:
        self.check_values({k: getattr(self, k) for k in self.own_fields()})
        self.remove_unused_columns = False  # our collators' keys are not (all) model arguments
        # pardec's key is trainer.gradient_checkpointing on every transformers release it supports; 5.24 renamed the
        # field activation_checkpointing (the old name warns, and goes in v6): hand the value to the new field
        if hasattr(self, "activation_checkpointing") and self.activation_checkpointing is None:
            for old, new in (("gradient_checkpointing", "activation_checkpointing"),
                             ("gradient_checkpointing_kwargs", "activation_checkpointing_kwargs")):
                if getattr(self, old, None) is not None and hasattr(self, new):
                    setattr(self, new, getattr(self, old))
                    setattr(self, old, None)
        super().__post_init__()

    @classmethod
    def own_fields(cls) -> list[str]:
        """The fields this config adds to TrainingArguments."""
        base = {f.name for f in fields(TrainingArguments)}
        return [f.name for f in fields(cls) if f.init and f.name not in base]


# ------------------------------------------------------------------------------------------- trainer
class BaseTrainer(Trainer):
    """A Trainer whose ``compute_loss`` divides sums by counts over the whole accumulation window (all ranks).

    Subclasses set ``log_sums_size`` (how many float64 sums they accumulate between logs), implement
    :meth:`window_counts` and ``compute_loss`` (dividing by ``num_items_in_batch`` and returning
    :meth:`for_ranks` of the loss), and :meth:`log_metrics` (the logged means from the reduced sums)."""

    log_sums_size = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # compute_loss divides by the window's counts itself
        self._log_sums = torch.zeros(self.log_sums_size, dtype=torch.float64)

    def window_counts(self, batches: list[dict]) -> int | list[int]:
        """What the loss is a mean over, counted in one accumulation window's batches (host tensors)."""
        raise NotImplementedError

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Prefetch the accumulation window; ``num_items_in_batch`` = :meth:`window_counts`, summed over ranks."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = torch.tensor(self.window_counts(batches), dtype=torch.long, device=device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.gather(counts[None]).sum(0)
        return batches, counts

    def for_ranks(self, loss: torch.Tensor) -> torch.Tensor:
        """DDP / DeepSpeed average gradients over ranks while the counts were summed over them: scale back up."""
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            return loss * self.args.world_size
        return loss

    def add_log_sums(self, values: torch.Tensor) -> None:
        """Add this step's sums (``log_sums_size`` values) to those logged next; call only when training."""
        self._log_sums += values.detach().double().cpu()

    def log_sums(self) -> list[float]:
        """The sums since the last log, summed over ranks, then reset. Every rank calls it (from ``log``)."""
        sums = self._log_sums.to(self.args.device)  # on CPU: the same tensor, so read it before the reset
        if self.args.world_size > 1:
            sums = self.accelerator.reduce(sums, reduction="sum")
        values = sums.tolist()
        self._log_sums.zero_()
        return values

    def log_metrics(self, logs: dict[str, float], sums: list[float]) -> None:
        """Add the kind's means to a training log, from :meth:`log_sums`."""

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.log_sums_size:  # a training log: every rank is here, so sums can be reduced
            self.log_metrics(logs, self.log_sums())
        super().log(logs, start_time)

    def _save_checkpoint(self, model, trial) -> None:
        """transformers' save, then (every rank done) rank 0 marks the checkpoint complete (:mod:`.checkpoints`)."""
        checkpoints.begin_save(self, trial)
        super()._save_checkpoint(model, trial)
        checkpoints.end_save(self, trial)


def pair_means(logs: dict[str, float], sums: list[float], names: tuple[str, ...]) -> None:
    """``logs[names[i]]`` = sum / count of the i-th (sum, count) pair of ``sums``."""
    for i, name in enumerate(names):
        logs[name] = sums[2 * i] / max(sums[2 * i + 1], 1.0)


def unwrap(model):
    """The bare module inside DDP / DeepSpeed wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


# ------------------------------------------------------------------------------------------- app helpers
def training_args(config_cls: type, spec, run_dir: Path, **extra):
    """``config_cls`` (a :class:`BaseConfig`) from ``spec.trainer`` with the app's defaults (output_dir = the run
    dir, report_to = the logger, run_name) and ``spec.deepspeed``. Build it before the model loads: with DeepSpeed,
    DeepSpeed's process group is set up here, which ZeRO-3's zero.Init inside from_pretrained needs."""
    defaults = {"output_dir": str(run_dir), "report_to": spec.logger.get("name", "none"), "run_name": run_dir.name}
    if spec.deepspeed:
        single_process_env()
        if spec.device == "cpu" or not on_cuda():
            without_shm_allreduce()
    opts = {**defaults, **spec.trainer, **extra}
    if spec.deepspeed:
        opts = with_min_lr_rate(opts)
    if spec.device == "cpu":  # a GPU recipe run (or rehearsed) on the CPU, as asked: device=cpu
        opts["use_cpu"] = True
    elif opts.get("bf16") and not on_cuda():  # the test that sets trainer.bf16's default
        # bf16 mixed precision on the CPU (autocast; ~1.5x faster CLLM steps on a Zen 4 with avx512_bf16):
        # transformers refuses it unless the run is declared a CPU run
        opts["use_cpu"] = True
    args = config_cls(**opts, deepspeed=str(spec.deepspeed) if spec.deepspeed else None)
    if spec.deepspeed:
        import deepspeed  # heavy: deepspeed

        _ = args.device  # torch.distributed, as the Trainer sets it up
        deepspeed.init_distributed()
    return args


def without_shm_allreduce() -> None:
    """DeepSpeed on a CPU (gloo ranks) uses gloo's allreduce, not its shared-memory one: that one is a C++ op compiled
    on first use, ~75 s of both cores of a 2-core machine, again for every checkout that shares the extension cache
    (the build's include paths differ), for a speed-up of the allreduce that CPU runs (tests, rehearsals) do not
    need. DeepSpeed reads the flag from its cached table of compatible ops (``deepspeed.ops.__compatible_ops__``)."""
    import deepspeed.ops  # heavy: deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def with_min_lr_rate(opts: dict[str, Any]) -> dict[str, Any]:
    """``opts`` with ``lr_scheduler_kwargs.min_lr`` given as ``min_lr_rate`` (``min_lr / learning_rate``), the same
    schedule: transformers computes the rate from ``optimizer.defaults["lr"]``, which DeepSpeed's ZeRO optimizer lacks
    (``AttributeError: 'DeepSpeedZeroOptimizer' object has no attribute 'defaults'``, found by the rehearsal)."""
    kwargs = dict(opts.get("lr_scheduler_kwargs") or {})
    if kwargs.get("min_lr") is None:
        return opts
    lr = opts.get("learning_rate", arg_default("learning_rate"))
    kwargs["min_lr_rate"] = kwargs.pop("min_lr") / lr
    return {**opts, "lr_scheduler_kwargs": kwargs}


def single_process_env() -> None:
    """``python -m train`` without a launcher (one GPU, or this CPU): the environment a launcher would set for one
    process (rank 0 of 1 on a free local port), so DeepSpeed does not fall back to MPI discovery (mpi4py is no
    dependency). Under torchrun / the deepspeed launcher (``WORLD_SIZE`` set) nothing changes."""
    if "WORLD_SIZE" in os.environ:
        return

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"), WORLD_SIZE="1",
                      MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                      MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))


def apply_lora(model, lora: dict, **extra):
    """``model`` wrapped by peft with LoRA adapters as ``trainer.lora`` says (r, alpha, dropout, target_modules);
    ``extra``: more ``peft.LoraConfig`` fields (SDSAT: ``trainable_token_indices``, the new tokens' rows)."""
    from peft import LoraConfig, get_peft_model  # heavy: peft

    return get_peft_model(model, LoraConfig(r=lora.get("r", 16), lora_alpha=lora.get("alpha", 32),
                                            lora_dropout=lora.get("dropout", 0.05), task_type="CAUSAL_LM",
                                            target_modules=lora.get("target_modules"), **extra))


def save_final(trainer, spec, run_dir: Path, final: Path, ranks: Ranks, prepare=None) -> None:
    """Full weights + tokenizer into ``final``; with LoRA the adapter goes to ``<run dir>/adapter`` and rank 0
    merges it into a fresh copy of the base weights (works the same under ZeRO-3, where weights are sharded).
    ``prepare(base)``: called on that fresh LoadedModel before the merge, to give it what the training model had
    beyond the base weights (SDSAT: the adaptive tokens in the tokenizer and the embeddings)."""
    trainer.model.config.use_cache = True  # the Trainer turned it off for training; decoding wants it
    if not spec.lora:
        trainer.save_model(str(final))
        return
    adapter = run_dir / "adapter"
    trainer.save_model(str(adapter))
    if ranks.rank == 0:
        from peft import PeftModel  # heavy: peft

        unset_hf_deepspeed_config()  # training is over: load the base whole, not ZeRO-3 sharded (rank 0 alone)
        base = load_model(trainable(spec.model, spec.model_dtype))
        if prepare is not None:
            prepare(base)
        merged = PeftModel.from_pretrained(base.model, str(adapter)).merge_and_unload()
        merged.save_pretrained(str(final))
        base.tokenizer.save_pretrained(str(final))


def fit(trainer: Trainer, spec, run_dir: Path, ranks: Ranks,
        finish: Callable[[Path, dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """Train (resuming from ``spec.resume``) under the experiment's tracker (rank 0 logs to W&B), then
    ``finish(<run dir>/final, trained)`` (``trained``: ``train_seconds`` and ``steps``; save the artifact, evaluate
    what the kind evaluates after training: its extra summary fields); rank 0 writes ``log_history.json`` (the loss curves the report scripts plot). Returns the
    summary: the Trainer's metrics, ``train_seconds``, ``steps`` and ``finish``'s fields."""
    logger = spec.logger if ranks.rank == 0 else {"name": "none"}  # one W&B run: rank 0's
    with Tracker(logger, run_dir, spec.config, "train", name=run_dir.name) as tracker:
        t0 = time.perf_counter()
        # the newest complete checkpoint (pardec.train.run has checked it before the model loaded)
        resume = resume_checkpoint(spec.resume, run_dir, warn=ranks.rank == 0)
        if resume is not None:  # the start's evaluation is in the checkpoint's log history: not again at its step
            trainer.args.eval_on_start = False
        result = trainer.train(resume_from_checkpoint=resume)
        trained = {"train_seconds": round(time.perf_counter() - t0, 1), "steps": trainer.state.global_step}
        extra = finish(run_dir / "final", trained)
        if ranks.rank == 0:
            (run_dir / "log_history.json").write_text(json.dumps(trainer.state.log_history, indent=1) + "\n")
        summary = {**result.metrics, **trained, **extra}
        tracker.log_summary(summary)
    return summary
