"""DFlash's block loss and its held-out acceptance, for ``drafter.type: dflash`` (Chen et al. 2026, arXiv 2602.06036;
the facts and sources: ``docs/dflash_reference.md``; the draft: :mod:`pardec.models.dflash`).

Batch: right-padded ``prompt + completion[:-1]`` with ``loss_mask[j]``: token ``x_{j+1}`` is a completion token
(:class:`DFlashCollator`, which also samples the anchors). One frozen target forward gives the states entering the
draft's target layers at every position (:func:`~pardec.training.drafter.target.target_pass`); every draft layer's
context keys/values come from them once.

* **Anchors** (the paper: "fixing the number of masked blocks per sequence and randomly sampling anchor positions
  for each sequence at every epoch"): per sequence ``num_anchors`` positions ``a`` drawn without replacement among
  those whose token ``x_a`` and next token ``x_{a+1}`` are completion tokens (SpecForge's rule), fewer when fewer
  exist (default 512: SpecForge and ``speculators``). Drawn by the collator from a generator seeded by the run's
  seed, the epoch and the sequence's tokens, so a resumed run and every rank draw the same anchors.
* **Blocks**: block ``j`` is ``[x_a, mask x (B - 1)]`` at positions ``a .. a + B - 1``; its queries see the context
  keys at positions ``< a`` and every slot of their own block, nothing of other blocks (``speculators``
  ``models/dflash/attention.py``); slot ``k >= 1`` predicts ``x_{a+k}``.
* **Loss** (``drafter.loss``): ``ce`` (default; z-lab: "we used CE loss for training the released DFlash models"),
  cross-entropy to the corpus token ``x_{a+k}``, which on pardec's corpus (the target's own greedy completions) is
  the target's greedy token; ``kl``: KL(target || draft) to the target's distribution at ``a + k - 1`` (the
  ``speculators`` option). A term counts where ``x_{a+k}`` is a completion token inside the sequence.
* **Head** (``drafter.draft_vocab_size``): null (the paper's) is the target's frozen LM head over its whole
  vocabulary; ``K`` (beyond the paper; ``speculators``' reduced layout) an own head over the training corpus's ``K``
  most common completion tokens (EAGLE-3's choice), started from the target head's rows and trained, so each slot's
  softmax runs over ``K`` ids: a label outside them adds no term but stays in the normaliser and counts as a miss
  in the logged top-1 (pardec's EAGLE-3 rule); ``kl`` restricts the target's distribution to the ``K`` ids. A
  whole-vocabulary drafter continued with a reduced head (``drafter.init_from``) starts that head the same way.
* **Position weights** (``drafter.weighting``): ``decay`` (default; the paper's Eq. 4): ``w_k = exp(-(k - 1) / gamma)``
  with ``gamma = 7`` for blocks of 16 (the paper's App. A.1 value as NeMo-Automodel and SpecForge's Qwen3-8B recipe
  carry it; ``speculators`` defaults to 4); ``dpace`` (beyond the paper: D-PACE, arXiv 2605.18810, as ``speculators``
  0.9 ``dpace_loss_decay`` computes it): from the batch's own detached per-slot probability of the label
  ``q_k = exp(-CE_k)``, ``s_k = (1 - alpha) q_k + alpha`` (``alpha = 0.5``), the prefix products ``P_k = prod_{i<=k}
  s_i`` and ``w_k = sum_{j>=k} P_j`` over the block's counted slots: a slot weighs the expected acceptance it
  can still lead to.
* **Normaliser**: the counted (anchor, slot) terms of the whole accumulation window (``speculators``'
  ``loss_function``; SpecForge divides by the sum of the weights instead, a constant factor for full blocks).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainerCallback

from pardec.config import ConfigError, check_at_least, check_choice, check_range
from pardec.models.dflash import FUSIONS, LAYER_INITS, DFlashDraft, init_from_target
from pardec.models.drafter_types import TargetParts
from pardec.training.drafter.batches import RightPadCollator
from pardec.training.drafter.heldout import summarise, walk
from pardec.training.drafter.target import target_pass
from pardec.training.drafter.types import DrafterType, check_layer_list, register_drafter_type
from pardec.training.drafter.vocab import check_vocab_size, corpus_vocab

LOSSES = ("ce", "kl")
WEIGHTINGS = ("decay", "dpace")
# ------------------------------------------------------------------------------------------- anchors
def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions ``a`` of one sequence's ``loss_mask`` [T] whose token and next token are completion tokens."""
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[1:] = loss_mask[:-1].bool() & loss_mask[1:].bool()
    return torch.nonzero(ok).flatten()


