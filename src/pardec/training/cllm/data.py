"""CLLM training samples from a trajectory file, and their collator: one packed sequence per (prompt, block).

A sample packs, into one sequence run by one forward (no third forward, no prefix computed twice):

* the **AR row**: prompt + the whole teacher answer, causal: the record's ``ar_answer_ids`` where the train stage
  attached them (:mod:`.answers`: the teacher's whole greedy answer up to its EOS, which may run past the collected
  blocks; it always starts with the collected answer), else its collected ``answer_ids``. Its logits give the AR
  loss (prompt positions masked; every answer token counts, the EOS included) and, detached, the **global
  consistency target**: the target of block position k is the model's own distribution after ``prefix +
  fixed_point[:k]``, which is exactly the AR row's logits one position before the block's k-th answer token (the
  fixed point *is* the answer there);
* one **state segment** per Jacobi state drawn from the block: the state's tokens ``state[:-1]`` at the block's
  positions, seeing the AR row's prefix (prompt + answer before the block) and themselves causally (a
  block-causal 4D mask, explicit positions). Its logits at block position k >= 1 are the student's; position 0
  is predicted by the prefix's last token in both student and target, so it never counts;
* ``loss_type="local"`` (Eq. 5): a **target segment** per next state that is not the fixed point (the fixed point
  is the AR row), whose logits are used detached.

States: ``state_sampling="random"`` draws ``states_per_sample`` of the block's states (other than the fixed
point) without replacement, plus (global loss) one of its augmented copies, anew every epoch
(:meth:`TrajectoryDataset.set_epoch`; a seed of (``seed``, epoch, sample), so a resumed run draws the same);
``"all"`` packs every state and every augmented copy. Blocks whose first state already is the fixed point give
no sample.

Consistency positions: block position k counts from one position *after* the first position d where state and
target disagree, and while k lies within the answer (positions after the EOS are padding). The logits at block
position k are computed from the block's tokens before k; up to and including d those are the same in state and
target, so their logits are equal and the loss there is zero: counting them (the CLLM repo counts from d) only
inflates the normaliser.

Augmented states (the collection's corrected copies, ``block["augmented"]``) are extra states whose target is
the fixed point; they have no Jacobi successor, so the ``local`` loss leaves them out.

An AR row longer than ``max_length`` keeps the block and as much of its prefix as fits: it is cut on the right
first (the answer after the block: only AR-loss tokens), then on the left, never past the prefix's last token (so
the consistency targets see the context the collection saw whenever it fits); the dataset counts such samples in
``n_truncated``.
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
AR_TAILS = ("every_block", "last_block")


class TrajectoryDataset(torch.utils.data.Dataset):
    def __init__(self, records: list[dict], loss_type: str = "global", state_sampling: str = "random",
                 max_length: int = 1024, seed: int = 0, states_per_sample: int = 1, ar_tail: str = "every_block"):
        if ar_tail not in AR_TAILS:
            raise ValueError(f"ar_tail={ar_tail!r} is not valid; choose one of: {', '.join(AR_TAILS)}")
        if loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type={loss_type!r} is not valid; choose one of: {', '.join(LOSS_TYPES)}")
        if state_sampling not in STATE_SAMPLING:
            raise ValueError(f"state_sampling={state_sampling!r} is not valid; choose one of: "
                             f"{', '.join(STATE_SAMPLING)}")
        if states_per_sample < 1:
            raise ValueError(f"states_per_sample={states_per_sample!r} is out of range: it must be >= 1")
        self.records, self.loss_type, self.max_length, self.ar_tail = records, loss_type, max_length, ar_tail
        self.state_sampling, self.states_per_sample, self.seed, self.epoch = state_sampling, states_per_sample, seed, 0
        self.items: list[tuple[int, int]] = []  # (record, block)
        for r, rec in enumerate(records):
            for b, blk in enumerate(rec["blocks"]):
                if len(blk["states"]) < 2:  # the fixed point itself is no sample
                    continue
                if len(blk["fixed_point"]) + 1 > max_length:
                    raise ValueError(f"max_length={max_length} is shorter than a block + 1 "
                                     f"({len(blk['fixed_point']) + 1} tokens)")
                self.items.append((r, b))
            if ar_answer(rec)[: len(rec["answer_ids"])] != rec["answer_ids"]:
                raise ValueError(f"record {rec.get('id')!r}: its ar_answer_ids do not start with its collected "
                                 f"answer_ids (the AR row must hold the fixed points)")
        self.last_item = {r: i for i, (r, _) in enumerate(self.items)}  # the record's last sample (ar_tail)
        self.n_truncated = sum(len(self.records[r]["prompt_ids"]) + len(self.answer_of(i)) > max_length
                               for i, (r, _) in enumerate(self.items))
        if self.n_truncated:
            log.warning("%d of %d samples are longer than max_length=%d and are truncated", self.n_truncated,
                        len(self.items), max_length)

    def __len__(self) -> int:
        return len(self.items)

    def set_epoch(self, epoch: int) -> None:
        """Draw the states of the given epoch (``random`` sampling)."""
        self.epoch = int(epoch)

    def answer_of(self, i: int) -> list[int]:
        """The teacher answer in sample ``i``'s AR row: the whole answer (:func:`ar_answer`) in every sample of the
        record (``ar_tail="every_block"``, the official packing: each block's sample holds it), or only in the
        record's last sample, the others holding the collected answer (``"last_block"``: the tokens past the
        collection are trained once per record instead of once per block, for a cheaper epoch)."""
        r, _ = self.items[i]
        rec = self.records[r]
        if self.ar_tail == "last_block" and self.last_item[r] != i:
            return rec["answer_ids"]
        return ar_answer(rec)

    def states_of(self, i: int) -> list[int]:
        """Which states sample ``i`` packs this epoch: indices into ``states`` (the fixed point excepted);
        negative ``-1 - a``: ``augmented[a]``."""
        r, b = self.items[i]
        blk = self.records[r]["blocks"][b]
        n_states = len(blk["states"]) - 1
        n_aug = len(blk.get("augmented") or []) if self.loss_type == "global" else 0
        if self.state_sampling == "all":
            return list(range(n_states)) + [-1 - a for a in range(n_aug)]
        rng = random.Random(f"{self.seed}-{self.epoch}-{i}")
        js = sorted(rng.sample(range(n_states), min(self.states_per_sample, n_states)))
        return js + ([-1 - rng.randrange(n_aug)] if n_aug else [])

    def __getitem__(self, i: int) -> dict:
        r, b = self.items[i]
        rec = self.records[r]
        blk = rec["blocks"][b]
        start = sum(len(x["fixed_point"]) for x in rec["blocks"][:b])
        ar = rec["prompt_ids"] + self.answer_of(i)
        n_prompt, n_prefix, n = len(rec["prompt_ids"]), len(rec["prompt_ids"]) + start, len(blk["fixed_point"])
        hi = min(len(ar), max(self.max_length, n_prefix + n))  # cut after the block first
        lo = max(0, hi - self.max_length)  # then on the left: lo <= n_prefix - 1 (max_length > n)
        row = ar[lo:hi]
        ctx = n_prefix - lo  # AR-row tokens a segment sees
        ids, pos, seg = list(row), list(range(len(row))), [0] * len(row)
        ar_targets = [row[t + 1] if t + 1 + lo >= n_prompt else IGNORE_INDEX for t in range(len(row) - 1)]
        ar_targets.append(IGNORE_INDEX)
        n_valid = min(n, len(rec["answer_ids"]) - start)  # block positions up to the EOS
        pairs: list[tuple[int, int]] = []  # (student index, target index) of every counted block position
        firsts: list[int] = []  # where each state's segment starts, in the order of states_of(i)

        def segment(tokens: list[int]) -> int:
            """Append ``tokens[:-1]`` as a new segment; returns the index of its first token."""
            first = len(ids)
            ids.extend(tokens[:-1])
            pos.extend(range(ctx, ctx + n - 1))
            seg.extend([seg[-1] + 1 if seg[-1] > 0 else 1] * (n - 1))
            ar_targets.extend([IGNORE_INDEX] * (n - 1))
            return first

        fixed_target = {k: ctx - 1 + k for k in range(n)}  # block position k -> AR-row index of its target
        targets: dict[int, dict[int, int]] = {}  # local: next-state index -> its segment's target indices
        for j in self.states_of(i):
            state = blk["states"][j] if j >= 0 else blk["augmented"][-j - 1]
            nxt = blk["fixed_point"] if self.loss_type == "global" else blk["states"][j + 1]
            if self.loss_type == "local" and j + 1 < len(blk["states"]) - 1:
                if j + 1 not in targets:
                    f = segment(nxt)
                    targets[j + 1] = {k: f + k - 1 for k in range(1, n)}
                where = targets[j + 1]
            else:
                where = fixed_target
            first_diff = next((k for k in range(n) if state[k] != nxt[k]), n)  # n: equal
            f = segment(state)
            firsts.append(f)
            pairs += [(f + k - 1, where[k]) for k in range(first_diff + 1, n_valid)]
        return {"ids": ids, "positions": pos, "segment": seg, "context": ctx, "ar_targets": ar_targets,
                "pairs": pairs, "segments": firsts}


@dataclass
class CLLMCollator:
    """Right-pads packed samples (see the module docstring) into one batch of B rows of length T:

    * ``input_ids``, ``position_ids`` [B, T]; ``segment`` [B, T] (0 = AR row, 1.. = state/target segments,
      -1 = padding) and ``context`` [B] (AR-row tokens a segment sees): the 4D mask is built from them
      (:func:`packed_attention`);
    * ``ar_targets`` [B, T]: the next token the logits at each position must predict (-100: not counted);
    * ``pairs`` [M, 3]: (row, student index, target index) of every counted consistency position.
    """

    pad_id: int

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        bsz, width = len(samples), max(len(s["ids"]) for s in samples)
        ids = torch.full((bsz, width), self.pad_id, dtype=torch.long)
        pos = torch.zeros(bsz, width, dtype=torch.long)
        seg = torch.full((bsz, width), -1, dtype=torch.long)
        tgt = torch.full((bsz, width), IGNORE_INDEX, dtype=torch.long)
        for i, s in enumerate(samples):
            t = len(s["ids"])
            ids[i, :t], pos[i, :t] = torch.tensor(s["ids"]), torch.tensor(s["positions"])
            seg[i, :t], tgt[i, :t] = torch.tensor(s["segment"]), torch.tensor(s["ar_targets"])
        pairs = torch.tensor([(i, a, b) for i, s in enumerate(samples) for a, b in s["pairs"]],
                             dtype=torch.long).reshape(-1, 3)
        return {"input_ids": ids, "position_ids": pos, "segment": seg,
                "context": torch.tensor([s["context"] for s in samples], dtype=torch.long),
                "ar_targets": tgt, "pairs": pairs}


def ar_answer(rec: dict) -> list[int]:
    """The answer of a record's AR row: its whole teacher answer where the train stage attached one
    (``ar_answer_ids``, :mod:`.answers`), else its collected answer."""
    return rec.get("ar_answer_ids") or rec["answer_ids"]


def packed_attention(segment: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """[B, T, T] bool, True where query q may attend key k: the AR row (segment 0) is causal; a segment sees the
    first ``context`` AR-row tokens and its own tokens causally; a padding position sees only itself."""
    t = segment.shape[1]
    idx = torch.arange(t, device=segment.device)
    causal = idx[None, :, None] >= idx[None, None, :]  # [1, T(q), T(k)]
    sq, sk = segment[:, :, None], segment[:, None, :]
    same = (sq == sk) & (sq >= 0) & causal
    prefix = (sq > 0) & (sk == 0) & (idx[None, None, :] < context[:, None, None])
    pad = (sq < 0) & (idx[None, :, None] == idx[None, None, :])
    return same | prefix | pad
