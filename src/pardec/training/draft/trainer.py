"""`DraftConfig` + `DraftTrainer`: distil a target into a :class:`~pardec.models.draft.DraftForCausalLM` on the
target's own greedy completions (trl's Config/Trainer pair), plus the draft's evaluation (agreement, cost).

Each step runs the student with gradient and the frozen teacher (the target; a separate module, kept out of the
optimizer and of the DeepSpeed engine, moved to the args' device) on the same batch of ``prompt + completion``
sequences (teacher forcing), and compares their next-token distributions at the completion positions only:

* ``loss="fkl"``: KL(p || q), p = the teacher's distribution restricted to the draft vocabulary and renormalised,
  q = the student's (which has support on the draft vocabulary only). Renormalising makes p a distribution over
  what the student can express, so the loss is 0 exactly when the draft matches the teacher there and the
  teacher's mass outside the vocabulary (logged as ``teacher_kept_mass``) adds no constant the student cannot
  reduce; for speculative sampling this is the best the restricted draft can do up to that mass.
* ``loss="tvd"`` / ``"jsd"``: total variation 0.5 * sum |p - q| / Jensen-Shannon (beta 0.5) between the same two
  distributions (DistillSpec, Zhou et al. 2024, Table 1: TVD bounds the acceptance rate of speculative decoding;
  which divergence is best depends on task and decoding);
* ``loss="ce"``: cross-entropy on the teacher's argmax over the draft vocabulary (hard labels).

``teacher="online"`` (default) runs the teacher's forward every step. ``teacher="cached"`` runs none: it reads the
target's top-k log-probs stored with each completion at generation time (``completions.teacher_topk``), so p is
the teacher restricted to its top k ids that are in the draft vocabulary, renormalised there (the KL to it is
0 exactly when q equals that p; ``teacher_kept_mass`` is then the teacher's mass on those ids). With k = the full
vocabulary the two are the same loss. Positions whose k ids all lie outside the draft vocabulary add 0 to the
loss and to the logged kl (they still count in the means).
The teacher forward is most of a step's time when the student is a few layers of the target, and the target need
not be in memory at all while training.

Temperature 1. Normalisation (:class:`~pardec.training.base.BaseTrainer`): the token sum divided by the number of completion positions in
the whole gradient-accumulation window (summed over ranks), so accumulation gives the big-batch gradient. Logged
beside loss / lr / grad_norm: ``kl`` (token mean of the fkl, whatever the loss), ``agreement`` (teacher-forced
top-1 agreement: student argmax == teacher argmax over the full vocabulary) and ``teacher_kept_mass``.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pardec.config import ConfigError, ModelConfig, Ranks, check_choice
from pardec.models.cached import CachedModel
from pardec.models.draft import build_draft
from pardec.models.loading import TORCH_DTYPES, load_model, trainable
from pardec.models.vocab import choose_vocab
from pardec.training.base import BaseConfig, BaseTrainer, fit, training_args, unwrap
from pardec.training.completions import (
    CompletionCollator,
    CompletionDataset,
    corpus_share,
    load_completions,
    loss_window,
    run_generation,
)
from pardec.training.losses import masked_sum, token_divergence

LOSSES = ("fkl", "tvd", "jsd", "ce")
TEACHERS = ("online", "cached")
#: a logit no kept id of the cached teacher can reach: exp() of it is 0 in fp32, and it is finite, so the KL's
#: 0 * log 0 terms stay 0 instead of NaN
_ABSENT = -1.0e4


# ------------------------------------------------------------------------------------------- loss
def distill_token_loss(student: torch.Tensor, teacher: torch.Tensor, loss: str = "fkl") -> torch.Tensor:
    """Per-position loss [...] between student logits [..., K] (gradient flows) and the teacher's logits on the
    same K kept ids [..., K] (detached; renormalised over K by the log-softmax)."""
    if loss in ("fkl", "tvd", "jsd"):
        return token_divergence(student, teacher, loss)
    if loss == "ce":
        return F.cross_entropy(student.float().flatten(0, -2), teacher.detach().argmax(-1).flatten(),
                               reduction="none").view(student.shape[:-1])
    raise ValueError(f"distill loss={loss!r} is not valid; choose one of: {', '.join(LOSSES)}")


# ------------------------------------------------------------------------------------------- trainer
@dataclass
class DraftConfig(BaseConfig):
    loss: str = field(default="fkl", metadata={
        "help": "fkl: KL(teacher || student) on the draft vocab | tvd | jsd | ce"})
    teacher: str = field(default="online", metadata={
        "help": "online: the teacher's forward every step | cached: its top-k log-probs stored in the completions"})

    @classmethod
    def check_values(cls, values: dict) -> None:
        super().check_values(values)
        if "loss" in values:
            check_choice("trainer.loss", values["loss"], LOSSES)
        if "teacher" in values and values["teacher"] not in TEACHERS:
            raise ConfigError(f"trainer.teacher={values['teacher']!r} is not valid; choose one of: "
                              f"{', '.join(TEACHERS)}")


class DraftTrainer(BaseTrainer):
    args: DraftConfig
    log_sums_size = 4  # kl sum, agreement sum, kept mass sum, count

    def __init__(self, *args, teacher: torch.nn.Module | None, **kwargs):
        super().__init__(*args, **kwargs)
        if (teacher is None) != (self.args.teacher == "cached"):
            raise ValueError(f"teacher={self.args.teacher!r} needs "
                             f"{'no teacher model' if teacher is not None else 'a teacher model'}")
        # not a submodule of the model
        self.teacher = None if teacher is None else teacher.to(self.args.device).eval().requires_grad_(False)
        self._slot: torch.Tensor | None = None  # [V]: target id -> its draft-vocabulary column, -1 if not kept

    def window_counts(self, batches: list[dict]) -> int:
        """Completion positions in the accumulation window."""
        return sum(int(b["loss_mask"].sum()) for b in batches)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        mask = inputs["loss_mask"]
        k = loss_window(mask)
        mask = mask[:, -k:]  # [B, k]
        kw = {key: inputs[key] for key in ("input_ids", "attention_mask", "position_ids")}
        out = model(**kw, logits_to_keep=k, draft_logits=True)
        student = out.logits  # [B, k, K]
        vocab = unwrap(model).vocab_ids(student.device)  # [K]
        with torch.no_grad():
            if self.teacher is None:
                teacher, top1, kept, found = self.cached_teacher(inputs, mask, vocab, unwrap(model).config.vocab_size)
            else:
                full = self.teacher(**kw, logits_to_keep=k).logits.to(student.device)  # [B, k, V]
                teacher = full[..., vocab]  # [B, k, K]
                top1 = full.argmax(-1)
                kept = torch.exp(torch.logsumexp(teacher.float(), -1) - torch.logsumexp(full.float(), -1))
        per_token = distill_token_loss(student, teacher, self.args.loss)
        if self.teacher is None:  # a position whose top k ids the draft keeps none of: nothing to learn (still counted)
            per_token = per_token.masked_fill(~found, 0.0)
        l_sum, count = masked_sum(per_token, mask)
        norm = count if num_items_in_batch is None else num_items_in_batch.to(l_sum.device)
        loss = self.for_ranks(l_sum / norm.clamp(min=1))
        if model.training:
            with torch.no_grad():
                kl = per_token if self.args.loss == "fkl" else token_divergence(student, teacher, "fkl")
                agree = vocab[student.argmax(-1)] == top1
                sums = [masked_sum(x.float(), mask)[0] for x in (kl, agree, kept)]
                self.add_log_sums(torch.stack([*sums, count.float()]))
        return (loss, out) if return_outputs else loss

    def cached_teacher(self, inputs: dict, mask: torch.Tensor, vocab: torch.Tensor, vocab_size: int):
        """The teacher from the batch's stored top-k (``teacher_ids`` / ``teacher_logprobs`` [N, k], one row per True
        of ``mask`` [B, w]) as the online teacher's tensors: logits on the draft vocabulary [B, w, K] (the stored
        log-probs at the kept ids among the top k, ``_ABSENT`` elsewhere), the full-vocabulary argmax [B, w], the
        teacher's mass on those ids [B, w], and which positions have any [B, w] (bool)."""
        ids, lp = inputs["teacher_ids"], inputs["teacher_logprobs"].float()  # [N, k]
        if self._slot is None or self._slot.device != vocab.device:
            self._slot = torch.full((vocab_size,), -1, dtype=torch.long, device=vocab.device)
            self._slot[vocab] = torch.arange(len(vocab), device=vocab.device)
        col = self._slot[ids]  # [N, k]
        here = col >= 0
        rows = lp.new_full((len(ids), len(vocab)), _ABSENT)  # [N, K]
        rows.scatter_reduce_(1, col.clamp(min=0), torch.where(here, lp, _ABSENT), "amax")  # absent ids: no-ops
        shape = (*mask.shape, len(vocab))
        teacher = lp.new_full(shape, _ABSENT)
        teacher[mask] = rows
        top1 = ids.new_full(mask.shape, -1)
        top1[mask] = ids[:, 0]
        kept = lp.new_zeros(mask.shape)
        kept[mask] = torch.where(here, lp.exp(), 0.0).sum(-1)
        found = torch.zeros_like(mask)
        found[mask] = here.any(-1)
        return teacher, top1, kept, found

    def log_metrics(self, logs: dict[str, float], sums: list[float]) -> None:
        kl, agree, kept, n = sums
        logs.update(kl=kl / max(n, 1.0), agreement=agree / max(n, 1.0), teacher_kept_mass=kept / max(n, 1.0))


