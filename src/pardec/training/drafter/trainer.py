"""`DrafterConfig` + `DrafterTrainer`: train a drafter on the frozen target's own greedy completions, plus its held-out
evaluation and tree search. What differs by drafter type (its construction, collator, loss, normaliser, logs and
held-out evaluation) is the type's (:mod:`pardec.training.drafter.types`: :mod:`.medusa`, :mod:`.firp`, :mod:`.eagle`,
:mod:`.dflash`); this module names no type.

The trainer's model is the drafter (a plain ``nn.Module``); the target ("base") is frozen, kept outside the
optimizer and the DeepSpeed engine (as DraftTrainer's teacher) and moved to the args' device. Each sample is
``prompt + completion[:-1]`` (:class:`~pardec.training.completions.CompletionDataset`, cut from the left to
``max_length``), right-padded by :class:`~pardec.training.drafter.batches.RightPadCollator`: pads sit at the end, so
no real token and no pseudo state ever attends to one and no key mask is needed.

Loss (soft targets, temperature 1): for depth ``k`` (0-based) and position ``t``, a KL divergence between
``p_{t+k+1}``, the base's next-token distribution at position ``t + k + 1`` (detached), and ``q_{t,k}``, head ``k``
(Medusa) / pseudo step ``k`` (FIRP) at anchor ``t``: both predict the token at ``t + k + 2``. Medusa: ``KL(p || q)``
(self-distillation). FIRP: ``KL(q || p)`` by default (``drafter.distance: rkl``; the paper's Eq. 4, KL(P~ || P) with P~
the distribution from the pseudo state); ``fkl`` keeps pardec's earlier ``KL(p || q)``. A term counts where
``p_{t+k+1}`` predicts a completion token (the loss mask of position ``t + k + 1``; never a pad). Weights: Medusa
``head_decay ** k`` (Medusa-1's decay), FIRP 1 per step (the paper sums the steps). The weighted sum is divided by
the number of (position, depth) terms in the whole gradient-accumulation window (summed over ranks), so
accumulation gives the big-batch gradient.

FIRP with ``drafter.attention: real`` (the default; FIRP §3.3) is trained teacher-forced: pseudo step ``i`` of anchor
``t`` sees the real tokens up to ``t + i`` (its own position minus one) and itself, never another pseudo state, so
its loss reaches projection ``i`` alone: the K projections are trained separately, in one forward (what still ties
them: the global gradient-norm clip and the shared normaliser). ``attention: pseudo`` (pardec's earlier pattern)
trains them jointly: step ``i`` sees the anchor's prefix and steps ``< i``, so a later step's loss also reaches the
earlier projections through attention. The held-out evaluation measures ranks under decoding's conditions (no real
token after the anchor); for FIRP in both views a pseudo state can have at decoding (FIRP §4.3 / Fig. 7): "No masked"
(``pseudo``: it also sees the anchor's earlier pseudo states; decoding's default, the view the trees are searched on)
and "Masked" (``real``: the real states and itself).

DFlash (``drafter.type: dflash``): the block loss of :mod:`pardec.training.drafter.dflash` (K = the block's slots
``block_size - 1``, anchors drawn by :class:`~pardec.training.drafter.dflash.DFlashCollator`, normalised by the
window's counted terms) and its own eval stage (held-out acceptance by block position).

EAGLE-3 (``drafter.type: eagle3``): the training-time-test loss of :mod:`pardec.training.drafter.eagle` (K = the TTT
steps, weights ``step_decay ** k``, the same window normaliser), its vocabulary from the corpus
(:func:`~pardec.training.drafter.vocab.corpus_vocab`)
and its own eval stage (:func:`evaluate_chain`: held-out chain acceptance by depth, no trees).

Logged beside loss / lr / grad_norm, per depth ``d = k + 1``: ``kl_d<d>`` (the mean training KL) and ``top1_d<d>``
(teacher-forced top-1 agreement: student argmax == teacher argmax), plus their term-weighted means ``kl`` and
``top1``; DFlash logs ``ce_d<d>`` and ``ce`` in place of the KL (:meth:`~pardec.training.drafter.dflash.DFlashType.loss`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PretrainedConfig

from pardec.config import ConfigError, Ranks
from pardec.decoding.tree_search import (
    chain_paths,
    expected_accept_length,
    rank_accuracies,
    save_tree,
    search_tree,
    topk_accuracy,
)
from pardec.models.drafters import load_drafter, num_parameters, save_drafter
from pardec.models.loading import load_model, trainable
from pardec.training.base import BaseConfig, BaseTrainer, fit, training_args, unwrap
from pardec.training.completions import CompletionDataset, corpus_share, load_completions, run_generation
from pardec.training.drafter.batches import held_out_windows
from pardec.training.drafter.heldout import merge_acceptance
from pardec.training.drafter.target import FeatureCache, TargetPass, target_pass
from pardec.training.drafter.types import drafter_type
from pardec.training.losses import masked_sum, token_divergence

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------- data
def window_start(loss_mask: torch.Tensor, k: int) -> int:
    """The first anchor any term needs: ``k`` before the first masked position of any row (0 if none sooner)."""
    any_row = loss_mask.any(0)
    if not bool(any_row.any()):
        return max(0, loss_mask.shape[1] - 1)
    return max(0, int(any_row.float().argmax()) - k)


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
class DrafterConfig(BaseConfig):
    head_decay: float = field(default=0.8, metadata={"help": "Medusa: head k (0-based) weighs head_decay**k"})

    @classmethod
    def check_values(cls, values: dict) -> None:
        super().check_values(values)
        if not 0.0 < values.get("head_decay", 0.8) <= 1.0:
            raise ConfigError(f"drafter.head_decay={values['head_decay']!r} is out of range: it must be in (0, 1]")


class DrafterTrainer(BaseTrainer):
    args: DrafterConfig

    def __init__(self, *args, base: torch.nn.Module, distance: str | None = None, ttt_steps: int = 7, step_decay:
                 float = 0.8, dflash: dict | None = None, features: FeatureCache | None = None, **kwargs):
        drafter = unwrap(kwargs["model"])
        self.type = drafter_type(drafter.kind)  # the drafter type's loss, normaliser and logs
        self.ttt_steps, self.step_decay = ttt_steps, step_decay  # EAGLE-3's training-time test
        self.dflash = dflash  # DFlash's block-loss options
        self.k = self.type.loss_k(drafter, self)  # the loss's terms per anchor (EAGLE-3: its TTT steps)
        # the depth loss's divergence: the type's default (FIRP's Eq. 4: KL(q || p)) unless drafter.distance says
        self.distance = distance or self.type.default_distance
        self.log_sums_size = 3 * self.k  # loss sums, agreement sums, counts per depth
        # what the per-depth loss in the logs is: a KL to the target's distribution (Medusa, FIRP, EAGLE-3), or
        # DFlash's cross-entropy to the label
        self.logged_loss = self.type.logged_loss
        super().__init__(*args, **kwargs)
        # trainer.gradient_checkpointing: the memory is in the frozen target's upper layers over the pseudo states
        # (forward_pseudo's checkpoint), not in the drafter, which the Trainer would try (and fail) to checkpoint
        self.checkpoint_upper = bool(self.args.gradient_checkpointing)
        for name in ("gradient_checkpointing", "activation_checkpointing"):  # (the second: transformers 5.24+)
            if hasattr(self.args, name):
                setattr(self.args, name, False)
        self.base = base.to(self.args.device).eval().requires_grad_(False)  # not a submodule of the drafter
        self.features = features  # drafter.feature_cache: the target's states kept on disk

    def target_pass(self, inputs: dict, layer_ids, logits: bool = True) -> TargetPass:
        """The frozen target's pass over the batch (:func:`target_pass`), or read from ``drafter.feature_cache``."""
        ids = inputs["input_ids"].to(self.args.device)
        if not self.features:
            return target_pass(self.base, ids, layer_ids, logits=logits)
        return self.features.target_pass(self.base, ids, inputs["valid"].to(ids.device), logits=logits)

    def window_counts(self, batches: list[dict]) -> int:
        """The loss's terms in the accumulation window (the type's count: (position, depth) terms by default)."""
        return self.type.window_count(batches, self.k)

    def compute_loss(self, model, inputs, return_outputs: bool = False, num_items_in_batch=None):
        return self.type.loss(self, model, unwrap(model), inputs, return_outputs, num_items_in_batch)

    def depth_loss(self, model, drafter, inputs, return_outputs: bool, num_items_in_batch):
        """The depth loss of heads ranked at every depth (Medusa, FIRP; the module doc): the type's logits of
        every anchor of the batch's window, each depth's divergence to the target's, weighted by depth."""
        ids, mask = inputs["input_ids"], inputs["loss_mask"].to(torch.bool)
        start = window_start(mask, self.k)
        teacher, student = self.type.depth_logits(self.base, model, drafter, ids, torch.arange(start, ids.shape[1]),
                                                  training=True, checkpoint=self.checkpoint_upper and model.training)
        mask = mask[:, start:].to(student.device)
        weights = self.type.depth_weights(self.k, self.args.head_decay)
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

    htype = drafter_type(drafter.kind)
    k = drafter.k
    all_ranks, all_valid = [], []
    same = anchors_n = 0
    device = next(base.parameters()).device
    for full, ids, anchors in held_out_windows(records, device):
        n = len(full)
        target_logits, logits = htype.depth_logits(base, drafter, drafter, ids, anchors.to(device), training=False,
                                                   attention=attention)
        target_logits, logits = target_logits[0], logits[0]  # [A, V], [A, K, V]
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
    acc = rank_accuracies(ranks, topk, valid)
    return {"positions": int(ranks.shape[0]), "valid_per_depth": valid.sum(0).tolist(),
            "rank_accuracy": acc, "topk_accuracy": topk_accuracy(acc)}


