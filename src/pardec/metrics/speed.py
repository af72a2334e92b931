"""Speed aggregation over per-prompt records: totals, per-repeat mean ± std, per-prompt medians, and the same
figures without repetitive generations (as the CLLM authors measure speed: :func:`nonrepetitive_speed`)."""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def tokens_per_s(rows: list[dict]) -> float | None:
    """Total tokens / total wall time."""
    wall = sum(r["wall_s"] for r in rows)
    return sum(r["n_tokens"] for r in rows) / wall if wall > 0 else None


def decode_tokens_per_s(rows: list[dict]) -> float | None:
    """Tokens/s of decoding alone: prefill (the prompt's forward and the token it commits, once per turn) left out
    of both counts. End-to-end :func:`tokens_per_s` includes it; at 256 new tokens they differ by a few percent, at
    48 by more."""
    n = sum(r["n_tokens"] - len(r.get("turn_tokens") or [None]) for r in rows)
    wall = sum(r["wall_s"] - r.get("prefill_s", 0.0) for r in rows)
    return n / wall if wall > 0 and n > 0 else None


def per_repeat(rows: list[dict]) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        out[r.get("repeat", 0)].append(r)
    return dict(out)


def speed_summary(method: list[dict], baseline: list[dict]) -> dict:
    """Tokens/s of method and baseline and their ratio, each as mean ± std over repeats, plus the median
    of per-prompt speedups. Rows are results.jsonl records (skipped ones excluded)."""
    m_rep, b_rep = per_repeat(method), per_repeat(baseline)
    m_tps = [tokens_per_s(rows) for rows in m_rep.values()]
    b_tps = [tokens_per_s(rows) for rows in b_rep.values()]
    ratios = [m / b for r in m_rep if r in b_rep
              for m, b in [(tokens_per_s(m_rep[r]), tokens_per_s(b_rep[r]))] if m and b]
    base = {(r["id"], r.get("repeat", 0)): r for r in baseline}
    per_prompt = []
    for r in method:
        b = base.get((r["id"], r.get("repeat", 0)))
        if b and r["wall_s"] > 0 and b["wall_s"] > 0 and b["n_tokens"] and r["n_tokens"]:
            per_prompt.append((r["n_tokens"] / r["wall_s"]) / (b["n_tokens"] / b["wall_s"]))
    tps, tps_std = mean_std([x for x in m_tps if x])
    btps, btps_std = mean_std([x for x in b_tps if x])
    sp, sp_std = mean_std(ratios)
    dec, bdec = mean_std([x for x in map(decode_tokens_per_s, m_rep.values()) if x]), mean_std(
        [x for x in map(decode_tokens_per_s, b_rep.values()) if x])
    forwards = sum(r["target_forwards"] for r in method)
    bforwards = sum(r["target_forwards"] for r in baseline)
    return {
        "tokens_per_s": tps,
        "tokens_per_s_std": tps_std,
        "baseline_tokens_per_s": btps,
        "baseline_tokens_per_s_std": btps_std,
        "speedup": sp,
        "speedup_std": sp_std,
        "speedup_median": statistics.median(per_prompt) if per_prompt else None,
        "decode_tokens_per_s": dec[0],
        "baseline_decode_tokens_per_s": bdec[0],
        "decode_speedup": dec[0] / bdec[0] if dec[0] and bdec[0] else None,
        "tokens_per_forward": sum(r["n_tokens"] for r in method) / forwards if forwards else None,
        "baseline_tokens_per_forward": sum(r["n_tokens"] for r in baseline) / bforwards if bforwards else None,
        "accepted_histogram": dict(sorted(Counter(a for r in method for a in r.get("accepted", [])).items())),
    }


#: A generation is *repetitive* when one token comes REPEAT_RUN times in a row: the official CLLM speed script
#: (hao-ai-lab/Consistency_LLM eval/gsm8k/speedup.py) drops such generations before averaging, with
#: cllm/utils.py ``detect_repetitive_patterns(..., repeat_ngram_size=10)``, which counts equal consecutive tokens up to
#: the first EOS (a "run" of one token, despite the name).
REPEAT_RUN = 10


def is_repetitive(tokens: list[int], run: int = REPEAT_RUN) -> bool:
    """True when some token occurs ``run`` times back to back in ``tokens``."""
    count = 1
    for a, b in zip(tokens, tokens[1:]):
        count = count + 1 if a == b else 1
        if count >= run:
            return True
    return run <= 1 and bool(tokens)


def record_is_repetitive(rec: dict, run: int = REPEAT_RUN) -> bool:
    """A results record is repetitive when any of its turns is (``turn_tokens``, else ``tokens``)."""
    turns = rec.get("turn_tokens") or [rec.get("tokens") or []]
    return any(is_repetitive(t, run) for t in turns)


def nonrepetitive_speed(method: list[dict], baseline: list[dict], run: int = REPEAT_RUN) -> dict:
    """The speed figures of :func:`speed_summary` over the prompts whose *method* generation is not repetitive
    (:func:`record_is_repetitive`), the baseline's records of those prompts dropped with them, as the official CLLM
    speed script measures (it times AR only on the prompts whose Jacobi output it keeps). Keys end in
    ``_nonrepetitive``; ``n_repetitive``: the method records dropped."""
    drop = {(r["id"], r.get("repeat", 0)) for r in method if record_is_repetitive(r, run)}
    keep = lambda rows: [r for r in rows if (r["id"], r.get("repeat", 0)) not in drop]  # noqa: E731
    m, b = keep(method), keep(baseline)
    sp = speed_summary(m, b) if m else {}
    return {"n_repetitive": len(drop), "repetitive_run": run,
            **{f"{k}_nonrepetitive": sp.get(k) for k in ("tokens_per_s", "baseline_tokens_per_s", "speedup",
                                                           "speedup_median", "tokens_per_forward")}}