# ------------------------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def agreement(draft, target, records: list[dict], pad_id: int, batch_size: int = 8) -> dict:
    """Teacher-forced draft quality on ``records`` (prompt + target completion), over the completion positions:
    ``agreement``, how often argmax draft == argmax target (what greedy speculative decoding accepts);
    ``expected_acceptance_t1``, the mean of sum_v min(p_v, q_v) = 1 - TVD(p, q) with p, q the target's and the
    draft's unwarped softmax (the probability that speculative sampling at temperature 1 accepts a drafted token:
    Leviathan et al. 2023, §3.4; what a TVD-trained draft optimises, DistillSpec); and how often the target's argmax
    is the recorded token."""
    ds = CompletionDataset(records, max_length=1 << 30)
    collate = CompletionCollator(pad_id)
    agree = same = n = 0
    accept = 0.0
    for start in range(0, len(ds), batch_size):
        b = collate([ds[i] for i in range(start, min(start + batch_size, len(ds)))])
        k = loss_window(b["loss_mask"])
        mask = b["loss_mask"][:, -k:]
        kw = {key: b[key].to(target.device) for key in ("input_ids", "attention_mask", "position_ids")}
        tl = target(**kw, logits_to_keep=k).logits  # [B, k, V]
        dl = draft(**{x: v.to(draft.device) for x, v in kw.items()}, logits_to_keep=k).logits.to(tl.device)
        t, d = tl.argmax(-1).cpu(), dl.argmax(-1).cpu()  # [B, k]
        overlap = (1.0 - token_divergence(dl, tl, "tvd")).cpu()  # [B, k]: sum_v min(p_v, q_v) = 1 - TVD
        agree += int((t == d)[mask].sum())
        accept += float(overlap[mask].sum())
        n += int(mask.sum())
        for row in range(len(t)):  # row's masked positions predict exactly its completion tokens
            same += int((t[row][mask[row]] == torch.tensor(ds.records[start + row]["completion_ids"])).sum())
    return {"positions": n, "agreement": agree / max(n, 1), "expected_acceptance_t1": accept / max(n, 1),
            "target_matches_record": same / max(n, 1)}


