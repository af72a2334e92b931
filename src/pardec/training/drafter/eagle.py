"""EAGLE-3's training-time test (TTT) loss and its held-out acceptance, for ``drafter.type: eagle3``
(Li et al. 2025, §3.2 / Fig. 5; reference: SafeAILab/EAGLE ``eagle/traineagle3/cnets.py`` ``Model.forward`` and
``main.py``; the line numbers below are of that repository's HEAD).

Batch: right-padded ``prompt + completion[:-1]`` (:class:`~pardec.training.drafter.batches.RightPadCollator`), ids
``x`` [B, T], ``loss_mask[j]``: token ``x_{j+1}`` is a completion token. One frozen target forward
(:func:`~pardec.training.drafter.target.target_pass`) gives the states entering ``layer_ids`` (concatenated [B, T, 3H]; cnets.py ``dataprepare``,
l. 714-731) and the logits; the draft then unrolls ``S = ttt_steps`` steps over every anchor ``t`` at once
(:func:`ttt_unroll`; reference ``self.length = 7``, l. 498, loop l. 790):

* step 0 at ``t``: hidden ``fuse(f_t)`` (l. 759), embedding of ``x_{t+1}`` (ids shifted left once, l. 724),
  rotary position ``t``; it predicts ``x_{t+2}``;
* step ``i > 0`` at ``t``: hidden = the draft's own output of step ``i - 1`` at ``t`` (l. 847), embedding of
  ``x_{t+1+i}`` (the ids shifted once more per step, l. 862), rotary position ``t + i`` (``position_ids + lck``,
  l. 256); it predicts ``x_{t+2+i}``;
* attention of query ``(t, i)``: step-0 keys at positions ``<= t`` (causal) and the keys of steps ``1..i`` at the
  same anchor ``t``, itself included (l. 283-309: the per-step key lists and their diagonal dot products). Here: the
  keys/values of steps ``0..i-1`` as ``past`` of :meth:`~pardec.models.eagle.Eagle3Draft.forward` and a bool mask
  ``[T, (i + 1) T]`` (:func:`ttt_mask`: block 0 lower-triangular, blocks ``1..i`` diagonal). Cost: step ``i``'s
  scores are ``B * heads * (i + 1) T^2``; summed over 7 steps ``28 B heads T^2`` (T = 2048, 32 heads: 15 GB fp32 if
  SDPA materialises them, as on CPU; SmolLM2 at T = 512, 9 heads: 0.26 GB per sequence).

Loss of step ``i`` at anchor ``t``: the soft cross-entropy ``-sum_k p_k log q_k`` between the target's distribution at
position ``t + 1 + i`` restricted to the draft vocabulary (softmax over ``target_logits[..., vocab.ids]``; l. 840-842)
and the draft's (log-softmax over its ``K`` logits, l. 853); the term counts where the target's argmax at ``t + 1 + i``
is a draft-vocabulary id (``t2d[argmax]``, l. 837) and ``loss_mask[t + 1 + i]`` (the predicted token is a completion
token; the reference's ``position_mask`` l. 839 multiplies by its own loss mask, which marks the assistant tokens).
Steps weigh ``step_decay ** i`` (main.py l. 284-285: ``ploss_weight = [0.8 ** i ...]``). Normaliser: the
(anchor, step) terms whose predicted token is a completion token, over the whole accumulation window
(:func:`~pardec.training.drafter.trainer.term_count`), so accumulation gives the big-batch gradient; terms whose
target argmax lies outside the draft vocabulary add 0 but stay in the normaliser (as the reference, whose
``position_mask`` zeroes them inside a mean over every position, l. 855). Gradients reach the draft only: the target,
its embeddings and its features are computed without them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pardec.config import check_at_least, check_range
from pardec.models.drafters import new_drafter
from pardec.training.drafter.batches import held_out_windows, term_count
from pardec.training.drafter.heldout import summarise, walk
from pardec.training.drafter.target import TargetPass, target_pass
from pardec.training.drafter.types import DrafterType, check_layer_list, register_drafter_type
from pardec.training.drafter.vocab import check_vocab_size, corpus_vocab


def shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:, j + n]`` at ``j`` (zeros past the end): the reference's ``padding(..., left=False)`` applied ``n``
    times (cnets.py l. 448-455)."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, : min(n, x.shape[1])])], dim=1)[:, : x.shape[1]]


def ttt_mask(t: int, step: int, device=None) -> torch.Tensor:
    """bool [T, (step + 1) T] for step ``step``'s queries over the keys of steps ``0..step``: block 0 causal
    (the stable prefix of step 0), blocks ``1..step`` the diagonal (the same anchor's later steps)."""
    causal = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    eye = torch.eye(t, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * step, dim=1)


def ttt_unroll(drafter, fused: torch.Tensor, emb: torch.Tensor, steps: int, call=None) -> list[torch.Tensor]:
    """The draft's outputs [B, T, H] of steps ``0..steps-1`` at every anchor. ``fused`` [B, T, H]: the fused target
    features; ``emb`` [B, T, H]: the target's embeddings of the ids (step ``i`` reads them shifted by ``i + 1``).
    ``call``: the (possibly wrapped) module whose ``forward`` runs a step (default ``drafter``)."""
    call = call or drafter
    t = fused.shape[1]
    positions = torch.arange(t, device=fused.device)
    hidden, keys, values, outs = fused, [], [], []
    for i in range(steps):
        past = None if i == 0 else (torch.cat(keys, 2), torch.cat(values, 2))
        out, (k, v) = call(shift_left(emb, i + 1), hidden, positions + i, past, ttt_mask(t, i, fused.device))
        keys.append(k)
        values.append(v)
        outs.append(out)
        hidden = out
    return outs


@dataclass
class StepTerms:
    """Per step: the weighted loss sum (graph), and detached sums for the logs: soft CE, KL, top-1 agreement and the
    counted terms (each a [S] float64 tensor)."""

    total: torch.Tensor
    ce: torch.Tensor
    kl: torch.Tensor
    agree: torch.Tensor
    count: torch.Tensor
    covered: torch.Tensor  # terms whose predicted token is a completion token (the normaliser's share)


def soft_ce(logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's fp32 log-probabilities and the cross-entropy ``-sum p log q`` to the target's probabilities ``p``
    (one TTT step; the loss path whose memory pardec.plan's LOSS_PEAK["soft_ce"] measures)."""
    logq = logits.float().log_softmax(-1)
    return logq, -(p * logq).sum(-1)


def ttt_terms(drafter, target: TargetPass, loss_mask: torch.Tensor, steps: int, decay: float, call=None
              ) -> StepTerms:
    """The TTT loss terms of one batch (module docstring); ``loss_mask`` [B, T] bool."""
    w = drafter.fc.weight
    outs = ttt_unroll(drafter, drafter.fuse(target.features), target.emb.to(w.dtype), steps, call)
    total = outs[0].sum() * 0.0  # keeps the graph when nothing counts
    stats = torch.zeros(5, steps, dtype=torch.float64)
    with torch.no_grad():  # the target's side once, at every position; step i reads it shifted by i + 1
        logits = target.logits
        keep_all = drafter.t2d.to(logits.device)[logits.argmax(-1)].to(w.device)  # argmax in the draft vocabulary
        if drafter.config.draft_vocab_size < drafter.config.vocab_size:
            logits = logits[..., drafter.target_ids().to(logits.device)]
        logp_all = logits.float().log_softmax(-1).to(w.device)  # [B, T, K]: restricted to the draft vocabulary
        loss_mask = loss_mask.to(torch.bool).to(w.device)
    for i, out in enumerate(outs):
        with torch.no_grad():
            logp = shift_left(logp_all, i + 1)  # the target at t + 1 + i
            completion = shift_left(loss_mask, i + 1)
            m = shift_left(keep_all, i + 1) & completion
            p = logp.exp()
        logq, ce = soft_ce(drafter.logits(out), p)  # [B, T]
        term = (ce * m).sum()
        total = total + decay**i * term
        with torch.no_grad():
            ent = -(p * logp).sum(-1)
            stats[0, i] = float(term)
            stats[1, i] = float(((ce - ent) * m).sum())
            stats[2, i] = float(((logq.argmax(-1) == logp.argmax(-1)) & m).sum())
            stats[3, i] = float(m.sum())
            stats[4, i] = float(completion.sum())
    return StepTerms(total, *stats)


# ------------------------------------------------------------------------------------------- evaluation
@torch.inference_mode()
def acceptance(base, drafter, records: list[dict], steps: int, topk: int = 10) -> dict:
    """Held-out chain acceptance by depth of an EAGLE-3 draft on ``records`` (prompt + the target's greedy
    completion): the TTT unroll in eval mode, teacher-forced on the record's tokens. Anchors ``t`` run from the
    prompt's last token to the completion's third-to-last; step ``i``'s greedy draft token (mapped to a target id)
    is accepted at depth ``i + 1`` when it equals the record's token ``t + 2 + i`` and steps ``0..i-1`` were
    accepted (then the true tokens it was fed are the draft's own, as in decoding). A depth counts while its token
    is in the record.

    Returns per depth ``d = 1..steps``: ``anchors`` (valid), ``conditional_acceptance`` (accepted at d / accepted at
    d - 1, among anchors valid at d), ``chain_acceptance`` (the first d all accepted), ``topk_containment`` (the
    record's token among the draft's top ``topk`` at that step, teacher-forced), ``top1_agreement`` (teacher-forced);
    and ``expected_tokens_per_forward`` = 1 + sum_d chain_acceptance[d] (the bonus token plus the accepted run of a
    chain of ``steps`` drafts). ``target_matches_record``: how often the target's argmax equals the record's next
    token (1.0 unless numerics differ from generation)."""
    device = next(base.parameters()).device
    layer_ids = drafter.config.layer_ids
    acc_rows, valid_rows, top_rows, top1_rows = [], [], [], []
    same = anchors_n = walk_tokens = walk_forwards = 0
    for full, ids, anchors in held_out_windows(records, device):
        n = len(full)
        tp = target_pass(base, ids, layer_ids)
        w = drafter.fc.weight
        outs = ttt_unroll(drafter, drafter.fuse(tp.features), tp.emb.to(w.dtype), steps)
        pos = anchors[:, None] + torch.arange(steps)[None, :] + 2  # [A, S]: the true tokens' positions
        valid = pos <= n - 1
        true = torch.tensor(full)[pos.clamp(max=n - 1)]
        logits = torch.stack([drafter.logits(o)[0, anchors.to(o.device)] for o in outs], 1).float().cpu()  # [A,S,K]
        top = drafter.to_target(logits.topk(min(topk, logits.shape[-1]), -1).indices.to(w.device)).cpu()  # [A,S,k]
        hit = top[..., 0] == true
        acc_rows.append(hit.long().cumprod(1).bool())
        valid_rows.append(valid)
        top_rows.append((top == true[..., None]).any(-1))
        top1_rows.append(hit)
        same += int((tp.logits[0, anchors.to(device)].argmax(-1).cpu() == torch.tensor(full)[anchors + 1]).sum())
        anchors_n += len(anchors)
        # the completion's tokens (n - 1 - anchors[0]: the first anchor is the prompt's last token)
        walk_tokens += n - 1 - int(anchors[0])
        walk_forwards += walk((acc_rows[-1] & valid).sum(1).tolist())
    if not acc_rows:
        acc = valid = top = top1 = torch.zeros(0, steps, dtype=torch.bool)
    else:
        acc, valid, top, top1 = (torch.cat(x) for x in (acc_rows, valid_rows, top_rows, top1_rows))
    prev = torch.cat([valid[:, :1], acc[:, :-1]], 1)  # accepted up to depth d - 1 (depth 1: every anchor)
    counts = {"valid": valid.sum(0).tolist(), "accepted": (acc & valid).sum(0).tolist(),
              "reached": (prev & valid).sum(0).tolist(), "topk": (top & valid).sum(0).tolist(),
              "top1": (top1 & valid).sum(0).tolist(), "anchors": anchors_n, "target_matches": same,
              "walk_tokens": walk_tokens, "walk_forwards": walk_forwards}
    return summarise(counts, steps, topk)


# ------------------------------------------------------------------------------------------- the type
@dataclass
class Eagle3Options:
    """EAGLE-3's defaults (Li et al. 2025; reference eagle/traineagle3: cnets.py ``self.length = 7``, main.py
    ``ploss_weight = [0.8 ** i ...]``, the 32000-id draft vocabulary of its configs)."""

    draft_vocab_size: int = field(default=32000, metadata={
        "help": "the draft head's vocabulary: the corpus's most common target tokens"})
    ttt_steps: int = field(default=7, metadata={"help": "training-time-test steps, each fed the drafter's own output"})
    step_decay: float = field(default=0.8, metadata={"help": "step i's loss weighs step_decay ** i"})
    layers: list[int] | None = field(default=None, metadata={
        "help": "the target layers whose states are fused (null: EAGLE-3's low/mid/high default)"})

    def __post_init__(self) -> None:
        check_at_least("drafter.draft_vocab_size", self.draft_vocab_size, 2, integer=True)
        check_at_least("drafter.ttt_steps", self.ttt_steps, 1, integer=True)
        check_range("drafter.step_decay", self.step_decay, 0, 1, integer=False, open_lo=True)
        if self.layers is not None:
            check_layer_list(self.layers, "the fused features; null: EAGLE-3's low/mid/high default")


@register_drafter_type
class Eagle3Type(DrafterType):
    """``drafter.type: eagle3``: one draft layer over the fused target features, trained with training-time test
    (this module), its draft vocabulary the corpus's most common tokens (:func:`~pardec.training.drafter.vocab.corpus_vocab`)."""

    name = "eagle3"
    options = Eagle3Options
    chain = True
    reads_target_states = True

    def check_target(self, options: dict, model) -> None:
        super().check_target(options, model)
        check_vocab_size(options["draft_vocab_size"], model)

    def new(self, spec, base, lm, records: list[dict]) -> tuple[Any, dict]:
        vocab, facts = corpus_vocab(spec.drafter["draft_vocab_size"], records, lm)  # the head starts from the target's rows of the kept ids
        return new_drafter(self.name, base.config, layers=spec.drafter.get("layers"), lm_head=base.lm_head,
                           vocab=vocab), facts

    def trainer_options(self, options: dict, head_decay: float) -> dict[str, Any]:
        return {"ttt_steps": options["ttt_steps"], "step_decay": options["step_decay"]}

    def facts(self, options: dict, head_decay: float) -> dict[str, Any]:
        return self.trainer_options(options, head_decay)

    def loss_k(self, drafter, trainer) -> int:
        return trainer.ttt_steps  # one loss term per training-time-test step, weighted step_decay ** i

    def loss(self, trainer, model, drafter, inputs: dict, return_outputs: bool, num_items_in_batch):
        """EAGLE-3's TTT loss (:func:`ttt_terms`): logged ``kl_d<d>`` is the KL of step ``d - 1`` (its soft
        cross-entropy minus the restricted target's entropy), ``top1_d<d>`` its agreement with the target's argmax,
        both over the counted terms (target argmax in the draft vocabulary)."""
        mask = inputs["loss_mask"].to(torch.bool)
        target = trainer.target_pass(inputs, drafter.config.layer_ids)
        terms = ttt_terms(drafter, target, mask, trainer.k, trainer.step_decay, call=model)
        norm = (torch.tensor(term_count(mask, trainer.k)) if num_items_in_batch is None else num_items_in_batch)
        loss = trainer.for_ranks(terms.total / norm.to(terms.total.device).clamp(min=1))
        if model.training:
            trainer.add_log_sums(torch.cat([terms.kl, terms.agree, terms.count]))
        return (loss, terms.total) if return_outputs else loss

    def chain_eval(self, spec, lm, drafter) -> tuple[dict, Any]:
        """(the held-out result's settings, records -> the chain's acceptance by depth)."""
        steps = int(spec.drafter["ttt_steps"])
        return ({"steps": steps, "draft_vocab_size": drafter.config.draft_vocab_size},
                lambda records: acceptance(lm.model, drafter, records, steps, spec.topk))
