"""The batches every drafter type trains on and the held-out windows it is evaluated on: right-padded
``prompt + completion[:-1]`` samples (:class:`RightPadCollator`) and per-record teacher-forcing windows
(:func:`held_out_windows`). Below the trainer and every type's loss (Medusa / FIRP in
:mod:`pardec.training.drafter.trainer`, :mod:`pardec.training.drafter.eagle`, :mod:`pardec.training.drafter.dflash`),
which all import it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RightPadCollator:
    """Right-pads samples of a CompletionDataset: ``input_ids`` [B, T] (``pad_id`` after the end), ``valid``
    [B, T] (real tokens) and ``loss_mask`` [B, T] (positions whose next token is a completion token)."""

    pad_id: int

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        width = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(samples), width, dtype=torch.bool)
        mask = torch.zeros(len(samples), width, dtype=torch.bool)
        for i, s in enumerate(samples):
            n = len(s["input_ids"])
            ids[i, :n] = torch.tensor(s["input_ids"], dtype=torch.long)
            valid[i, :n] = True
            mask[i, :n] = torch.tensor(s["loss_mask"], dtype=torch.bool)
        return {"input_ids": ids, "valid": valid, "loss_mask": mask & valid}


def held_out_windows(records: list[dict], device):
    """Per held-out record (prompt + the target's greedy completion) long enough for one anchor: (its tokens, the
    ids ``[1, n - 1]`` a teacher-forced forward reads, on ``device``, the anchors ``t`` from the prompt's last token
    to the completion's third-to-last, so that ``t + 2 <= n - 1``)."""
    for r in records:
        full = list(r["prompt_ids"]) + list(r["completion_ids"])
        p, n = len(r["prompt_ids"]), len(full)
        if n - 3 < p - 1:
            continue
        yield full, torch.tensor([full[:-1]], device=device), torch.arange(p - 1, n - 2)


def term_count(loss_mask: torch.Tensor, k: int) -> int:
    """The (position, depth) terms of a batch: depth ``d`` (0-based) pairs anchor ``t`` with target ``t + d + 1``."""
    return sum(int(loss_mask[:, d + 1 :].sum()) for d in range(k))
