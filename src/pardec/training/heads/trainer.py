"""`HeadsConfig` + `HeadsTrainer`: self-distil a head/projection drafter (:mod:`pardec.models.heads`: Medusa heads,
FIRP projections) on the target's own greedy completions, plus its held-out evaluation and tree search.

The trainer's model is the drafter (a plain ``nn.Module``); the target ("base") is frozen, kept outside the
optimizer and the DeepSpeed engine (as DraftTrainer's teacher) and moved to the args' device. Each sample is
``prompt + completion[:-1]`` (:class:`~pardec.training.completions.CompletionDataset`, cut from the left to
``max_length``), right-padded by :class:`~pardec.training.heads.batches.RightPadCollator`: pads sit at the end, so
no real token and no pseudo state ever attends to one and no key mask is needed.

Loss (soft targets, temperature 1): for depth ``k`` (0-based) and position ``t``, a KL divergence between
``p_{t+k+1}``, the base's next-token distribution at position ``t + k + 1`` (detached), and ``q_{t,k}``, head ``k``
(Medusa) / pseudo step ``k`` (FIRP) at anchor ``t``: both predict the token at ``t + k + 2``. Medusa: ``KL(p || q)``
(self-distillation). FIRP: ``KL(q || p)`` by default (``heads.distance: rkl``; the paper's Eq. 4, KL(P~ || P) with P~
the distribution from the pseudo state); ``fkl`` keeps pardec's earlier ``KL(p || q)``. A term counts where
``p_{t+k+1}`` predicts a completion token (the loss mask of position ``t + k + 1``; never a pad). Weights: Medusa
``head_decay ** k`` (Medusa-1's decay), FIRP 1 per step (the paper sums the steps). The weighted sum is divided by
the number of (position, depth) terms in the whole gradient-accumulation window (summed over ranks), so
accumulation gives the big-batch gradient.

FIRP with ``heads.attention: real`` (the default; FIRP §3.3) is trained teacher-forced: pseudo step ``i`` of anchor
``t`` sees the real tokens up to ``t + i`` (its own position minus one) and itself, never another pseudo state, so
its loss reaches projection ``i`` alone: the K projections are trained separately, in one forward (what still ties
them: the global gradient-norm clip and the shared normaliser). ``attention: pseudo`` (pardec's earlier pattern)
trains them jointly: step ``i`` sees the anchor's prefix and steps ``< i``, so a later step's loss also reaches the
earlier projections through attention. The held-out evaluation measures ranks under decoding's conditions (no real
token after the anchor); for FIRP in both views a pseudo state can have at decoding (FIRP §4.3 / Fig. 7): "No masked"
(``pseudo``: it also sees the anchor's earlier pseudo states; decoding's default, the view the trees are searched on)
and "Masked" (``real``: the real states and itself).

DFlash (``heads.type: dflash``): the block loss of :mod:`pardec.training.heads.dflash` (K = the block's slots
``block_size - 1``, anchors drawn by :class:`~pardec.training.heads.dflash.DFlashCollator`, normalised by the
window's counted terms) and its own eval stage (held-out acceptance by block position).

EAGLE-3 (``heads.type: eagle3``): the training-time-test loss of :mod:`pardec.training.heads.eagle` (K = the TTT
steps, weights ``step_decay ** k``, the same window normaliser), its vocabulary from the corpus (:func:`eagle3_vocab`)
and its own eval stage (:func:`evaluate_chain`: held-out chain acceptance by depth, no trees).

Logged beside loss / lr / grad_norm, per depth ``d = k + 1``: ``kl_d<d>`` (the mean training KL) and ``top1_d<d>``
(teacher-forced top-1 agreement: student argmax == teacher argmax), plus their term-weighted means ``kl`` and
``top1``; DFlash logs ``ce_d<d>`` and ``ce`` in place of the KL (:meth:`HeadsTrainer.dflash_loss`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import torch

from pardec.config import ConfigError, Ranks
from pardec.models.pseudo import DECODING_ATTENTION, PSEUDO_ATTENTION, forward_pseudo
from pardec.training.base import BaseConfig, BaseTrainer, fit, training_args, unwrap
from pardec.training.heads.batches import RightPadCollator, held_out_windows
from pardec.training.losses import masked_sum, token_divergence

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- data
def term_count(loss_mask: torch.Tensor, k: int) -> int:
    """The (position, depth) terms of a batch: depth ``d`` (0-based) pairs anchor ``t`` with target ``t + d + 1``."""
    return sum(int(loss_mask[:, d + 1 :].sum()) for d in range(k))


def window_start(loss_mask: torch.Tensor, k: int) -> int:
    """The first anchor any term needs: ``k`` before the first masked position of any row (0 if none sooner)."""
    any_row = loss_mask.any(0)
    if not bool(any_row.any()):
        return max(0, loss_mask.shape[1] - 1)
    return max(0, int(any_row.float().argmax()) - k)


def depth_weights(kind: str, k: int, head_decay: float) -> list[float]:
    return [head_decay**d for d in range(k)] if kind == "medusa" else [1.0] * k


def drafter_forward(base, drafter_call, drafter, ids: torch.Tensor, start: int, checkpoint: bool = False,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher logits [B, n, V] of positions ``start..T-1`` (detached), student logits [B, n, K, V] of anchors
    ``start..T-1``); ``drafter_call`` is the (possibly wrapped) module to call, ``drafter`` the bare one.
    ``checkpoint``: FIRP's upper target layers over the pseudo states recompute in backward (Medusa's heads sit
    after a no-grad target forward: nothing to checkpoint)."""
    from pardec.models.cached import CachedModel

    t = ids.shape[1]
    window = torch.arange(start, t)
    if drafter.kind == "medusa":
        with torch.no_grad():
            hidden = base.model(input_ids=ids).last_hidden_state[:, start:]  # after the final norm
            teacher = base.lm_head(hidden)
        w = next(drafter.parameters())
        return teacher, drafter_call(hidden.to(w.dtype))
    cm = CachedModel(base)
    out = forward_pseudo(cm, ids, drafter_call, drafter.layers, anchors=window, logits_at=window, split=True,
                            attention=drafter.attention, teacher_forced=drafter.attention == "real",
                            checkpoint=checkpoint)
    return out.logits.detach(), cm.lm_head(out.pseudo)


