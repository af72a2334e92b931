"""`CLLMConfig` + `CLLMTrainer`: consistency-LLM training on a transformers Trainer (trl's Config/Trainer pair).

Each step runs one forward over packed samples (:mod:`pardec.training.cllm.data`): per (prompt, block) the teacher
answer (AR row) and several Jacobi states of the block as segments under a block-causal 4D mask. The AR row's
logits give the AR loss and, detached, the global consistency target (CLLM's stop-gradient target: the model's
own logits on the fixed point), so there is no separate target forward and no prefix is computed twice (the
local loss packs its next-state targets as segments too, detached). Only the logits that count go through the
LM head. Loss = consistency + ``ar_weight`` * AR (:mod:`pardec.training.losses`).

Monitoring: with held-out trajectories (``eval_dataset``), :meth:`CLLMTrainer.evaluate` logs a teacher-forced
fast-forward proxy (:func:`fast_forward_proxy`) to the console and W&B at every evaluation, long before a
decoding benchmark could say whether a run is working. The teacher-forced proxy scores one step from every collected
state, states the trained model may never visit, and overstated the test fast-forward more the more the model was
trained (2.27 against 1.75 on the test problems for a 480-prompt run); with :class:`DecodingProxy` the same
evaluation also decodes the held-out records' prompts with ``jacobi`` from random guesses, as the benchmark does
(``ff_decode``: its mean fast-forward per prompt).

Normalisation: both terms are sums over valid tokens divided by the count of valid tokens in the whole
gradient-accumulation window (summed over ranks when ``average_tokens_across_devices``), so accumulated
micro-batches give exactly the gradient of one big batch. The consistency and AR losses (token means) are
logged beside the Trainer's ``loss``, ``learning_rate`` and ``grad_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainerCallback

from pardec.config import ConfigError, check_choice
from pardec.models.masks import additive_mask
from pardec.training.base import BaseConfig, BaseTrainer, pair_means
from pardec.training.cllm.data import (
    AR_TAILS,
    LOSS_TYPES,
    STATE_SAMPLING,
    TrajectoryDataset,
    packed_attention,
)
from pardec.training.cllm.evaluate import jacobi_runs, mean_fast_forward
from pardec.training.losses import DISTANCES, IGNORE_INDEX, ce_sum, token_divergence, total_loss


@dataclass
class CLLMConfig(BaseConfig):
    loss_type: str = field(default="global", metadata={"help": "global (Eq. 4: vs fixed point) | local (Eq. 5)"})
    distance: str = field(default="fkl", metadata={"help": "fkl | rkl | jsd"})
    jsd_beta: float = field(default=0.5, metadata={"help": "generalised JSD mixture weight of the target"})
    ar_weight: float = field(default=10.0, metadata={"help": "omega: total = consistency + omega * AR"})
    # the official trainer's AR loss: transformers' LabelSmoother(epsilon=0.1) (cllm/cllm_trainer_global.py)
    ar_label_smoothing: float = field(default=0.1, metadata={"help": "epsilon of the AR loss's label smoothing"})
    state_sampling: str = field(default="random", metadata={"help": "random (states_per_sample per block, "
                                                                    "drawn anew each epoch) | all"})
    states_per_sample: int = field(default=1, metadata={"help": "Jacobi states packed with a block's AR row"})
    ar_tail: str = field(default="every_block", metadata={"help": "which samples of a record hold the answer past "
                                                                  "the collected blocks (ar_answer=whole): "
                                                                  "every_block (official) | last_block"})
    proxy_records: int = field(default=0, metadata={"help": "trajectory records held out for the fast-forward "
                                                            "proxy (evaluated every eval_steps; 0: none)"})
    proxy_decode: bool = field(default=True, metadata={"help": "with proxy_records: also decode the held-out "
                                                               "prompts with jacobi at every evaluation (ff_decode)"})

    @classmethod
    def check_values(cls, opts: dict) -> None:
        """Range/choice checks of the CLLM keys (``opts`` may hold only some of them); raises ConfigError."""
        super().check_values(opts)
        for key, choices in (("loss_type", LOSS_TYPES), ("distance", DISTANCES), ("state_sampling", STATE_SAMPLING),
                             ("ar_tail", AR_TAILS)):
            if key in opts:
                check_choice(f"trainer.{key}", opts[key], choices)
        if not 0.0 <= opts.get("jsd_beta", 0.5) <= 1.0:
            raise ConfigError(f"trainer.jsd_beta={opts['jsd_beta']!r} is out of range: it must be in [0, 1]")
        if not 0.0 <= opts.get("ar_label_smoothing", 0.0) < 1.0:
            raise ConfigError(f"trainer.ar_label_smoothing={opts['ar_label_smoothing']!r} is out of range: it must "
                              f"be in [0, 1)")
        if opts.get("ar_weight", 0.0) < 0:
            raise ConfigError(f"trainer.ar_weight={opts['ar_weight']!r} is out of range: it must be >= 0")
        for key in ("states_per_sample", "proxy_records"):
            low = 1 if key == "states_per_sample" else 0
            if key in opts and opts[key] < low:
                raise ConfigError(f"trainer.{key}={opts[key]!r} is out of range: it must be >= {low}")


class _EpochStates(TrainerCallback):
    """Tell the training set which epoch begins, so that it draws that epoch's states (resumes included: the
    epoch is the integer part of the trainer's progress)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.dataset.set_epoch(int(state.epoch + 1e-6))


