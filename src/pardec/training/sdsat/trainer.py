"""`SDSATConfig` + `SDSATTrainer`: fine-tune a model to predict several tokens at once from *adaptive tokens*
(SDSAT, Liu et al. 2024; the contract: :mod:`pardec.models.adaptive`), on the masked corpus of
:mod:`pardec.training.sdsat.masked`; plus its held-out evaluation.

Data: each sample is one masked record and yields two rows, the plain sequence (``ids``) and its masked version
(``masked_ids``), so every batch of ``B`` samples is ``B`` plain rows followed by their ``B`` masked rows (the
paper's half plain / half masked). Rows are ``ids[:-1]`` (the last token is only a label), right-padded by
:class:`SDSATCollator`: pads sit at the end, so no real token ever attends to one and no key mask is needed.

Loss (paper Eq. 9, :func:`~pardec.training.losses.sdsat_loss`): ``0.5 * (f_plain + w * f_masked)`` with ``w`` =
``mask_weight``; ``f_plain`` = next-token cross-entropy over the plain rows' label positions (``t + 1 >= start``),
``f_masked`` = cross-entropy of ``ids[t + 1]`` at the masked rows' adaptive-token positions ``t``. Ordinary
positions of masked rows count for nothing: the loss on ordinary tokens comes from plain sequences only. One forward
runs over all ``2B`` rows (DDP / DeepSpeed see one forward per backward). Each part's sum is divided by its count
over the whole gradient-accumulation window (summed over ranks), so accumulation gives the big-batch gradient.

Logged beside loss / lr / grad_norm: ``plain_loss`` (token mean of the plain-row CE: the paper's Figure 5 curve)
and ``masked_loss`` (token mean over adaptive-token positions).

Evaluation (:func:`evaluate_sdsat`, on held-out sequences ``eval.sources``): perplexity of the plain text (label
positions only) under the base model and the trained one, and teacher-forced adaptive-token accuracy per depth:
at sampled positions ``t``, the input ``ids[:t+1]`` followed by ``k`` adaptive tokens (positions ``t+1..t+k``);
slot ``j`` is right when its argmax is ``ids[t+1+j]``. All prefixes of a sequence share one forward: the blocks of
adaptive tokens are appended after the sequence and an additive 4D mask (the cached-model seam) lets each block see
only its prefix and its own earlier slots.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers.integrations import is_deepspeed_zero3_enabled
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

import pardec.training.sdsat.masked as mk
from pardec.config import ConfigError, ModelConfig, Ranks
from pardec.metrics.perplexity import completion_nll
from pardec.models import adaptive
from pardec.models.cached import CachedModel
from pardec.models.loading import load_model, trainable
from pardec.training.base import (
    BaseConfig,
    BaseTrainer,
    apply_lora,
    fit,
    pair_means,
    save_final,
    training_args,
)
from pardec.training.losses import sdsat_loss

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- data
class SDSATDataset(torch.utils.data.Dataset):
    """One sample per masked record: the plain row ``ids[:-1]``, the masked row ``masked_ids[:-1]``, the targets
    ``ids[1:]`` and both loss masks; records longer than ``max_length`` lose their start (counted)."""

    def __init__(self, records: list[dict], max_length: int = 1024):
        self.records = [r for r in records if len(r["ids"]) >= 2]
        self.max_length = max_length
        self.n_truncated = sum(len(r["ids"]) > max_length for r in self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        r = self.records[i]
        drop = max(0, len(r["ids"]) - self.max_length)
        ids, masked, start = r["ids"][drop:], r["masked_ids"][drop:], max(0, r["start"] - drop)
        n = len(ids)
        return {"input_ids": ids[:-1], "masked_input_ids": masked[:-1], "targets": ids[1:],
                "plain_mask": [t + 1 >= start for t in range(n - 1)],  # position t predicts ids[t + 1]
                "masked_mask": [masked[t] != ids[t] for t in range(n - 1)]}


@dataclass
class SDSATCollator:
    """Right-pads samples of an SDSATDataset: ``input_ids`` [2B, T] (B plain rows, then their B masked rows),
    ``targets``, ``plain_mask``, ``masked_mask`` [B, T] (False on padding)."""

    pad_id: int

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        bsz, width = len(samples), max(len(s["input_ids"]) for s in samples)
        ids = torch.full((2 * bsz, width), self.pad_id, dtype=torch.long)
        targets = torch.zeros(bsz, width, dtype=torch.long)
        plain = torch.zeros(bsz, width, dtype=torch.bool)
        masked = torch.zeros(bsz, width, dtype=torch.bool)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.tensor(s["input_ids"])
            ids[bsz + i, :n] = torch.tensor(s["masked_input_ids"])
            targets[i, :n] = torch.tensor(s["targets"])
            plain[i, :n] = torch.tensor(s["plain_mask"])
            masked[i, :n] = torch.tensor(s["masked_mask"])
        return {"input_ids": ids, "targets": targets, "plain_mask": plain, "masked_mask": masked}


# ------------------------------------------------------------------------------------------- trainer
@dataclass
class SDSATConfig(BaseConfig):
    mask_weight: float = field(default=1.0, metadata={"help": "w of Eq. 9: 0.5 * (f_plain + w * f_masked)"})

    @classmethod
    def check_values(cls, opts: dict) -> None:
        """Range checks of the SDSAT trainer keys (``opts`` may hold only some of them); raises ConfigError."""
        super().check_values(opts)
        w = opts.get("mask_weight", 1.0)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            raise ConfigError(f"trainer.mask_weight={w!r} is out of range: it must be a number >= 0")


class SDSATTrainer(BaseTrainer):
    args: SDSATConfig
    log_sums_size = 4  # plain CE sum, count, masked CE sum, count

    def window_counts(self, batches: list[dict]) -> list[int]:
        """[plain positions, masked positions] in the accumulation window."""
        return [sum(int(b["plain_mask"].sum()) for b in batches), sum(int(b["masked_mask"].sum()) for b in batches)]

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        plain, masked, targets = inputs["plain_mask"], inputs["masked_mask"], inputs["targets"]
        # the LM head only at positions some row trains (the prompts and the padding tail never reach the loss):
        # logits [2B, K, V] instead of [2B, T, V], one forward for both halves
        keep = (plain.bool() | masked.bool()).any(0).nonzero()[:, 0]
        out = model(input_ids=inputs["input_ids"], use_cache=False, logits_to_keep=keep.to(inputs["input_ids"].device))
        res = sdsat_loss(out.logits, targets[:, keep], plain[:, keep], masked[:, keep], self.args.mask_weight,
                         num_items_in_batch)
        loss = self.for_ranks(res.total)
        if model.training:
            self.add_log_sums(res.sums)
        return (loss, out) if return_outputs else loss

    def log_metrics(self, logs: dict[str, float], sums: list[float]) -> None:
        pair_means(logs, sums, ("plain_loss", "masked_loss"))


# ------------------------------------------------------------------------------------------- evaluation
def sample_positions(n: int, start: int, stride: int) -> list[int]:
    """Prefix ends ``t`` (the prefix is ``ids[:t+1]``) every ``stride`` positions from the one predicting the first
    label token, while depth 1 (token ``t + 2``) exists."""
    return list(range(max(start, 1) - 1, n - 2, stride))


def adaptive_block(n: int, anchors: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layout of one forward: the ``n`` real tokens, then a block of ``k`` adaptive slots per anchor ``t``.
    Returns (position ids [N], attend [N, N] bool): real tokens are causal among themselves; slot ``j`` (1-based) of
    anchor ``t`` sits at position ``t + j`` and sees ``ids[:t+1]`` and slots ``1..j`` of its own block."""
    total = n + len(anchors) * k
    attend = torch.zeros(total, total, dtype=torch.bool)
    attend[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
    positions = torch.empty(total, dtype=torch.long)
    positions[:n] = torch.arange(n)
    block = torch.ones(k, k, dtype=torch.bool).tril()
    for b, t in enumerate(anchors):
        s = n + b * k
        attend[s : s + k, : t + 1] = True
        attend[s : s + k, s : s + k] = block
        positions[s : s + k] = torch.arange(t + 1, t + 1 + k)
    return positions, attend


@torch.inference_mode()
def score_sequence(model, ids: list[int], start: int, adaptive_ids: list[int], diverse: bool, k: int,
                   stride: int) -> dict:
    """One forward of ``ids`` plus adaptive blocks at the sampled anchors: the plain NLL (sum, count) of the label
    positions (``p >= max(start, 1)``) and per anchor the slot argmaxes [A, k] with the true tokens and the model's
    own teacher-forced argmax at the same positions (-1 where past the end)."""
    n = len(ids)
    anchors = sample_positions(n, start, stride)
    slots = [adaptive_ids[j] if diverse else adaptive_ids[0] for j in range(k)]
    tokens = torch.tensor(ids + slots * len(anchors))
    positions, attend = adaptive_block(n, anchors, k)
    logits = CachedModel(model).forward(tokens, positions=positions, attend=attend).logits[0].float().cpu()
    first = max(start, 1)
    target = torch.tensor(ids[first:])
    nll = torch.nn.functional.cross_entropy(logits[first - 1 : n - 1], target, reduction="sum")
    real_arg = logits[:n].argmax(-1)  # [n]: the model's prediction of token p + 1
    guess = logits[n:].argmax(-1).view(len(anchors), k)  # [A, k]
    truth = torch.full((len(anchors), k), -1, dtype=torch.long)
    model_arg = torch.full((len(anchors), k), -1, dtype=torch.long)
    for a, t in enumerate(anchors):
        for j in range(1, k + 1):
            if t + 1 + j <= n - 1:
                truth[a, j - 1] = ids[t + 1 + j]
                model_arg[a, j - 1] = real_arg[t + j]
    return {"nll": float(nll), "tokens": len(target), "guess": guess, "truth": truth, "model_arg": model_arg}


def _leading_runs(hit: torch.Tensor) -> torch.Tensor:
    """Per row of a bool [A, k]: how many leading entries are True."""
    return hit.long().cumprod(-1).sum(-1)


def adaptive_report(guess: torch.Tensor, truth: torch.Tensor, model_arg: torch.Tensor) -> dict:
    """Per-depth top-1 accuracy (vs the held-out text, and vs the model's own teacher-forced argmax) and the
    expected tokens per two-step loop: 1 (the token from the last real position) + the mean run of leading
    correct slots, over anchors whose every depth is inside the sequence."""
    valid = truth >= 0
    n = valid.sum(0).clamp(min=1).double()
    full = valid.all(-1)
    vs_text, vs_model = (guess == truth) & valid, (guess == model_arg) & valid
    return {"anchors": int(guess.shape[0]), "valid_per_depth": valid.sum(0).tolist(),
            "accuracy": (vs_text.sum(0) / n).tolist(), "accuracy_vs_model": (vs_model.sum(0) / n).tolist(),
            "full_depth_anchors": int(full.sum()),
            "expected_tokens_per_loop": 1.0 + float(_leading_runs(vs_text[full]).float().mean()) if full.any()
            else None,
            "expected_tokens_per_loop_vs_model": 1.0 + float(_leading_runs(vs_model[full]).float().mean())
            if full.any() else None}


def _source_label(src: dict) -> str:
    if "completions" in src:
        return Path(src["completions"]).name
    if "file" in src:
        return f"file:{Path(src['file']).stem}"
    return f"ref:{src['dataset']['name']}"


def _ppl(nll: float, tokens: int) -> float | None:
    return math.exp(nll / tokens) if tokens else None


# ------------------------------------------------------------------------------------------- app stages
def attach_adaptive_any(model, tokenizer, tokens: list[str], max_span: int, diverse: bool) -> list[int]:
    """:func:`pardec.models.adaptive.attach_adaptive`, also under DeepSpeed ZeRO-3 (weights partitioned over the
    ranks): the embeddings grow first (transformers gathers them to resize), then the new rows are set with the
    whole embedding (and untied head) gathered; rank 0's values are kept on every rank."""
    if not is_deepspeed_zero3_enabled():
        return adaptive.attach_adaptive(model, tokenizer, tokens, max_span, diverse)
    import deepspeed  # heavy: deepspeed

    adaptive.add_adaptive_tokens(tokenizer, tokens)
    if len(tokenizer) > model.config.vocab_size:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    params = list(emb.parameters()) + (list(head.parameters()) if head is not None and head.weight is not emb.weight
                                       else [])
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        return adaptive.attach_adaptive(model, tokenizer, tokens, max_span, diverse)


def train_sdsat(spec, run_dir, ranks: Ranks) -> dict:
    """The train stage of a ``kind: sdsat`` experiment (``spec``: :class:`~pardec.training.sdsat.SDSATSpec`): the base
    model with the adaptive tokens attached (ids checked against the masked corpus), fully fine-tuned or with LoRA
    (plus the adaptive tokens' embedding rows), on ``<mask.out_dir>/masked.jsonl``; final model + tokenizer (with
    the adaptive tokens and ``config.sdsat``) into ``<run>/final``."""
    args = training_args(SDSATConfig, spec, run_dir)  # before the model, as ZeRO-3 requires
    meta, records = mk.load_masked(spec.mask.out_dir)
    tokens = adaptive.adaptive_tokens(spec.max_span, spec.diverse)
    lm = load_model(trainable(spec.model, spec.model_dtype))  # the Trainer places it

    def attach(base) -> list[int]:
        ids = attach_adaptive_any(base.model, base.tokenizer, tokens, spec.max_span, spec.diverse)
        if ids != meta["adaptive_ids"] or tokens != meta["adaptive_tokens"]:
            raise ConfigError(f"the adaptive tokens of {spec.model.name} are {tokens} at ids {ids}, but the masked "
                              f"corpus {spec.mask.out_dir} uses {meta['adaptive_tokens']} at ids "
                              f"{meta['adaptive_ids']}; rebuild it with stage=mask (mask.overwrite=true)")
        return ids

    ids = attach(lm)
    model = lm.model
    if spec.lora:  # LoRA on the blocks, plus the adaptive tokens' own embedding rows (peft trainable tokens)
        model = apply_lora(model, spec.lora, trainable_token_indices=ids)
    ds = SDSATDataset(records, args.max_length)
    pad = lm.tokenizer.pad_token_id
    trainer = SDSATTrainer(model=model, args=args, train_dataset=ds, data_collator=SDSATCollator(
        0 if pad is None else pad), processing_class=lm.tokenizer)

    def finish(final, trained: dict) -> dict:
        save_final(trainer, spec, run_dir, final, ranks, prepare=attach)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return {"samples": len(ds), "truncated_samples": ds.n_truncated, "records": len(records),
                "masked_positions": sum(r["masked"] for r in records), "adaptive_tokens": tokens,
                "adaptive_ids": ids, "lora": bool(spec.lora), "trainable_parameters": trainable,
                "final_model": str(final)}

    return fit(trainer, spec, run_dir, ranks, finish)


def evaluate_sdsat(spec, run_dir) -> dict:
    """The eval stage: on the held-out ``eval.sources`` (at most ``eval.max_docs`` sequences each, cut like the
    training corpus), the plain-text perplexity under the base model and ``<run>/final`` (same tokens; their
    ratio), and the trained model's per-depth adaptive-token accuracy; all into ``<run>/sdsat_eval.json``."""

    final = run_dir / "final"
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"no trained model in {final}; run stage=train first")
    sdsat = adaptive.adaptive_of(json.loads((final / "config.json").read_text()))  # checked before any model loads
    if sdsat is None:
        raise ValueError(f"{final}/config.json has no `sdsat` section: not an SDSAT model; run stage=train again")
    unset_hf_deepspeed_config()  # after a ZeRO-3 train stage: load the models whole (rank 0 alone), not sharded
    base = load_model(spec.model)  # the run's dtype: fp32 on CPU, bf16 on GPU, as the decoders will run them
    trained = load_model(ModelConfig(name="sdsat", source="local", path=str(final), dtype=spec.model.dtype,
                                     device=spec.model.device))
    k = spec.eval_k_max
    result: dict = {"model": str(final), "base": spec.model.name, "adaptive_tokens": sdsat["adaptive_tokens"],
                    "diverse": sdsat["diverse"], "k_max": k, "stride": spec.eval_stride,
                    "threads": torch.get_num_threads(), "per_source": {}}
    total = {"base_nll": 0.0, "trained_nll": 0.0, "tokens": 0, "sequences": 0}
    parts: list[dict] = []
    t0 = time.perf_counter()
    for src in spec.eval_sources:
        records = mk.corpus_records([src], trained.tokenizer, base.chat, spec.mask.max_length)[: spec.eval_max_docs]
        acc = {"base_nll": 0.0, "trained_nll": 0.0, "tokens": 0, "sequences": len(records)}
        got: list[dict] = []
        for r in records:
            if len(r.ids) < 2:
                continue
            first = max(r.start, 1)
            b_nll, _ = completion_nll(base.model, r.ids[:first], r.ids[first:])
            s = score_sequence(trained.model, r.ids, r.start, sdsat["adaptive_ids"], sdsat["diverse"], k,
                               spec.eval_stride)
            acc["base_nll"] += b_nll
            acc["trained_nll"] += s["nll"]
            acc["tokens"] += s["tokens"]
            got.append(s)
        result["per_source"][_source_label(src)] = {**_ppl_report(acc), "adaptive": _merged_report(got, k)}
        for key in total:
            total[key] += acc[key]
        parts += got
    result["overall"] = {**_ppl_report(total), "adaptive": _merged_report(parts, k)}
    result["eval_seconds"] = round(time.perf_counter() - t0, 1)
    (run_dir / "sdsat_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _ppl_report(acc: dict) -> dict:
    b, t = _ppl(acc["base_nll"], acc["tokens"]), _ppl(acc["trained_nll"], acc["tokens"])
    return {"sequences": acc["sequences"], "tokens": acc["tokens"], "ppl_base": b, "ppl_trained": t,
            "ppl_ratio": t / b if b and t else None}


def _merged_report(scores: list[dict], k: int) -> dict:
    if not scores:
        empty = torch.zeros(0, k, dtype=torch.long)
        return adaptive_report(empty, empty - 1, empty)
    return adaptive_report(*(torch.cat([s[key] for s in scores]) for key in ("guess", "truth", "model_arg")))
