"""CLLM training samples from a trajectory file, and their collator.

A sample is (prompt + answer before the block, a Jacobi state of the block, its consistency target, the
full teacher answer):

* ``state_sampling="random"`` (the CLLM repo): one sample per (prompt, block); its state is drawn uniformly
  from the block's states other than the fixed point, once, with ``seed`` (reproducible under resume), plus
  (global loss) one of its augmented states likewise;
* ``state_sampling="all"``: one sample per (prompt, block, state), the fixed point excepted, plus (global loss)
  one per augmented state.

The consistency target is the fixed point (``loss_type="global"``, Eq. 4) or the next state of the
trajectory (``"local"``, Eq. 5). Blocks whose first state already is the fixed point give no sample.

Consistency positions: block position k counts from one position *after* the first position d where state and
target disagree, and while k lies within the answer (positions after the EOS are padding). The logits at block
position k are computed from the block's tokens before k; up to and including d those are the same in state and
target, so their logits are equal and the loss there is zero: counting them (the CLLM repo counts from d) only
inflates the normaliser. The AR part is the full teacher answer, with the prompt positions masked.

Augmented states (the collection's corrected copies, ``block["augmented"]``) are extra samples whose target is
the fixed point; they have no Jacobi successor, so the ``local`` loss leaves them out.

Sequences longer than ``max_length`` are truncated from the left (the block, at the end, always survives);
the dataset counts such samples in ``n_truncated``.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from pardec.training.losses import IGNORE_INDEX

log = logging.getLogger(__name__)

LOSS_TYPES = ("global", "local")
STATE_SAMPLING = ("random", "all")


class TrajectoryDataset(torch.utils.data.Dataset):
    def __init__(self, records: list[dict], loss_type: str = "global", state_sampling: str = "random",
                 max_length: int = 1024, seed: int = 0):
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is not valid; choose one of: {', '.join(LOSS_TYPES)}")
        if state_sampling not in STATE_SAMPLING:
            raise ValueError(f"state_sampling={state_sampling!r} is not valid; choose one of: "
                             f"{', '.join(STATE_SAMPLING)}")
        self.records, self.loss_type, self.max_length = records, loss_type, max_length
        rng = random.Random(seed)
        self.items: list[tuple[int, int, int]] = []  # (record, block, state); state < 0: augmented[-state - 1]
        for r, rec in enumerate(records):
            for b, blk in enumerate(rec["blocks"]):
                n_states = len(blk["states"]) - 1  # the fixed point itself is no sample
                if n_states < 1:
                    continue
                if len(blk["fixed_point"]) + 1 > max_length:
                    raise ValueError(f"max_length={max_length} is shorter than a block + 1 "
                                     f"({len(blk['fixed_point']) + 1} tokens)")
                n_aug = len(blk.get("augmented") or []) if loss_type == "global" else 0
                if state_sampling == "all":
                    js = list(range(n_states)) + [-1 - a for a in range(n_aug)]
                else:
                    js = [rng.randrange(n_states)] + ([-1 - rng.randrange(n_aug)] if n_aug else [])
                self.items += [(r, b, j) for j in js]
        self.n_truncated = sum(self._lengths(i) > max_length for i in range(len(self.items)))
        if self.n_truncated:
            log.warning("%d of %d samples are longer than max_length=%d and are truncated from the left",
                        self.n_truncated, len(self.items), max_length)

    def __len__(self) -> int:
        return len(self.items)

    def _lengths(self, i: int) -> int:
        r, b, _ = self.items[i]
        rec = self.records[r]
        start = sum(len(x["fixed_point"]) for x in rec["blocks"][:b])
        block = len(rec["blocks"][b]["fixed_point"])
        return max(len(rec["prompt_ids"]) + start + block - 1, len(rec["prompt_ids"]) + len(rec["answer_ids"]))

    def __getitem__(self, i: int) -> dict:
        r, b, j = self.items[i]
        rec = self.records[r]
        blk = rec["blocks"][b]
        start = sum(len(x["fixed_point"]) for x in rec["blocks"][:b])
        prefix = rec["prompt_ids"] + rec["answer_ids"][:start]
        state = blk["states"][j] if j >= 0 else blk["augmented"][-j - 1]
        target = blk["fixed_point"] if self.loss_type == "global" else blk["states"][j + 1]
        n = len(state)
        n_valid = min(n, len(rec["answer_ids"]) - start)  # block positions up to the EOS
        first_diff = next((k for k in range(n) if state[k] != target[k]), n)  # n: equal
        mask = [first_diff < k < n_valid for k in range(n)]  # at k <= first_diff both see the same tokens
        ar_ids = rec["prompt_ids"] + rec["answer_ids"]
        ar_labels = [IGNORE_INDEX] * len(rec["prompt_ids"]) + rec["answer_ids"]
        cut = self.max_length
        return {
            "state_ids": (prefix + state[:-1])[-cut:],  # logits of the last n positions predict the block
            "target_ids": (prefix + target[:-1])[-cut:],
            "consistency_mask": mask,
            "ar_ids": ar_ids[-cut:],
            "ar_labels": ar_labels[-cut:],
        }


@dataclass
class CLLMCollator:
    """Left-pads samples into one batch; every sequence ends at its block (or answer) end.

    Returns, with B samples of at most K block positions:

    * ``input_ids``, ``attention_mask``, ``position_ids``: [2B, L]; rows 0..B-1 the states (student), rows
      B..2B-1 the teacher answers (AR loss), run as one forward;
    * ``ar_labels``: [B, L] aligned with rows B..2B-1 (-100 on prompt and padding);
    * ``target_ids``, ``target_attention_mask``, ``target_position_ids``: [B, Lt] the consistency targets;
    * ``consistency_mask``: [B, K] bool over the last K positions of the state rows.
    """

    pad_id: int

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        seqs = [s["state_ids"] for s in samples] + [s["ar_ids"] for s in samples]
        ids, att, pos = left_pad(seqs, self.pad_id)
        bsz, width = len(samples), ids.shape[1]
        labels = torch.full((bsz, width), IGNORE_INDEX, dtype=torch.long)
        for i, s in enumerate(samples):
            labels[i, width - len(s["ar_labels"]) :] = torch.tensor(s["ar_labels"])
        t_ids, t_att, t_pos = left_pad([s["target_ids"] for s in samples], self.pad_id)
        k = max(len(s["consistency_mask"]) for s in samples)
        cmask = torch.zeros(bsz, k, dtype=torch.bool)
        for i, s in enumerate(samples):
            cmask[i, k - len(s["consistency_mask"]) :] = torch.tensor(s["consistency_mask"])
        return {"input_ids": ids, "attention_mask": att, "position_ids": pos, "ar_labels": labels,
                "target_ids": t_ids, "target_attention_mask": t_att, "target_position_ids": t_pos,
                "consistency_mask": cmask}


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids), each [N, max len], padded on the left; positions start at 0."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        att[i, width - len(s) :] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    return ids, att, pos