@torch.inference_mode()
def forward_ms(model, context: list[int], repeats: int = 20, warmup: int = 3, tokens: int = 1) -> float:
    """Median wall time (ms) of a cached forward of the last ``tokens`` tokens of ``context`` after the others
    (the cache is cut back each time): a drafting step (1 token) or a verification forward (gamma + 1)."""
    cm = CachedModel(model)
    ids = torch.tensor([context])
    cm.prefill(ids[:, :-tokens])
    base = cm.length
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        cm.forward(ids[:, -tokens:])
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
        cm.truncate(base)
    return statistics.median(times)


# ------------------------------------------------------------------------------------------- app stages
def train_draft(spec, run_dir, ranks: Ranks) -> dict:
    """The train stage of a ``kind: draft`` experiment (``spec``: :class:`~pardec.training.draft.DraftSpec`):
    student = build_draft(target, layers, vocab chosen from the completions' token counts); final model to
    ``<run>/final``."""
    args = training_args(DraftConfig, spec, run_dir)  # before the model, as ZeRO-3 requires
    records = corpus_share(load_completions(spec.gen.out_dir), spec.corpus_fraction)
    # the target once, in the run's dtype (the teacher's): at 7B a bf16 copy per rank on the host, not fp32's 27 GB;
    # the student starts as a copy of its layers, cast to model_dtype (the Trainer places it)
    lm = load_model(trainable(spec.model, spec.model.dtype))
    tok, target = lm.tokenizer, lm.model
    counts = Counter(t for r in records for t in r["completion_ids"])
    special = {*tok.all_special_ids, tok.pad_token_id, *lm.eos_ids}
    vocab = choose_vocab(counts, spec.vocab_size, sorted(i for i in special if i is not None),
                         target.config.vocab_size)
    student = build_draft(target, spec.layers, vocab).to(TORCH_DTYPES[spec.model_dtype])  # copies
    if args.teacher == "cached":
        missing = sum("teacher_ids" not in r for r in records)
        if missing:
            raise ConfigError(f"trainer.teacher=cached needs the target's top-k log-probs in the completions, and "
                              f"{missing} of {len(records)} records in {spec.gen.out_dir} have none: generate them "
                              "with completions.teacher_topk=<k> (e.g. 32), or use trainer.teacher=online")
        target = None  # no teacher forward: the target is not needed past building the student
    if spec.freeze_embeddings:
        student.model.embed_tokens.weight.requires_grad_(False)
    kept = set(vocab)
    covered = sum(c for t, c in counts.items() if t in kept) / max(1, sum(counts.values()))
    ds = CompletionDataset(records, args.max_length, teacher=args.teacher == "cached")
    trainer = DraftTrainer(model=student, args=args, train_dataset=ds, data_collator=CompletionCollator(
        tok.pad_token_id), processing_class=tok, teacher=target)

    def finish(final, trained: dict) -> dict:
        trainer.model.config.use_cache = True  # the Trainer turned it off for training; decoding wants it
        trainer.save_model(str(final))  # also the tokenizer (processing_class)
        if ranks.rank == 0:
            student.generation_config.save_pretrained(final)
        return {"samples": len(ds), "corpus_fraction": spec.corpus_fraction, "truncated_samples": ds.n_truncated, "draft_layers": spec.layers,
                "draft_vocab_size": len(vocab), "completion_tokens_covered_by_vocab": covered,
                "trainable_parameters": sum(p.numel() for p in student.parameters() if p.requires_grad),
                "final_model": str(final)}

    return fit(trainer, spec, run_dir, ranks, finish)