def depth_terms(teacher: torch.Tensor, student: torch.Tensor, mask: torch.Tensor, d: int, distance: str = "fkl"):
    """Depth ``d``: (per-term KL [B, n-d-1], teacher argmax, student argmax, mask), aligned; None if empty.
    ``mask`` [B, n]: the loss mask of the window's positions. ``distance``: ``fkl`` = KL(teacher || student),
    ``rkl`` = KL(student || teacher) (FIRP's Eq. 4)."""
    n = teacher.shape[1]
    if n - d - 1 <= 0:
        return None
    s, p = student[:, : n - d - 1, d], teacher[:, d + 1 :]
    return token_divergence(s, p, distance), p.argmax(-1), s.argmax(-1), mask[:, d + 1 :]


# ------------------------------------------------------------------------------------------- trainer
@dataclass
class HeadsConfig(BaseConfig):
    head_decay: float = field(default=0.8, metadata={"help": "Medusa: head k (0-based) weighs head_decay**k"})

    @classmethod
    def check_values(cls, values: dict) -> None:
        super().check_values(values)
        if not 0.0 < values.get("head_decay", 0.8) <= 1.0:
            raise ConfigError(f"heads.head_decay={values['head_decay']!r} is out of range: it must be in (0, 1]")


class HeadsTrainer(BaseTrainer):
    args: HeadsConfig

    def __init__(self, *args, base: torch.nn.Module, distance: str | None = None, ttt_steps: int = 7,
                 step_decay: float = 0.8, dflash: dict | None = None, **kwargs):
        drafter = unwrap(kwargs["model"])
        # EAGLE-3: k = the training-time-test steps (pardec.training.heads.eagle), weighted step_decay ** i;
        # DFlash: k = the block's predicted slots (pardec.training.heads.dflash)
        self.eagle3 = drafter.kind == "eagle3"
        self.dflash = dflash if drafter.kind == "dflash" else None
        self.k = ttt_steps if self.eagle3 else drafter.k
        self.step_decay = step_decay
        # KL(p || q) for Medusa; KL(q || p) for FIRP (Eq. 4) unless heads.distance says fkl
        self.distance = distance or ("rkl" if drafter.kind == "firp" else "fkl")
        self.log_sums_size = 3 * self.k  # loss sums, agreement sums, counts per depth
        # what the per-depth loss in the logs is: a KL to the target's distribution (Medusa, FIRP, EAGLE-3), or
        # DFlash's cross-entropy to the label (block_terms sums it whatever heads.loss trains on)
        self.logged_loss = "ce" if self.dflash is not None else "kl"
        super().__init__(*args, **kwargs)
        # trainer.gradient_checkpointing: the memory is in the frozen target's upper layers over the pseudo states
        # (forward_pseudo's checkpoint), not in the drafter, which the Trainer would try (and fail) to checkpoint
        self.checkpoint_upper = bool(self.args.gradient_checkpointing)
        for name in ("gradient_checkpointing", "activation_checkpointing"):  # (the second: transformers 5.24+)
            if hasattr(self.args, name):
                setattr(self.args, name, False)
        self.base = base.to(self.args.device).eval().requires_grad_(False)  # not a submodule of the drafter

    def window_counts(self, batches: list[dict]) -> int:
        """(position, depth) terms in the accumulation window; DFlash: the counted (anchor, slot) terms."""
        if self.dflash is not None:
            from pardec.training.heads.dflash import term_count as block_count

            return sum(block_count(b["loss_mask"], b["anchors"], b["anchor_valid"], self.k + 1) for b in batches)
        return sum(term_count(b["loss_mask"], self.k) for b in batches)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        drafter = unwrap(model)
        if self.eagle3:
            return self.eagle3_loss(model, drafter, inputs, return_outputs, num_items_in_batch)
        if self.dflash is not None:
            return self.dflash_loss(model, drafter, inputs, return_outputs, num_items_in_batch)
        ids, mask = inputs["input_ids"], inputs["loss_mask"].to(torch.bool)
        start = window_start(mask, self.k)
        teacher, student = drafter_forward(self.base, model, drafter, ids, start,
                                           checkpoint=self.checkpoint_upper and model.training)
        mask = mask[:, start:].to(student.device)
        weights = depth_weights(drafter.kind, self.k, self.args.head_decay)
        total = student.sum() * 0.0  # keeps the graph when no term counts
        count = torch.zeros((), dtype=torch.long, device=student.device)
        stats = torch.zeros(3 * self.k, dtype=torch.float64)
        for d in range(self.k):
            terms = depth_terms(teacher.to(student.device), student, mask, d, self.distance)
            if terms is None:
                continue
            kl, t_arg, s_arg, m = terms
            l_sum, c = masked_sum(kl, m)
            total = total + weights[d] * l_sum
            count = count + c
            if model.training:
                with torch.no_grad():
                    stats[d] = float(l_sum)
                    stats[self.k + d] = float(masked_sum((t_arg == s_arg).float(), m)[0])
                    stats[2 * self.k + d] = float(c)
        norm = count if num_items_in_batch is None else num_items_in_batch.to(total.device)
        loss = self.for_ranks(total / norm.clamp(min=1))
        if model.training:
            self.add_log_sums(stats)
        return (loss, student) if return_outputs else loss

    def eagle3_loss(self, model, drafter, inputs, return_outputs: bool, num_items_in_batch):
        """EAGLE-3's TTT loss (:func:`pardec.training.heads.eagle.ttt_terms`): logged ``kl_d<d>`` is the KL of step
        ``d - 1`` (its soft cross-entropy minus the restricted target's entropy), ``top1_d<d>`` its agreement with
        the target's argmax, both over the counted terms (target argmax in the draft vocabulary)."""
        from pardec.training.heads.eagle import ttt_terms
        from pardec.training.heads.target import target_pass

        ids, mask = inputs["input_ids"], inputs["loss_mask"].to(torch.bool)
        target = target_pass(self.base, ids.to(self.args.device), drafter.config.layer_ids)
        terms = ttt_terms(drafter, target, mask, self.k, self.step_decay, call=model)
        norm = (torch.tensor(term_count(mask, self.k)) if num_items_in_batch is None else num_items_in_batch)
        loss = self.for_ranks(terms.total / norm.to(terms.total.device).clamp(min=1))
        if model.training:
            self.add_log_sums(torch.cat([terms.kl, terms.agree, terms.count]))
        return (loss, terms.total) if return_outputs else loss

    def dflash_loss(self, model, drafter, inputs, return_outputs: bool, num_items_in_batch):
        """DFlash's block loss (:func:`pardec.training.heads.dflash.block_terms`): logged ``ce_d<d>`` is slot
        ``d``'s mean cross-entropy to the label (also under ``heads.loss: kl``), ``top1_d<d>`` its argmax agreement
        with the label; ``ce`` and ``top1`` their term-weighted means."""
        from pardec.training.heads.dflash import block_terms
        from pardec.training.heads.dflash import term_count as block_count
        from pardec.training.heads.target import target_pass

        o = self.dflash
        dev = self.args.device
        ids, mask = inputs["input_ids"].to(dev), inputs["loss_mask"].to(torch.bool).to(dev)
        anchors, valid = inputs["anchors"].to(dev), inputs["anchor_valid"].to(dev)
        # the target's logits only for the KL loss: for CE the pass stops at the last layer the draft reads
        target = target_pass(self.base, ids, drafter.config.layer_ids, logits=o["loss"] == "kl")
        terms = block_terms(drafter, target, self.base.model.embed_tokens, self.base.lm_head, ids, mask, anchors,
                            valid, self.k + 1, o["gamma"], o["loss"], o["weighting"], o["dpace_alpha"], call=model)
        norm = (torch.tensor(block_count(mask, anchors, valid, self.k + 1)) if num_items_in_batch is None
                else num_items_in_batch)
        loss = self.for_ranks(terms.total / norm.to(terms.total.device).clamp(min=1))
        if model.training:
            self.add_log_sums(torch.cat([terms.ce, terms.agree, terms.count]))
        return (loss, terms.total) if return_outputs else loss

    def log_metrics(self, logs: dict[str, float], sums: list[float]) -> None:
        k, name = self.k, self.logged_loss
        loss, agree, n = sums[:k], sums[k : 2 * k], sums[2 * k :]
        for d in range(k):
            logs[f"{name}_d{d + 1}"] = loss[d] / max(n[d], 1.0)
            logs[f"top1_d{d + 1}"] = agree[d] / max(n[d], 1.0)
        logs[name] = sum(loss) / max(sum(n), 1.0)
        logs["top1"] = sum(agree) / max(sum(n), 1.0)


