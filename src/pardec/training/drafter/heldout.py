"""Held-out acceptance by draft position, as counts and the figures made of them: shared by EAGLE-3's and DFlash's
teacher-forced evaluations (``pardec.training.drafter.eagle.acceptance``, ``pardec.training.drafter.dflash.acceptance``)."""

from __future__ import annotations


def summarise(counts: dict, steps: int, topk: int) -> dict:
    """The figures of an ``acceptance`` evaluation from its counts (which :func:`merge_acceptance` pools exactly)."""
    valid = counts["valid"]

    def rate(key, den=valid):
        return [counts[key][d] / max(den[d], 1) for d in range(steps)]

    chain = rate("accepted")
    ranks = {"rank_accuracy": [[c / max(valid[d], 1) for c in counts["rank"][d]] for d in range(steps)]} \
        if "rank" in counts else {}
    return {"anchors": counts["anchors"], "steps": steps, "topk": topk, "valid_per_depth": valid,
            "conditional_acceptance": rate("accepted", counts["reached"]), "chain_acceptance": chain,
            "expected_tokens_per_forward": 1.0 + sum(chain), "topk_containment": rate("topk"),
            "top1_agreement": rate("top1"),
            "target_matches_record": counts["target_matches"] / max(counts["anchors"], 1), **ranks, **walk_figures(counts),
            "counts": counts}


def walk_figures(counts: dict) -> dict:
    """``decoding_tokens_per_forward``: the tokens per target forward (prefill included, as decoding counts them)
    that greedy chain decoding of the records would make, from ``walk_tokens`` / ``walk_forwards`` (counts of
    :func:`walk`); absent from counts that predate them."""
    if "walk_forwards" not in counts:
        return {}
    return {"decoding_tokens_per_forward": counts["walk_tokens"] / max(counts["walk_forwards"], 1)}


def walk(runs: list[int]) -> int:
    """The target forwards greedy chain decoding makes along one record, prefill included, given ``runs[i]``: the
    accepted run of a block drafted at the record's ``i``-th anchor (anchor 0: the first round's, right after the
    prefill). A round commits its run and the target's next token, so the next round drafts ``run + 1`` anchors on:
    decoding visits only the anchors after a rejection, where the every-anchor average of
    ``expected_tokens_per_forward`` counts them all (the two differ when hard positions cluster)."""
    i = forwards = 0
    while i < len(runs):
        i += runs[i] + 1
        forwards += 1
    return forwards + 1


def merge_acceptance(parts: list[dict]) -> dict:
    """Pool per-dataset ``acceptance`` results (their counts summed)."""
    steps, topk = parts[0]["steps"], parts[0]["topk"]
    counts = {k: _sum([p["counts"][k] for p in parts]) for k in parts[0]["counts"]}
    return summarise(counts, steps, topk)


def _sum(values: list):
    """Elementwise sum of equally shaped counts (ints, or lists of them, nested)."""
    if isinstance(values[0], list):
        return [_sum(list(col)) for col in zip(*values, strict=True)]
    return sum(values)