# ------------------------------------------------------------------------------------------- app stages
def _new_drafter(spec, base, lm=None, records=()):
    """A fresh drafter of the run's type for ``base`` (and the facts of its making): the type's own
    (:meth:`~pardec.training.drafter.types.DrafterType.new`)."""
    return drafter_type(spec.drafter["type"]).new(spec, base, lm, list(records))


def train_drafter(spec, run_dir, ranks: Ranks) -> dict:
    """The train stage of a ``kind: drafter`` experiment (``spec``: :class:`~pardec.training.drafter.DrafterSpec`): a
    fresh drafter trained on ``load_completions(spec.gen.out_dir)`` (its first ``spec.corpus_fraction`` per source);
    saved with ``save_drafter`` to ``<run>/final``."""
    args = training_args(DrafterConfig, spec, run_dir, head_decay=spec.head_decay)  # before the model (ZeRO-3)
    records = corpus_share(load_completions(spec.gen.out_dir), spec.corpus_fraction)
    lm = load_model(trainable(spec.model, spec.model_dtype))  # the Trainer places the drafter
    base = lm.model.requires_grad_(False)
    htype = drafter_type(spec.drafter["type"])
    with torch.random.fork_rng(devices=[]):  # random layers (EAGLE-3, DFlash): the same init on every rank and rerun
        torch.manual_seed(args.seed)
        drafter, made = _new_drafter(spec, base, lm, records)
    history: list[dict] = []  # the runs this drafter was trained in before this one (drafter.init_from)
    if spec.init_from:
        history, prior, fresh = continue_from(spec.init_from, drafter, base.config, spec.drafter["type"])
        # what the drafter was made with is the trained one's (EAGLE-3's vocabulary: continue_from loaded its maps),
        # unless this run made it afresh (a reduced head grown on a whole-vocabulary DFlash drafter)
        made = made if fresh else {k: prior[k] for k in made if k in prior}
    # DeepSpeed's "auto" bucket sizes (conf/deepspeed/*.json: reduce_bucket_size) are filled from model.config's
    # hidden_size (transformers' HfTrainerDeepSpeedConfig); a drafter without a config of its own (a plain module)
    # gets the target's (EAGLE-3's and DFlash's drafts keep their own, whose hidden_size is the target's)
    if not hasattr(drafter, "config"):
        drafter.config = PretrainedConfig(hidden_size=base.config.hidden_size)
    ds = CompletionDataset(records, args.max_length)
    pad = lm.tokenizer.pad_token_id
    collator = htype.collator(0 if pad is None else pad, spec.drafter, args.seed)
    options = htype.trainer_options(spec.drafter, spec.head_decay)
    features = spec.feature_cache and FeatureCache(spec.feature_cache, spec.model.identity(),
                                                   drafter.config.layer_ids, final=htype.needs_target_logits(spec.drafter))
    trainer = DrafterTrainer(model=drafter, args=args, train_dataset=ds, data_collator=collator, base=base,
                           features=features, **options)
    for callback in htype.callbacks(collator):
        trainer.add_callback(callback)

    def finish(final, trained: dict) -> dict:  # the training facts go into drafter.json too
        tokens = sum(len(ds[i]["input_ids"]) for i in range(len(ds)))
        per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps * ranks.world
        facts = {**trained, "samples": len(ds), "tokens": tokens, "epochs": args.num_train_epochs,
                 "corpus_fraction": spec.corpus_fraction, "sequences_per_step": per_step,
                 "experiment": spec.experiment,
                 **continuation_facts(history, {"experiment": spec.experiment, "steps": trained["steps"],
                                                "samples": len(ds), "tokens": tokens, "sequences_per_step": per_step},
                                      spec.init_from),
                 **htype.facts(spec.drafter, spec.head_decay), **made}
        if ranks.rank == 0:
            save_drafter(trainer.model, final, base.config, spec.model.name, extra=facts)
        return {**facts, "truncated_samples": ds.n_truncated, "kind": spec.drafter["type"],
                "trainable_parameters": num_parameters(drafter), "final_drafter": str(final)}

    return fit(trainer, spec, run_dir, ranks, finish)