def packed_forward(model, inputs: dict, keep: torch.Tensor):
    """Logits [B, len(keep), V] of the packed batch ``inputs`` at positions ``keep`` (one forward, 4D mask)."""
    dtype = next(model.parameters()).dtype
    mask = additive_mask(packed_attention(inputs["segment"], inputs["context"]), dtype)
    return model(input_ids=inputs["input_ids"], attention_mask=mask, position_ids=inputs["position_ids"],
                 logits_to_keep=keep).logits


class CLLMTrainer(BaseTrainer):
    args: CLLMConfig
    log_sums_size = 4  # consistency sum, count, AR sum, count

    def __init__(self, *args, decoding_proxy: DecodingProxy | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoding_proxy = decoding_proxy
        if hasattr(self.train_dataset, "set_epoch"):
            self.add_callback(_EpochStates(self.train_dataset))

    def window_counts(self, batches: list[dict]) -> list[int]:
        """[consistency positions, AR tokens] in the accumulation window."""
        return [sum(b["pairs"].shape[0] for b in batches),
                sum(int((b["ar_targets"] != IGNORE_INDEX).sum()) for b in batches)]

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        a = self.args
        targets, pairs = inputs["ar_targets"], inputs["pairs"]  # [B, T], [M, 3]
        need = (targets != IGNORE_INDEX).any(0)
        need[pairs[:, 1]] = True
        need[pairs[:, 2]] = True
        keep = need.nonzero()[:, 0]  # only these positions go through the LM head
        at = torch.full_like(need, -1, dtype=torch.long)
        at[keep] = torch.arange(len(keep), device=keep.device)
        logits = packed_forward(model, inputs, keep)  # [B, K, V]
        kept = targets[:, keep]
        a_sum, a_cnt = ce_sum(logits, kept.clamp(min=0), kept != IGNORE_INDEX, a.ar_label_smoothing)
        student = logits[pairs[:, 0], at[pairs[:, 1]]]  # [M, V]
        target = logits[pairs[:, 0], at[pairs[:, 2]]].detach()  # the model's own logits: stop-gradient target
        c_sum = token_divergence(student, target, a.distance, a.jsd_beta).sum() if len(pairs) else logits.sum() * 0
        c_cnt = torch.tensor(len(pairs), device=logits.device)
        if num_items_in_batch is None:  # outside training_step: plain token means
            num_items_in_batch = torch.stack([c_cnt, a_cnt.to(c_cnt.device)])
        norm = num_items_in_batch.to(c_sum.device).clamp(min=1)
        loss = self.for_ranks(total_loss(c_sum / norm[0], a_sum / norm[1], a.ar_weight))
        if model.training:
            self.add_log_sums(torch.stack([c_sum.detach().double(), c_cnt.double(), a_sum.detach().double(),
                                           a_cnt.double().to(c_cnt.device)]))
        return (loss, logits) if return_outputs else loss

    def log_metrics(self, logs: dict[str, float], sums: list[float]) -> None:
        pair_means(logs, sums, ("consistency_loss", "ar_loss"))

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """The fast-forward proxies on the held-out trajectories (teacher-forced; decoded when the trainer has a
        :class:`DecodingProxy`), logged (console, W&B) and returned."""
        ds = eval_dataset if eval_dataset is not None else self.eval_dataset
        if ds is None:
            return {}
        found = fast_forward_proxy(self.model, ds, self.data_collator, self.args.per_device_eval_batch_size)
        if self.decoding_proxy is not None:
            found.update(self.decoding_proxy(self.model))
        metrics = {f"{metric_key_prefix}_{k}": v for k, v in found.items()}
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics


@torch.no_grad()
def fast_forward_proxy(model, dataset: TrajectoryDataset, collator, batch_size: int = 4) -> dict[str, float]:
    """Teacher-forced fast-forward proxy on held-out trajectories (every state of every block, ``dataset`` built
    with ``state_sampling="all"``): from each state s the model makes one Jacobi step y in one forward (the
    packed layout of training). With c the number of leading tokens of s equal to the fixed point (what Jacobi
    decoding would have committed: those positions are not predicted again), the step commits its first open
    token (Jacobi's always-correct token) plus the following tokens of y that equal the fixed point, counted only
    while y's first open token agrees with the fixed point (else the model has left the collected trajectory and
    nothing more is credited). Returns ``ff_proxy``: the mean over all states (exactly the trajectory's own
    advance for the collecting model, ~1 for a base model), ``ff_proxy_init``: over the blocks' first (random)
    states only, where Jacobi decoding starts; ``ff_proxy_agree``: how often y's first open token is the
    fixed point's (the model's greedy token still the collected one; 1.0 for the collecting model); and
    ``ff_proxy_states``: how many states."""
    was_training = model.training
    model.eval()
    gains: list[int] = []
    first: list[int] = []
    agree = 0
    try:
        for start in range(0, len(dataset), batch_size):
            idx = list(range(start, min(start + batch_size, len(dataset))))
            samples = [dataset[i] for i in idx]
            batch = {k: v.to(model.device) for k, v in collator(samples).items()}
            logits = packed_forward(model, batch, torch.arange(batch["input_ids"].shape[1], device=model.device))
            pred = logits.argmax(-1).cpu()  # [B, T]
            for row, (i, sample) in enumerate(zip(idx, samples)):
                r, b = dataset.items[i]
                rec = dataset.records[r]
                blk = rec["blocks"][b]
                fp, n = blk["fixed_point"], len(blk["fixed_point"])
                n_valid = min(n, len(rec["answer_ids"]) - sum(len(x["fixed_point"]) for x in rec["blocks"][:b]))
                head = int(pred[row, sample["context"] - 1])  # block position 0: predicted by the prefix
                for j, f in zip(dataset.states_of(i), sample["segments"]):
                    if j < 0:
                        continue
                    s = blk["states"][j]
                    c = _leading(s, fp, n_valid)
                    if c >= n_valid:
                        continue
                    y = [head] + pred[row, f : f + n - 1].tolist()
                    ok = y[c] == fp[c]
                    agree += ok
                    gains.append(1 + (_leading(y[c + 1 :], fp[c + 1 :], n_valid - c - 1) if ok else 0))
                    if j == 0:
                        first.append(gains[-1])
    finally:
        model.train(was_training)
    return {"ff_proxy": _mean(gains), "ff_proxy_init": _mean(first), "ff_proxy_agree": agree / max(1, len(gains)),
            "ff_proxy_states": float(len(gains))}


@dataclass
class DecodingProxy:
    """The benchmark's fast-forward on held-out prompts: each prompt decoded greedily by ``jacobi`` (random initial
    guesses from the context, its default) with the model being trained, ``block_size`` and ``max_new_tokens`` as
    collected, stopping at ``eos_ids``. Every rank decodes the same prompts (the same forwards, as ZeRO-3 needs)."""

    prompts: list[list[int]]
    block_size: int
    max_new_tokens: int
    eos_ids: set[int]

    def __call__(self, model) -> dict[str, float]:
        """``ff_decode``: the mean over prompts of each one's fast-forward (tokens committed per Jacobi iteration,
        as ``python -m pardec.report cllm`` averages the benchmark's); ``ff_decode_tokens``: tokens decoded."""
        runs = jacobi_runs(model, self.prompts, self.block_size, self.max_new_tokens, self.eos_ids)
        return {"ff_decode": mean_fast_forward(runs), "ff_decode_tokens": float(sum(len(r.tokens) for r in runs))}


def _mean(xs: list[float]) -> float:
    """The mean of ``xs``; NaN for none (a proxy with nothing to score)."""
    return sum(xs) / len(xs) if xs else float("nan")


def _leading(x: list[int], ref: list[int], n: int) -> int:
    """How many leading tokens of ``x`` equal ``ref`` (at most ``n``)."""
    return next((k for k in range(n) if x[k] != ref[k]), n)
