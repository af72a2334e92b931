"""`CLLMConfig` + `CLLMTrainer`: consistency-LLM training on a transformers Trainer (trl's Config/Trainer pair).

Each step runs one forward with gradient over ``[Jacobi states; teacher answers]`` (one padded batch, so DDP,
DeepSpeed and FSDP see one forward per backward) and one forward without gradient over the consistency
targets (the model's own logits on the fixed point, global, or the next state, local: CLLM's stop-gradient
target). Loss = consistency + ``ar_weight`` * AR (:mod:`pardec.training.losses`).

Normalisation: both terms are sums over valid tokens divided by the count of valid tokens in the whole
gradient-accumulation window (summed over ranks when ``average_tokens_across_devices``), so accumulated
micro-batches give exactly the gradient of one big batch. The consistency and AR losses (token means) are
logged beside the Trainer's ``loss``, ``learning_rate`` and ``grad_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainingArguments

from pardec.training.data import LOSS_TYPES, STATE_SAMPLING
from pardec.training.losses import DISTANCES, ar_token_nll, masked_sum, token_divergence, total_loss


@dataclass
class CLLMConfig(TrainingArguments):
    loss_type: str = field(default="global", metadata={"help": "global (Eq. 4: vs fixed point) | local (Eq. 5)"})
    distance: str = field(default="fkl", metadata={"help": "fkl | rkl | jsd"})
    jsd_beta: float = field(default=0.5, metadata={"help": "generalised JSD mixture weight of the target"})
    ar_weight: float = field(default=10.0, metadata={"help": "omega: total = consistency + omega * AR"})
    max_length: int = field(default=1024, metadata={"help": "longer samples are truncated from the left"})
    state_sampling: str = field(default="random", metadata={"help": "random (one state per block) | all"})

    def __post_init__(self) -> None:
        check_options({k: getattr(self, k) for k in CLLM_KEYS})
        self.remove_unused_columns = False  # our collator's keys are not model arguments
        super().__post_init__()


CLLM_KEYS = ("loss_type", "distance", "jsd_beta", "ar_weight", "max_length", "state_sampling")


def check_options(opts: dict) -> None:
    """Range/choice checks of the CLLM keys (``opts`` may hold only some of them); raises ConfigError."""
    from pardec.config import ConfigError

    for key, choices in (("loss_type", LOSS_TYPES), ("distance", DISTANCES), ("state_sampling", STATE_SAMPLING)):
        if key in opts and opts[key] not in choices:
            raise ConfigError(f"trainer.{key}={opts[key]!r} is not valid; choose one of: {', '.join(choices)}")
    if not 0.0 <= opts.get("jsd_beta", 0.5) <= 1.0:
        raise ConfigError(f"trainer.jsd_beta={opts['jsd_beta']!r} is out of range: it must be in [0, 1]")
    if opts.get("ar_weight", 0.0) < 0:
        raise ConfigError(f"trainer.ar_weight={opts['ar_weight']!r} is out of range: it must be >= 0")
    if opts.get("max_length", 2) < 2:
        raise ConfigError(f"trainer.max_length={opts['max_length']!r} is out of range: it must be >= 2")


def reduced_log_sums(trainer: Trainer) -> list[float]:
    """The trainer's ``_log_sums`` (per-token sums accumulated by ``compute_loss`` since the last log) summed over
    ranks, then reset. Call it from ``log`` on a training log, where every rank is."""
    sums = trainer._log_sums.to(trainer.args.device)  # on CPU: the same tensor, so read it before the reset
    if trainer.args.world_size > 1:
        sums = trainer.accelerator.reduce(sums, reduction="sum")
    values = sums.tolist()
    trainer._log_sums.zero_()
    return values


def log_pair_means(trainer: Trainer, logs: dict[str, float], names: tuple[str, ...]) -> None:
    """Into a training log: ``names[i]`` = sum / count of the i-th (sum, count) pair of the trainer's ``_log_sums``
    (reduced over ranks, then reset: :func:`reduced_log_sums`)."""
    values = reduced_log_sums(trainer)
    for i, name in enumerate(names):
        logs[name] = values[2 * i] / max(values[2 * i + 1], 1.0)


class CLLMTrainer(Trainer):
    args: CLLMConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_is_scaled_for_ga = True  # compute_loss divides by the window's token counts itself
        self._log_sums = torch.zeros(4, dtype=torch.float64)  # consistency sum, count, AR sum, count

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """Prefetch the accumulation window; ``num_items_in_batch`` = [consistency tokens, AR tokens] in it."""
        batches, _ = super().get_batch_samples(epoch_iterator, num_batches, device)
        counts = torch.zeros(2, dtype=torch.long)
        for b in batches:
            counts[0] += b["consistency_mask"].sum()
            counts[1] += (b["ar_labels"][:, 1:] != -100).sum()
        counts = counts.to(device)
        if self.args.average_tokens_across_devices and self.args.world_size > 1:
            counts = self.accelerator.gather(counts[None]).sum(0)
        return batches, counts

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        a = self.args
        cmask, labels = inputs["consistency_mask"], inputs["ar_labels"]  # [B, K], [B, L]
        bsz, k = cmask.shape
        first_label = int((labels != -100).float().argmax(-1).min())
        keep = max(k, labels.shape[1] - first_label + 1)  # logits from the one predicting the first label
        out = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                    position_ids=inputs["position_ids"], logits_to_keep=keep)
        student, ar_logits = out.logits[:bsz, -k:], out.logits[bsz:]  # [B, K, V], [B, keep, V]
        with torch.no_grad():
            target = model(input_ids=inputs["target_ids"], attention_mask=inputs["target_attention_mask"],
                           position_ids=inputs["target_position_ids"], logits_to_keep=k).logits  # [B, K, V]
        c_sum, c_cnt = masked_sum(token_divergence(student, target, a.distance, a.jsd_beta), cmask)
        a_sum, a_cnt = masked_sum(*ar_token_nll(ar_logits, labels[:, -keep:]))
        if num_items_in_batch is None:  # outside training_step: plain token means
            num_items_in_batch = torch.stack([c_cnt, a_cnt])
        norm = num_items_in_batch.to(c_sum.device).clamp(min=1)
        loss = total_loss(c_sum / norm[0], a_sum / norm[1], a.ar_weight)
        if a.average_tokens_across_devices and a.world_size > 1:
            loss = loss * a.world_size  # DDP / DeepSpeed average gradients over ranks; the counts were summed
        if model.training:
            self._log_sums += torch.stack([c_sum, c_cnt, a_sum, a_cnt]).detach().double().cpu()
        return (loss, out) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: every rank is here, so the sums can be reduced
            log_pair_means(self, logs, ("consistency_loss", "ar_loss"))
        super().log(logs, start_time)