def continue_from(path: str, drafter, base_config, kind: str) -> tuple[list[dict], dict, set[str]]:
    """Load the trained drafter at ``path`` into the fresh ``drafter`` (every tensor, EAGLE-3's vocabulary maps
    included, but those the type keeps fresh for a drafter that has none:
    :meth:`~pardec.training.drafter.types.DrafterType.fresh_on_continue`; one line naming the tensors whose shapes
    differ); returns (the runs it was trained in, its ``drafter.json``, the tensors kept fresh)."""
    prior, meta = load_drafter(path, base_config, kind, key="drafter.init_from")
    want, have = drafter.state_dict(), prior.state_dict()
    fresh = drafter_type(kind).fresh_on_continue(drafter, prior)
    bad = sorted(k for k in set(want) | set(have) if k not in fresh
                 and (k not in want or k not in have or want[k].shape != have[k].shape))
    if bad:
        raise ConfigError(f"drafter.init_from={path}: its drafter is not shaped like this experiment's ({len(bad)} "
                          f"tensor(s) differ, e.g. {bad[0]}); give the settings it was trained with")
    drafter.load_state_dict({k: v for k, v in have.items() if k not in fresh}, strict=not fresh)
    history = meta.get("history") or [{k: meta.get(k) for k in ("experiment", "steps", "samples", "tokens",
                                                                 "sequences_per_step")}]
    return history, meta, fresh