def sample_anchors(loss_mask: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Up to ``n`` anchors of one sequence, sorted, drawn without replacement with a generator seeded by ``seed``."""
    cand = anchor_candidates(loss_mask)
    if cand.numel() <= n:
        return cand
    g = torch.Generator().manual_seed(seed)
    return cand[torch.randperm(cand.numel(), generator=g)[:n]].sort().values


@dataclass
class DFlashCollator(RightPadCollator):
    """:class:`RightPadCollator` plus ``anchors`` [B, A] and ``anchor_valid`` [B, A] (rows padded with anchor 0,
    invalid). ``epoch`` is set by :class:`EpochCallback` (a fresh draw per epoch)."""

    num_anchors: int = 512
    seed: int = 0
    epoch: int = 0

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        batch = super().__call__(samples)
        rows = []
        for i, s in enumerate(samples):
            key = zlib.crc32(bytes(str((self.seed, self.epoch, list(s["input_ids"]))), "utf8"))
            rows.append(sample_anchors(batch["loss_mask"][i], self.num_anchors, key))
        width = max(1, max(len(r) for r in rows))
        anchors = torch.zeros(len(rows), width, dtype=torch.long)
        valid = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, r in enumerate(rows):
            anchors[i, : len(r)] = r
            valid[i, : len(r)] = True
        return {**batch, "anchors": anchors, "anchor_valid": valid}


class EpochCallback(TrainerCallback):
    """Tells the collator the epoch, so anchors are drawn afresh each epoch (the paper's rule)."""

    def __init__(self, collator: DFlashCollator):
        self.collator = collator

    def on_epoch_begin(self, args, state, control, **kwargs):
        self.collator.epoch = int(state.epoch or 0)


# ------------------------------------------------------------------------------------------- blocks
def label_grid(ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
               block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(labels [B, A, block - 1]: ``x_{a+k}`` for ``k = 1 .. block - 1``, counted [B, A, block - 1]: the label is a
    completion token inside the sequence and the anchor is real)."""
    t = ids.shape[1]
    pos = anchors[..., None] + torch.arange(1, block, device=anchors.device)  # [B, A, block - 1]
    inside = pos <= t - 1
    p = pos.clamp(max=t - 1)
    labels = ids.gather(1, p.flatten(1)).view_as(p)
    counted = inside & loss_mask.bool().gather(1, (p - 1).flatten(1)).view_as(p) & valid[..., None]
    return labels, counted


def term_count(loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, block: int) -> int:
    """The counted (anchor, slot) terms of a batch (the window normaliser's share)."""
    return int(label_grid(loss_mask.long(), loss_mask, anchors, valid, block)[1].sum())


def block_mask(anchors: torch.Tensor, t: int, block: int) -> torch.Tensor:
    """bool [B, A * block, t + A * block]: a block's queries see context positions before its anchor and every slot
    of their own block."""
    b, a = anchors.shape
    dev = anchors.device
    qa = anchors.repeat_interleave(block, dim=1)  # [B, Q]
    ctx = torch.arange(t, device=dev)[None, None, :] < qa[..., None]
    own = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool, device=dev)] * a)
    return torch.cat([ctx, own[None].expand(b, -1, -1)], dim=-1)


def block_outputs(drafter, target, embed, ids: torch.Tensor, anchors: torch.Tensor, block: int,
                  call=None) -> torch.Tensor:
    """The draft's outputs [B, A, block, H] for the blocks at ``anchors`` [B, A] of a batch whose target pass is
    ``target`` (:class:`~pardec.training.drafter.target.TargetPass`); ``call``: the (possibly wrapped) module."""
    call = call or drafter
    b, t = ids.shape
    context = drafter.context_kv(target.features, torch.arange(t, device=ids.device))
    x = drafter.block_inputs(embed, ids.gather(1, anchors), block)  # [B, A, block, H]
    positions = (anchors[..., None] + torch.arange(block, device=ids.device)).flatten(1)
    out = call(x.flatten(1, 2), positions, context, block_mask(anchors, t, block))
    return out.view(b, anchors.shape[1], block, -1)


def position_weights(weighting: str, ce: torch.Tensor, counted: torch.Tensor, gamma: float, alpha: float,
                     ) -> torch.Tensor:
    """Weights [B, A, S] of slots ``1 .. S`` (module docstring); ``ce`` [B, A, S] is read detached (D-PACE)."""
    s = ce.shape[-1]
    if weighting == "decay":
        w = torch.exp(-torch.arange(s, device=ce.device, dtype=torch.float32) / gamma)
        return w.expand_as(ce) * counted
    with torch.no_grad():
        smooth = (1 - alpha) * torch.exp(-ce.detach().float()) + alpha
        smooth = torch.where(counted, smooth, torch.ones_like(smooth))
        prefix = smooth.cumprod(-1) * counted
        return prefix.flip(-1).cumsum(-1).flip(-1) * counted


@dataclass
class BlockTerms:
    """The weighted loss sum (graph) and, per slot, detached sums for the logs: CE, top-1 agreement with the label,
    counted terms (each [S] float64)."""

    total: torch.Tensor
    ce: torch.Tensor
    agree: torch.Tensor
    count: torch.Tensor


def slot_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots' fp32 log-probabilities [B, A, S, V] and the NLL of their labels [B, A, S] (the loss path whose
    memory pardec.plan's LOSS_PEAK["dflash"] measures)."""
    logq = logits.float().log_softmax(-1)
    return logq, -logq.gather(-1, labels[..., None])[..., 0]


def block_terms(drafter, target, embed, lm_head, ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                valid: torch.Tensor, block: int, gamma: float, loss: str = "ce", weighting: str = "decay",
                alpha: float = 0.5, call=None) -> BlockTerms:
    """DFlash's loss terms of one batch (module docstring)."""
    out = block_outputs(drafter, target, embed, ids, anchors, block, call)[:, :, 1:]  # slots 1 .. block - 1
    labels, counted = label_grid(ids, loss_mask, anchors, valid, block)
    kept, index = draft_labels(drafter, labels)
    logq, nll = slot_nll(drafter.logits(out, lm_head), index)
    nll = torch.where(kept, nll, torch.zeros_like(nll))  # a label the reduced head cannot name: no term (EAGLE-3's rule)
    if loss == "ce":
        per = nll
    else:  # KL(p || q) to the target's distribution at a + k - 1 (restricted to a reduced head's ids)
        t = ids.shape[1]
        src = (anchors[..., None] + torch.arange(block - 1, device=ids.device)).clamp(max=t - 1)
        with torch.no_grad():
            logp = target.logits.gather(1, src.flatten(1)[..., None].expand(-1, -1, target.logits.shape[-1]))
            if drafter.config.reduced:
                logp = logp[..., drafter.to_target(torch.arange(logq.shape[-1], device=logp.device))]
            logp = logp.view(*src.shape, -1).float().log_softmax(-1)
        per = (logp.exp() * (logp - logq)).sum(-1)
    # D-PACE reads a label the head cannot name as probability 0
    w = position_weights(weighting, torch.where(kept, nll, torch.full_like(nll, float("inf"))), counted, gamma, alpha)
    total = (per * w).sum()
    with torch.no_grad():
        ce_sum = (nll * counted).sum((0, 1)).double().cpu()
        agree = ((drafter.to_target(logq.argmax(-1)) == labels) & counted).sum((0, 1)).double().cpu()
        count = counted.sum((0, 1)).double().cpu()
    return BlockTerms(total, ce_sum, agree, count)


def draft_labels(drafter, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each target-id label is one of the draft's ids, its index in :meth:`DFlashDraft.logits`' last
    dimension: the label itself for a whole-vocabulary drafter, its draft id (0 where it has none) for a reduced
    head)."""
    if not drafter.config.reduced:
        return torch.ones_like(labels, dtype=torch.bool), labels
    t2d = drafter.t2d.to(labels.device)
    return t2d[labels], (t2d.long().cumsum(0) - 1).clamp(min=0)[labels]


# ------------------------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def acceptance(base, drafter, records: list[dict], block: int, topk: int = 10, chunk: int = 32) -> dict:
    """Held-out acceptance by block position of a DFlash draft on ``records`` (prompt + the target's greedy
    completion), teacher-forced on the record: for every anchor ``a`` from the first completion token to the
    second-to-last, the block ``[x_a, mask ...]`` over the target's features before ``a``; slot ``k``'s argmax is
    accepted when it equals ``x_{a+k}`` and slots ``1 .. k - 1`` were accepted (decoding's chain rule: the target's
    greedy tokens are the record's). A slot counts while its token is in the record. The figures of
    :func:`pardec.training.drafter.heldout.summarise` with ``steps = block - 1`` (``expected_tokens_per_forward`` =
    1 + the mean accepted run), and each slot's rank accuracies (how often the record's token is the slot's rank-r
    draft, r < ``topk``, whatever the slots before it drafted: the independence model of a static tree's search,
    :func:`pardec.decoding.tree_search.search_tree`)."""
    device = next(base.parameters()).device
    s = block - 1
    acc_rows, valid_rows = [], []
    # [slot, r]: counted anchors whose true token is the slot's rank-r draft (the top-k ids are distinct: at most one
    # r per anchor, so rank 0 is the top-1 agreement and the row's sum the top-k containment)
    rank = torch.zeros(s, topk, dtype=torch.long)
    same = anchors_n = walk_tokens = walk_forwards = 0
    for r in records:
        full = list(r["prompt_ids"]) + list(r["completion_ids"])
        p, n = len(r["prompt_ids"]), len(full)
        if n - 2 < p:
            continue
        ids = torch.tensor([full[:-1]], device=device)
        tp = target_pass(base, ids, drafter.config.layer_ids)
        truth = torch.tensor(full)
        runs: list[int] = []  # each anchor's accepted run, in order (the walk's input)
        for lo in range(p, n - 1, chunk):
            anchors = torch.arange(lo, min(lo + chunk, n - 1))
            a = anchors.to(device)[None]
            out = block_outputs(drafter, tp, base.model.embed_tokens, ids, a, block)[0, :, 1:]
            logits = drafter.logits(out, base.lm_head).float().cpu()  # [A, S, V]
            pos = anchors[:, None] + torch.arange(1, block)[None]
            valid = pos <= n - 1
            true = truth[pos.clamp(max=n - 1)]
            top = drafter.to_target(logits.topk(min(topk, logits.shape[-1]), -1).indices.to(device)).cpu()
            hit = top[..., 0] == true
            acc_rows.append(hit.long().cumprod(1).bool())
            valid_rows.append(valid)
            runs += (acc_rows[-1] & valid).sum(1).tolist()
            at = (top == true[..., None]) & valid[..., None]  # [A, S, topk]
            rank[:, : at.shape[-1]] += at.sum(0)
            same += int((tp.logits[0, a[0]].argmax(-1).cpu() == truth[anchors + 1]).sum())
            anchors_n += len(anchors)
        walk_tokens, walk_forwards = walk_tokens + n - p, walk_forwards + walk(runs)
    if not acc_rows:
        acc = valid = torch.zeros(0, s, dtype=torch.bool)
    else:
        acc, valid = torch.cat(acc_rows), torch.cat(valid_rows)
    prev = torch.cat([valid[:, :1], acc[:, :-1]], 1)
    counts = {"valid": valid.sum(0).tolist(), "accepted": (acc & valid).sum(0).tolist(),
              "reached": (prev & valid).sum(0).tolist(), "topk": rank.sum(1).tolist(),
              "top1": rank[:, 0].tolist(), "rank": rank.tolist(), "anchors": anchors_n,
              "target_matches": same, "walk_tokens": walk_tokens, "walk_forwards": walk_forwards}
    return summarise(counts, s, topk)


# ------------------------------------------------------------------------------------------- the type
#: the corpus sequences that calibrate a DFlash draft started from the target's layers (layer_init: target)
CALIBRATION_SEQUENCES = 8


@dataclass
class DFlashOptions:
    """DFlash's options: the defaults are the paper's and its reference trainers' (the module docstring and
    ``docs/dflash_reference.md`` cite each), the choices the ablations'."""

    num_layers: int = field(default=5, metadata={"help": "draft layers (target width)"})
    block_size: int = field(default=16, metadata={"help": "the block: the anchor and block_size - 1 mask slots"})
    num_anchors: int = field(default=512, metadata={"help": "anchors drawn per sequence and epoch"})
    gamma: float = field(default=7.0, metadata={"help": "weighting=decay: slot k weighs exp(-(k - 1) / gamma) (App. A.1)"})
    loss: str = field(default="ce", metadata={"help": "per slot: ce to the label, or kl to the target (LOSSES)"})
    weighting: str = field(default="decay", metadata={"help": "slot weights: decay (the paper's) or dpace (WEIGHTINGS)"})
    dpace_alpha: float = field(default=0.5, metadata={"help": "weighting=dpace: the smoothing of D-PACE's weights"})
    fusion: str = field(default="concat", metadata={
        "help": "concat: fc over the concatenated target states (the paper's); layerwise: DFlare's per-layer mix"})
    mask_token_id: int | None = field(default=None, metadata={
        "help": "the mask slots' embedding row (null: a learned mask embedding)"})
    layer_init: str = field(default="random", metadata={
        "help": "random (the paper's) or target: copies of the target's layers at drafter.layers (LAYER_INITS)"})
    layers: list[int] | None = field(default=None, metadata={
        "help": "the target layers whose states are fused (null: DFlash's evenly spaced layers, one per draft layer; "
                "layer_init=target: the target's first num_layers layers)"})
    draft_vocab_size: int | None = field(default=None, metadata={
        "help": "null: the target's whole vocabulary through its frozen head (the paper's); K: an own head over the "
                "corpus's K most common tokens (speculators' layout, EAGLE-3's choice of ids)"})

    def __post_init__(self) -> None:
        """Each range and choice; ``layer_init=target`` reads one target layer per draft layer."""
        for key, lo in (("num_layers", 1), ("block_size", 2), ("num_anchors", 1)):
            check_at_least(f"drafter.{key}", getattr(self, key), lo, integer=True)
        check_range("drafter.gamma", self.gamma, 0, 1e9, integer=False, open_lo=True)
        check_range("drafter.dpace_alpha", self.dpace_alpha, 0, 1, integer=False, open_lo=True)
        check_choice("drafter.loss", self.loss, LOSSES)
        check_choice("drafter.weighting", self.weighting, WEIGHTINGS)
        check_choice("drafter.fusion", self.fusion, FUSIONS)
        if self.mask_token_id is not None:
            check_at_least("drafter.mask_token_id", self.mask_token_id, 0, integer=True)
        if self.draft_vocab_size is not None:
            check_at_least("drafter.draft_vocab_size", self.draft_vocab_size, 2, integer=True)
        check_choice("drafter.layer_init", self.layer_init, LAYER_INITS)
        if self.layers is not None:
            check_layer_list(self.layers, "the states entering them are fused; null: DFlash's evenly spaced layers, "
                                          "one per draft layer")
        if self.layer_init == "target":  # draft layer i is a copy of target layer layers[i] reading its own state
            if self.fusion != "layerwise":
                raise ConfigError(f"drafter.layer_init=target needs drafter.fusion=layerwise (each draft layer reads the "
                                  f"state entering the target layer it copies), not {self.fusion!r}")
            if self.layers is None:  # the target's first num_layers layers
                self.layers = list(range(self.num_layers))
            elif len(self.layers) != self.num_layers:
                raise ConfigError(f"drafter.layers={self.layers} is not valid with drafter.layer_init=target: give one "
                                  f"target layer per draft layer ({self.num_layers}; null: layers 0..{self.num_layers - 1})")


