"""What CLLM's collection does to its trajectories after decoding them: the loop check that cleans the corpus
(:func:`has_degenerate_repetition`, also the AR answers' and the reports') and the augmentation of Jacobi states
(``collect.augment``: the official rule in place, or pardec's extra copies)."""

from __future__ import annotations

import random


def has_degenerate_repetition(ids: list[int], max_ngram: int = 8, max_repeats: int = 8) -> bool:
    """True when some g-gram (1 <= g <= max_ngram) occurs more than ``max_repeats`` times back to back,
    i.e. ``ids[s : s + g * (max_repeats + 1)]`` is one g-gram repeated, for some start s."""
    for g in range(1, max_ngram + 1):
        run = 0  # consecutive i with ids[i] == ids[i + g]
        for i in range(len(ids) - g):
            run = run + 1 if ids[i] == ids[i + g] else 0
            if run >= g * max_repeats:
                return True
    return False


def augment_in_place(blocks: list[dict], rng: random.Random) -> None:
    """CLLM's augmentation (§3.2.1; the official rule): in every block, each state but the fixed point and the one
    just before it gets ``w // 2`` of its ``w`` wrong positions corrected to the fixed point's tokens, those drawn
    uniformly with replacement from the wrong positions after the first (repeats correct one token)."""
    for b in blocks:
        fp = b["fixed_point"]
        for s in b["states"][: max(0, len(b["states"]) - 2)]:
            wrong = [j for j, (t, f) in enumerate(zip(s, fp)) if t != f]
            if len(wrong) < 2:
                continue
            for j in rng.choices(wrong[1:], k=len(wrong) // 2):
                s[j] = fp[j]


def augment_states(blocks: list[dict], prob: float, rng: random.Random) -> None:
    """pardec's ``copies`` scheme: add to every block ``augmented``: for each state but the fixed point, a copy with
    each wrong token after the first wrong one replaced by the fixed-point token with probability ``prob`` (copies
    equal to their state left out). The states themselves are not touched."""
    for b in blocks:
        fp = b["fixed_point"]
        extra = []
        for s in b["states"][:-1]:
            wrong = [j for j, (t, f) in enumerate(zip(s, fp)) if t != f]
            copy = list(s)
            for j in wrong[1:]:
                if rng.random() < prob:
                    copy[j] = fp[j]
            if copy != s:
                extra.append(copy)
        b["augmented"] = extra