def continuation_facts(history: list[dict], this: dict, init_from: str | None) -> dict:
    """drafter.json's account of a drafter trained over several runs: each run's steps and data, and the totals."""
    if not init_from:
        return {}
    runs = [*history, this]
    known = all(r.get("sequences_per_step") for r in runs)
    return {"init_from": init_from, "history": runs, "total_steps": sum(int(r.get("steps") or 0) for r in runs),
            "total_sequences": sum(r["steps"] * r["sequences_per_step"] for r in runs) if known else None}


def evaluate_chain(spec, run_dir, lm, drafter, final) -> dict:
    """The eval stage of the drafters that draft a chain, per source and pooled, into ``<run>/drafter_eval.json``:
    EAGLE-3's held-out chain acceptance by depth (:func:`pardec.training.drafter.eagle.acceptance`; it drafts its
    tree dynamically), DFlash's acceptance by block position (:func:`pardec.training.drafter.dflash.acceptance`) and
    the static trees searched over its slots' ranks (:func:`write_trees`; beyond the paper, which verifies a chain)."""
    kind = drafter.kind
    result: dict = {"drafter": str(final), "kind": kind, "target": spec.model.name,
                    "layer_ids": drafter.config.layer_ids, "parameters": num_parameters(drafter), "topk": spec.topk,
                    "per_dataset": {}}
    settings, measure = drafter_type(kind).chain_eval(spec, lm, drafter)
    result.update(settings)
    parts = []
    for g in spec.eval_gen:
        run_generation(g, lm, 0, 1, None, "eval")
        part = measure(load_completions(g.out_dir, "stage=eval"))
        result["per_dataset"][g.sources[0].dataset.name] = part
        parts.append(part)
    result["overall"] = merge_acceptance(parts)
    result["positions"] = result["overall"]["anchors"]
    result["expected_tokens_per_forward"] = result["overall"]["expected_tokens_per_forward"]
    # what greedy chain decoding of the held-out answers would make (heldout.walk): the figure decoding reports
    result["decoding_tokens_per_forward"] = result["overall"]["decoding_tokens_per_forward"]
    if "rank_accuracy" in result["overall"]:  # DFlash: its slots are static candidates (method.tree)
        result["trees"] = write_trees(spec, final, kind, result["overall"]["rank_accuracy"], result["positions"])
    (run_dir / "drafter_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def evaluate_drafter(spec, run_dir) -> dict:
    """The eval stage: greedy target completions of each held-out source (resumable, own out dir), the ranks of the
    true future tokens under ``<run>/final`` at each depth, per-rank accuracies, and trees searched for
    ``spec.budgets`` (``<run>/final/trees/T<budget>.json``); all into ``<run>/drafter_eval.json``. FIRP is measured in
    both attention views (``attention_views``: FIRP Fig. 7's No masked vs Masked); its main figures and trees are
    decoding's default view."""

    final = run_dir / "final"
    if not (final / "drafter.json").is_file():
        raise FileNotFoundError(f"no trained drafter in {final}; run stage=train first")
    lm = load_model(spec.model)  # the run's dtype: fp32 on CPU, bf16 on GPU, as the decoders will run it
    kind = spec.drafter["type"]
    drafter, meta = load_drafter(final, lm.model.config, kind, key="final")
    drafter = drafter.to(lm.model.device)
    if drafter_type(kind).chain:
        return evaluate_chain(spec, run_dir, lm, drafter.to(lm.model.dtype), final)
    result: dict = {"drafter": str(final), "kind": kind, "target": spec.model.name, "k": drafter.k,
                    "parameters": num_parameters(drafter), "topk": spec.topk, "per_dataset": {}}
    htype = drafter_type(kind)
    views = list(htype.eval_views)  # FIRP: decoding's view first (the main figures, the trees), then Fig. 7's other
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
    if len(views) > 1:
        result["decoded_attention"] = views[0]
        result["attention_views"] = {
            v: {"fig7_name": htype.view_names[v], **accuracy_report(torch.cat(ranks_all[v]), torch.cat(valid_all[v]), spec.topk)}
            for v in views}
    ranks, valid = torch.cat(ranks_all[views[0]]), torch.cat(valid_all[views[0]])
    overall = accuracy_report(ranks, valid, spec.topk)
    result["overall"] = overall
    result["positions"] = overall["positions"]
    result["trees"] = write_trees(spec, final, kind, overall["rank_accuracy"], overall["positions"])
    (run_dir / "drafter_eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def write_trees(spec, final: Path, kind: str, acc: list[list[float]], positions: int) -> dict:
    """The static trees searched for ``spec.budgets`` from held-out rank accuracies ``acc`` [depth][rank]
    (``<final>/trees/T<budget>.json``, what ``method.tree=T<budget>`` loads), and the chain's figure beside them."""
    depth = len(acc)
    trees = {"chain": {"nodes": depth, "expected_accept_length": expected_accept_length(acc, chain_paths(depth))}}
    source = {"drafter": str(final), "kind": kind, "target": spec.model.name, "experiment": spec.experiment,
              "positions": positions, "topk": spec.topk}
    for b in spec.budgets:
        paths = search_tree(acc, b)
        f = save_tree(final / "trees" / f"T{b}.json", f"T{b}", paths, acc, {**source, "budget": b})
        trees[f"T{b}"] = {"nodes": len(paths), "expected_accept_length": expected_accept_length(acc, paths),
                          "file": str(f)}
    return trees