# ------------------------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def future_ranks(base, drafter, records: list[dict], attention: str | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Teacher-forced ranks of the true future tokens on ``records`` (prompt + the target's greedy completion).
    FIRP's pseudo states see what ``attention`` says (default: decoding's, ``DECODING_ATTENTION``).

    Anchors are the positions ``t`` from the prompt's last token to the completion's third-to-last token; at
    depth ``k`` (0-based) the true token is the record's token ``t + k + 2`` (valid while it is a completion
    token). Its rank is the number of the drafter's logits at that depth strictly above its logit.
    Returns (ranks [N, K], valid [N, K], {"anchors", "target_matches_record"}).
    """
    from pardec.models.cached import CachedModel

    k = drafter.k
    all_ranks, all_valid = [], []
    same = anchors_n = 0
    device = next(base.parameters()).device
    for full, ids, anchors in held_out_windows(records, device):
        n = len(full)
        if drafter.kind == "medusa":
            hidden = base.model(input_ids=ids).last_hidden_state[0, anchors.to(device)]
            target_logits = base.lm_head(hidden)
            logits = drafter(hidden.to(next(drafter.parameters()).dtype))  # [A, K, V]
        else:
            cm = CachedModel(base)  # decoding's view: no real token after the anchor (teacher_forced off)
            out = forward_pseudo(cm, ids, drafter, drafter.layers, anchors=anchors, logits_at=anchors,
                                    attention=attention or DECODING_ATTENTION)
            target_logits, logits = out.logits[0], cm.lm_head(out.pseudo)[0]
        pos = anchors[:, None] + torch.arange(k)[None, :] + 2  # [A, K] positions of the true tokens
        valid = pos <= n - 1
        true = torch.tensor(full)[pos.clamp(max=n - 1)]
        logits = logits.float().cpu()
        true_logit = logits.gather(-1, true[..., None])
        all_ranks.append((logits > true_logit).sum(-1))
        all_valid.append(valid)
        same += int((target_logits.argmax(-1).cpu() == torch.tensor(full)[anchors + 1]).sum())
        anchors_n += len(anchors)
    if not all_ranks:
        return torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k, dtype=torch.bool), {"anchors": 0,
                                                                                         "target_matches_record": 0.0}
    return (torch.cat(all_ranks), torch.cat(all_valid),
            {"anchors": anchors_n, "target_matches_record": same / max(anchors_n, 1)})


def accuracy_report(ranks: torch.Tensor, valid: torch.Tensor, topk: int) -> dict:
    from pardec.decoding.tree_search import rank_accuracies, topk_accuracy

    acc = rank_accuracies(ranks, topk, valid)
    return {"positions": int(ranks.shape[0]), "valid_per_depth": valid.sum(0).tolist(),
            "rank_accuracy": acc, "topk_accuracy": topk_accuracy(acc)}


# ------------------------------------------------------------------------------------------- app stages
#: the corpus sequences that calibrate a DFlash draft started from the target's layers (layer_init: target)
CALIBRATION_SEQUENCES = 8


def _new_drafter(spec, base, vocab=None, records=()):
    from pardec.models.heads import new_drafter

    h = spec.heads
    if h["type"] == "dflash":  # the mask embedding starts at the mean embedding row
        draft = new_drafter("dflash", base.config, layers=h.get("layers"), embed=base.model.embed_tokens,
                            dflash={k: h[k] for k in ("num_layers", "block_size", "mask_token_id", "fusion")})
        if h.get("layer_init") == "target" and not spec.init_from:
            from pardec.models.dflash import init_from_target

            samples = [torch.tensor(list(r["prompt_ids"]) + list(r["completion_ids"]))
                       for r in list(records)[:CALIBRATION_SEQUENCES]]
            init_from_target(draft, base, samples)
        return draft
    if h["type"] == "eagle3":  # the head starts from the target's rows of the kept ids
        return new_drafter("eagle3", base.config, layers=h.get("layers"), lm_head=base.lm_head, vocab=vocab)
    if h["type"] == "medusa":
        return new_drafter("medusa", base.config, num_heads=h["num_heads"], num_blocks=h["num_blocks"],
                           lm_head=base.lm_head)
    return new_drafter("firp", base.config, layers=h["layers"], attention=h.get("attention", "real"))


def train_heads(spec, run_dir, d: Ranks) -> dict:
    """The train stage of a ``kind: heads`` experiment (``spec``: :class:`~pardec.training.heads.HeadsSpec`): a
    fresh drafter trained on ``load_completions(spec.gen.out_dir)`` (its first ``spec.corpus_fraction`` per source);
    saved with ``save_drafter`` to ``<run>/final``."""
    from transformers import PretrainedConfig

    from pardec.models.heads import num_parameters, save_drafter
    from pardec.models.loading import load_model, trainable
    from pardec.training.completions import CompletionDataset, corpus_share, load_completions

    args = training_args(HeadsConfig, spec, run_dir, head_decay=spec.head_decay)  # before the model (ZeRO-3)
    records = corpus_share(load_completions(spec.gen.out_dir), spec.corpus_fraction)
    lm = load_model(trainable(spec.model, spec.model_dtype))  # the Trainer places the drafter
    base = lm.model.requires_grad_(False)
    eagle3 = spec.heads["type"] == "eagle3"
    dflash = spec.heads["type"] == "dflash"
    vocab, vocab_facts = eagle3_vocab(spec, records, lm) if eagle3 else (None, {})
    with torch.random.fork_rng(devices=[]):  # EAGLE-3's / DFlash's random layers: the same init on every rank and rerun
        torch.manual_seed(args.seed)
        drafter = _new_drafter(spec, base, vocab, records)
    history: list[dict] = []  # the runs this drafter was trained in before this one (heads.init_from)
    if spec.init_from:
        history, prior = continue_from(spec.init_from, drafter, base.config, spec.heads["type"])
        if eagle3:  # its draft vocabulary is the one it was trained with (continue_from loaded its maps)
            vocab_facts = {k: prior[k] for k in vocab_facts if k in prior}
    # DeepSpeed's "auto" bucket sizes (conf/deepspeed/*.json: reduce_bucket_size) are filled from model.config's
    # hidden_size (transformers' HfTrainerDeepSpeedConfig); the drafter is a plain module: it gets the target's
    # (EAGLE-3's draft keeps its own Eagle3Config, whose hidden_size is the target's)
    if not (eagle3 or dflash):
        drafter.config = PretrainedConfig(hidden_size=base.config.hidden_size)
    ds = CompletionDataset(records, args.max_length)
    pad = lm.tokenizer.pad_token_id
    firp = spec.heads["type"] == "firp"
    distance = spec.heads.get("distance", "rkl") if firp else "fkl"
    steps = {"ttt_steps": spec.heads["ttt_steps"], "step_decay": spec.heads["step_decay"]} if eagle3 else {}
    pad = 0 if pad is None else pad
    if dflash:
        from pardec.training.heads.dflash import DFlashCollator, EpochCallback

        collator = DFlashCollator(pad, num_anchors=spec.heads["num_anchors"], seed=args.seed)
        steps = {k: spec.heads[k] for k in ("num_anchors", "gamma", "loss", "weighting", "dpace_alpha")}
    else:
        collator = RightPadCollator(pad)
    trainer = HeadsTrainer(model=drafter, args=args, train_dataset=ds, data_collator=collator, base=base,
                           distance=distance, **({"dflash": steps} if dflash else steps))
    if dflash:
        trainer.add_callback(EpochCallback(collator))

    def finish(final, trained: dict) -> dict:  # the training facts go into drafter.json too
        tokens = sum(len(ds[i]["input_ids"]) for i in range(len(ds)))
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * d.world
        facts = {**trained, "samples": len(ds), "tokens": tokens, "epochs": args.num_train_epochs,
                 "corpus_fraction": spec.corpus_fraction, "sequences_per_step": per_step,
                 "experiment": spec.experiment,
                 **continuation_facts(history, {"experiment": spec.experiment, "steps": trained["steps"],
                                                "samples": len(ds), "tokens": tokens, "sequences_per_step": per_step},
                                      spec.init_from),
                 **({"distance": distance} if firp else {} if eagle3 or dflash else {"head_decay": spec.head_decay}),
                 **steps, **vocab_facts, **({"layer_init": spec.heads["layer_init"]} if dflash else {})}
        if d.rank == 0:
            save_drafter(trainer.model, final, base.config, spec.model.name, extra=facts)
        return {**facts, "truncated_samples": ds.n_truncated, "kind": spec.heads["type"],
                "trainable_parameters": num_parameters(drafter), "final_drafter": str(final)}

    return fit(trainer, spec, run_dir, d, finish)


def continue_from(path: str, drafter, base_config, kind: str) -> tuple[list[dict], dict]:
    """Load the trained drafter at ``path`` into the fresh ``drafter`` (every tensor, EAGLE-3's vocabulary maps
    included; one line naming the tensors whose shapes differ); returns (the runs it was trained in, its
    ``drafter.json``)."""
    from pardec.models.heads import load_drafter

    prior, meta = load_drafter(path, base_config, kind, key="heads.init_from")
    want, have = drafter.state_dict(), prior.state_dict()
    bad = sorted(k for k in set(want) | set(have) if k not in want or k not in have or want[k].shape != have[k].shape)
    if bad:
        raise ConfigError(f"heads.init_from={path}: its drafter is not shaped like this experiment's ({len(bad)} "
                          f"tensor(s) differ, e.g. {bad[0]}); give the settings it was trained with")
    drafter.load_state_dict(have)
    history = meta.get("history") or [{k: meta.get(k) for k in ("experiment", "steps", "samples", "tokens",
                                                                 "sequences_per_step")}]
    return history, meta


def continuation_facts(history: list[dict], this: dict, init_from: str | None) -> dict:
    """drafter.json's account of a drafter trained over several runs: each run's steps and data, and the totals."""
    if not init_from:
        return {}
    runs = [*history, this]
    known = all(r.get("sequences_per_step") for r in runs)
    return {"init_from": init_from, "history": runs, "total_steps": sum(int(r.get("steps") or 0) for r in runs),
            "total_sequences": sum(r["steps"] * r["sequences_per_step"] for r in runs) if known else None}


def eagle3_vocab(spec, records: list[dict], lm):
    """EAGLE-3's draft vocabulary: ``heads.draft_vocab_size`` ids from the completion tokens' counts (specials, pad
    and EOS always kept; reference cnets.py ``process_data`` l. 457-469 and ``scandata`` l. 666-674:
    the corpus's most common tokens, counted over the assistant tokens). Every rank reads the same merged records and counts them the same way (a Counter's
    totals do not depend on order, ``choose_vocab`` breaks ties by id), so all ranks build the same vocabulary
    without a broadcast. Returns (DraftVocab, facts: the size and the share of completion tokens it covers, the
    reference's "top N token frequency ratio")."""
    from collections import Counter

    from pardec.models.vocab import DraftVocab, choose_vocab

    tok, target = lm.tokenizer, lm.model
    counts = Counter(t for r in records for t in r["completion_ids"])
    special = {*tok.all_special_ids, tok.pad_token_id, *lm.eos_ids}
    size = spec.heads["draft_vocab_size"]
    vocab_size = int(target.config.vocab_size)
    if size > vocab_size:
        raise ConfigError(f"heads.draft_vocab_size={size} is out of range: it must be in [2, {vocab_size}] "
                          f"(the target's vocabulary)")
    ids = choose_vocab(counts, size, sorted(i for i in special if i is not None), vocab_size)
    kept = set(ids)
    total = sum(counts.values())
    covered = sum(c for t, c in counts.items() if t in kept) / max(1, total)
    log.info("eagle3 draft vocabulary: top %d token frequency ratio %.2f%% (%d distinct of %d completion tokens)",
             size, 100 * covered, len(counts), total)
    return DraftVocab(ids, vocab_size), {"draft_vocab_size": size, "draft_vocab_coverage": covered,
                                         "corpus_distinct_tokens": len(counts), "corpus_completion_tokens": total}


def evaluate_chain(spec, run_dir, lm, drafter, final) -> dict:
    """The eval stage of the drafters that draft a chain (no tree search), per source and pooled, into
    ``<run>/heads_eval.json``: EAGLE-3's held-out chain acceptance by depth
    (:func:`pardec.training.heads.eagle.acceptance`; it drafts its tree dynamically), DFlash's acceptance by block
    position (:func:`pardec.training.heads.dflash.acceptance`)."""
    from pardec.models.heads import num_parameters
    from pardec.training.completions import load_completions, run_generation
    from pardec.training.heads.heldout import merge_acceptance

    kind = drafter.kind
    result: dict = {"drafter": str(final), "kind": kind, "target": spec.model.name,
                    "layer_ids": drafter.config.layer_ids, "parameters": num_parameters(drafter), "topk": spec.topk,
                    "per_dataset": {}}
    if kind == "eagle3":
        from pardec.training.heads.eagle import acceptance

        steps = int(spec.heads["ttt_steps"])
        result.update(steps=steps, draft_vocab_size=drafter.config.draft_vocab_size)

        def measure(records):
            return acceptance(lm.model, drafter, records, steps, spec.topk)
    else:
        from pardec.training.heads.dflash import acceptance

        block = drafter.config.block_size
        result.update(steps=block - 1, block_size=block, fusion=drafter.config.fusion)

        def measure(records):
            return acceptance(lm.model, drafter, records, block, spec.topk)
    parts = []
    for g in spec.eval_gen:
        run_generation(g, lm, 0, 1, None, "eval")
        part = measure(load_completions(g.out_dir, "stage=eval"))
        result["per_dataset"][g.sources[0].dataset.name] = part
        parts.append(part)
    result["overall"] = merge_acceptance(parts)
    result["positions"] = result["overall"]["anchors"]
    result["expected_tokens_per_forward"] = result["overall"]["expected_tokens_per_forward"]
    (run_dir / "heads_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate_heads(spec, run_dir) -> dict:
    """The eval stage: greedy target completions of each held-out source (resumable, own out dir), the ranks of the
    true future tokens under ``<run>/final`` at each depth, per-rank accuracies, and trees searched for
    ``spec.budgets`` (``<run>/final/trees/T<budget>.json``); all into ``<run>/heads_eval.json``. FIRP is measured in
    both attention views (``attention_views``: FIRP Fig. 7's No masked vs Masked); its main figures and trees are
    decoding's default view."""

    from pardec.decoding.tree_search import chain_paths, expected_accept_length, save_tree, search_tree
    from pardec.models.heads import load_drafter, num_parameters
    from pardec.models.loading import load_model
    from pardec.training.completions import load_completions, run_generation

    final = run_dir / "final"
    if not (final / "drafter.json").is_file():
        raise FileNotFoundError(f"no trained drafter in {final}; run stage=train first")
    lm = load_model(spec.model)  # the run's dtype: fp32 on CPU, bf16 on GPU, as the decoders will run it
    kind = spec.heads["type"]
    drafter, meta = load_drafter(final, lm.model.config, kind, key="final")
    drafter = drafter.to(lm.model.device)
    if kind in ("eagle3", "dflash"):
        return evaluate_chain(spec, run_dir, lm, drafter.to(lm.model.dtype), final)
    result: dict = {"drafter": str(final), "kind": kind, "target": spec.model.name, "k": drafter.k,
                    "parameters": num_parameters(drafter), "topk": spec.topk, "per_dataset": {}}
    # FIRP: decoding's view first (the main figures and the trees), then the other (Fig. 7's comparison)
    views = [DECODING_ATTENTION] + [a for a in PSEUDO_ATTENTION if a != DECODING_ATTENTION] if kind == "firp" else [None]
    ranks_all, valid_all = {v: [] for v in views}, {v: [] for v in views}
    for g in spec.eval_gen:
        run_generation(g, lm, 0, 1, None, "eval")
        records = load_completions(g.out_dir, "stage=eval")
        for v in views:
            ranks, valid, extra = future_ranks(lm.model, drafter, records, attention=v)
            if v == views[0]:
                result["per_dataset"][g.sources[0].dataset.name] = {**accuracy_report(ranks, valid, spec.topk),
                                                                    **extra}
            ranks_all[v].append(ranks)
            valid_all[v].append(valid)
    if kind == "firp":
        names = {"pseudo": "No masked", "real": "Masked"}
        result["decoded_attention"] = views[0]
        result["attention_views"] = {
            v: {"fig7_name": names[v], **accuracy_report(torch.cat(ranks_all[v]), torch.cat(valid_all[v]), spec.topk)}
            for v in views}
    ranks, valid = torch.cat(ranks_all[views[0]]), torch.cat(valid_all[views[0]])
    overall = accuracy_report(ranks, valid, spec.topk)
    result["overall"] = overall
    result["positions"] = overall["positions"]
    acc = overall["rank_accuracy"]
    result["trees"] = {"chain": {"nodes": drafter.k,
                                 "expected_accept_length": expected_accept_length(acc, chain_paths(drafter.k))}}
    source = {"drafter": str(final), "kind": kind, "target": spec.model.name, "experiment": spec.experiment,
              "positions": overall["positions"], "topk": spec.topk}
    for b in spec.budgets:
        paths = search_tree(acc, b)
        f = save_tree(final / "trees" / f"T{b}.json", f"T{b}", paths, acc, {**source, "budget": b})
        result["trees"][f"T{b}"] = {"nodes": len(paths), "expected_accept_length": expected_accept_length(acc, paths),
                                    "file": str(f)}
    (run_dir / "heads_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