@register_drafter_type
class DFlashType(DrafterType):
    """``drafter.type: dflash``: a few target-width layers filling a block of mask slots from the fused target states
    (this module: the collator of anchored blocks, the block loss, the acceptance by block position)."""

    name = "dflash"
    options = DFlashOptions
    chain = True
    reads_target_states = True
    logged_loss = "ce"  # DFlash's cross-entropy to the label (block_terms sums it whatever drafter.loss trains on)

    def new(self, spec, base, lm, records: list[dict]) -> tuple[Any, dict]:
        """The mask embedding starts at the mean embedding row; a reduced head (``draft_vocab_size``) is over the
        corpus's most common tokens (:func:`~pardec.training.drafter.vocab.corpus_vocab`, whose facts drafter.json
        keeps), started from the target head's rows; ``layer_init: target`` copies the target's layers (calibrated on
        the first corpus sequences) unless the run continues a trained drafter."""
        h = spec.drafter
        vocab, made = (None, {}) if h.get("draft_vocab_size") is None else corpus_vocab(h["draft_vocab_size"], records, lm)
        draft = DFlashDraft.from_section(base.config, h, TargetParts(embed=base.model.embed_tokens,
                                                                     lm_head=base.lm_head), vocab)
        if h.get("layer_init") == "target" and not spec.init_from:
            samples = [torch.tensor(list(r["prompt_ids"]) + list(r["completion_ids"]))
                       for r in list(records)[:CALIBRATION_SEQUENCES]]
            init_from_target(draft, base, samples)
        return draft, made

    def check_target(self, options: dict, model) -> None:
        super().check_target(options, model)
        if options.get("draft_vocab_size") is not None:
            check_vocab_size(options["draft_vocab_size"], model)

    def fresh_on_continue(self, drafter, prior) -> set[str]:
        """A reduced head (and its id maps) grown on a whole-vocabulary drafter starts from the target head's rows."""
        return {"lm_head.weight", "d2t", "t2d"} if drafter.config.reduced and not prior.config.reduced else set()

    def collator(self, pad_id: int, options: dict, seed: int):
        return DFlashCollator(pad_id, num_anchors=options["num_anchors"], seed=seed)

    def callbacks(self, collator) -> list:
        return [EpochCallback(collator)]

    def trainer_options(self, options: dict, head_decay: float) -> dict[str, Any]:
        return {"dflash": {k: options[k] for k in ("num_anchors", "gamma", "loss", "weighting", "dpace_alpha")}}

    def facts(self, options: dict, head_decay: float) -> dict[str, Any]:
        return {**self.trainer_options(options, head_decay)["dflash"], "layer_init": options["layer_init"]}

    def needs_target_logits(self, options: dict) -> bool:
        return options["loss"] == "kl"  # CE reads the corpus's tokens

    def loss_k(self, drafter, trainer) -> int:
        return drafter.k  # the block's predicted slots

    def window_count(self, batches: list[dict], k: int) -> int:
        """The counted (anchor, slot) terms of the window (:func:`term_count`)."""
        return sum(term_count(b["loss_mask"], b["anchors"], b["anchor_valid"], k + 1) for b in batches)

    def loss(self, trainer, model, drafter, inputs: dict, return_outputs: bool, num_items_in_batch):
        """DFlash's block loss (:func:`block_terms`): logged ``ce_d<d>`` is slot ``d``'s mean cross-entropy to the
        label (also under ``drafter.loss: kl``), ``top1_d<d>`` its argmax agreement with the label; ``ce`` and
        ``top1`` their term-weighted means."""
        o, dev, k = trainer.dflash, trainer.args.device, trainer.k
        ids, mask = inputs["input_ids"].to(dev), inputs["loss_mask"].to(torch.bool).to(dev)
        anchors, valid = inputs["anchors"].to(dev), inputs["anchor_valid"].to(dev)
        # the target's logits only for the KL loss: for CE the pass stops at the last layer the draft reads
        target = trainer.target_pass(inputs, drafter.config.layer_ids, logits=o["loss"] == "kl")
        terms = block_terms(drafter, target, trainer.base.model.embed_tokens, trainer.base.lm_head, ids, mask,
                            anchors, valid, k + 1, o["gamma"], o["loss"], o["weighting"], o["dpace_alpha"], call=model)
        norm = (torch.tensor(term_count(mask, anchors, valid, k + 1)) if num_items_in_batch is None
                else num_items_in_batch)
        loss = trainer.for_ranks(terms.total / norm.to(terms.total.device).clamp(min=1))
        if model.training:
            trainer.add_log_sums(torch.cat([terms.ce, terms.agree, terms.count]))
        return (loss, terms.total) if return_outputs else loss

    def chain_eval(self, spec, lm, drafter) -> tuple[dict, Any]:
        """(the held-out result's settings, records -> the acceptance by block position)."""
        block = drafter.config.block_size
        return ({"steps": block - 1, "block_size": block, "fusion": drafter.config.fusion},
                lambda records: acceptance(lm.model, drafter, records, block, spec.topk))