def evaluate_draft(spec, run_dir) -> dict:
    """The eval stage: greedy target completions of each held-out source (resumable, own out dir), teacher-forced
    top-1 agreement of ``<run>/final`` vs the target on them, and both models' 1-token forward time."""

    final = run_dir / "final"
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"no trained draft in {final}; run stage=train first")
    lm = load_model(spec.model)  # the run's dtype: fp32 on CPU, bf16 on GPU, as the decoders will run them
    draft = load_model(ModelConfig(name="draft", source="local", path=str(final), dtype=spec.model.dtype,
                                   device=spec.model.device)).model
    pad = lm.tokenizer.pad_token_id
    result: dict = {"draft": str(final), "target": spec.model.name, "threads": torch.get_num_threads(),
                    "agreement": {}}
    records_all = []
    for g in spec.eval_gen:
        run_generation(g, lm, 0, 1, None, "eval")
        records = load_completions(g.out_dir, "stage=eval")
        result["agreement"][g.sources[0].dataset.name] = agreement(draft, lm.model, records, pad, g.batch_size)
        records_all += records
    n = sum(a["positions"] for a in result["agreement"].values())
    result["agreement_overall"] = sum(a["agreement"] * a["positions"] for a in result["agreement"].values()) / max(n, 1)
    context = [t for r in records_all for t in r["prompt_ids"] + r["completion_ids"]][: spec.eval_context]
    t_ms = forward_ms(lm.model, context, spec.eval_repeats)
    d_ms = forward_ms(draft, context, spec.eval_repeats)
    result["cost"] = {"context": len(context), "target_ms": t_ms, "draft_ms": d_ms, "draft_over_target": d_ms / t_ms}
    (run_dir / "draft_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
