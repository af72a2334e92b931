"""The run's summary (``summary.json``): speed, exactness, quality, perplexity, drafting and energy per role,
divergences from the baseline and how many were near-ties, pass@k over repeats; what the records do not hold (a
skipped or errored prompt) is left out of every aggregate."""

from __future__ import annotations

import math
import resource
import statistics
from dataclasses import asdict
from typing import Any

import torch

from pardec.decoding import METHODS
from pardec.decoding.base import lossless_under_greedy
from pardec.evaluation.results import is_failed
from pardec.evaluation.spec import PEERS, EvalSpec
from pardec.metrics.busy import BUSY_CORES
from pardec.metrics.energy import joules_per_token
from pardec.metrics.passk import pass_at_k
from pardec.metrics.perplexity import perplexity
from pardec.metrics.sandbox import isolation
from pardec.metrics.speed import nonrepetitive_speed, speed_summary, tokens_per_s
from pardec.models.loading import int8_recipe

#: A divergence from the baseline is a *near-tie* when the target's top-1 and top-2 logits there
#: (``divergence_margin``, from one teacher-forced forward in the run's dtype) are less than NEAR_TIE_ULPS units in
#: the last place (ulp) of that dtype apart, the ulp taken at the top-1 logit's magnitude: bf16 keeps 8 significant
#: bits, so around a logit of 20 one ulp is 0.125 and the bound is 0.5; fp16 (11 bits) 1/8 of that; fp32 (24 bits)
#: ~1e-5. Why 4: the decoders reach a token through other kernels and shapes (one-token decode, a multi-token
#: verify forward, a tree mask) whose logits each round to the dtype's grid and accumulate in another order, so the
#: two candidates' logits can each move by an ulp or so per side between the two runs, and the teacher-forced
#: forward that measures the margin differs from both by as much again: 2 logits x 2 forwards = 4 ulps. Below it
#: the flip is rounding; a bug (a wrong mask, a stale cache row, a lossy rule) leaves whole logits between the
#: two, tens to hundreds of ulps. In fp32 the bound is so small that a divergence is nearly always a bug.
NEAR_TIE_ULPS = 4
#: significant bits (mantissa + the implicit one) of each run dtype
#: int8 (fbgemm, pardec.models.quant.int8): activations are rounded to 256 levels of their range, so a logit is known to
#: about 8 bits relative to its magnitude, as in bf16
SIGNIFICANT_BITS = {"bf16": 8, "fp16": 11, "fp32": 24, "tf32": 11, "int8": 8}


def matmul_precision(dtype: str, tf32: bool, device: str) -> str:
    """The precision the run's matmuls had: an fp32 run on a CUDA GPU with ``tf32`` on multiplies in TF32 (11
    significant bits), so its near-tie bound is TF32's."""
    return "tf32" if dtype == "fp32" and tf32 and str(device).startswith("cuda") else dtype


def near_tie_bound(top_logit: float, dtype: str) -> float:
    """NEAR_TIE_ULPS ulps of ``dtype`` at the magnitude of ``top_logit``."""
    _, exp = math.frexp(abs(top_logit))  # |x| = m * 2**exp, 0.5 <= m < 1: its binade starts at 2**(exp - 1)
    return NEAR_TIE_ULPS * 2.0 ** (exp - 1 - (SIGNIFICANT_BITS[dtype] - 1))


def is_near_tie(rec: dict, dtype: str) -> bool | None:
    """Whether a divergent record's divergence was a near-tie (None: no margin recorded)."""
    margin, top = rec.get("divergence_margin"), rec.get("divergence_top")
    if margin is None or not top or top[0][1] is None:
        return None
    return margin < near_tie_bound(top[0][1], dtype)


def divergences(rows: list[dict], dtype: str) -> dict[str, int | None]:
    """``n_divergences`` (records whose tokens differ from the baseline's) and ``n_near_ties`` (those whose target
    margin was below :func:`near_tie_bound`) of some records; ``n_near_ties`` is None where records diverged but
    none has a margin (a sampled run, where no margin is read)."""
    diverged = [x for x in rows if x.get("equal_to_baseline") is False]
    ties = [is_near_tie(x, dtype) for x in diverged]
    if diverged and all(t is None for t in ties):
        return {"n_divergences": len(diverged), "n_near_ties": None}
    return {"n_divergences": len(diverged), "n_near_ties": sum(bool(t) for t in ties)}


def running_speed(records: list[dict], method_role: str) -> str:
    """The progress bar's note: the method's tokens/s so far and its speedup over the baseline ("" before both ran)."""
    m = [x for x in records if x["role"] == method_role and not is_failed(x)]
    b = [x for x in records if x["role"] == "baseline" and not is_failed(x)]
    mt, bt = tokens_per_s(m) if m else None, tokens_per_s(b) if b else None
    return f"{mt:.1f} tok/s, x{mt / bt:.2f}" if mt and bt else ""


def scorer_dtype(dtype: str) -> str:
    """The dtype perplexity is scored in: the run's, except that int8 runs are scored in fp32 (int8 changes the
    model; docs/cpu_speed.md "int8 that keeps the model's quality")."""
    return "fp32" if dtype == "int8" else dtype


def perplexity_scorer(spec: EvalSpec) -> str | None:
    """Which model scores the perplexity (``<name> <dtype>``): ``perplexity.model`` or the target, in
    :func:`scorer_dtype`; None when perplexity is off."""
    if not spec.perplexity.get("enabled"):
        return None
    return f"{spec.perplexity.get('model') or spec.model.name} {scorer_dtype(spec.model.dtype)}"


def _int8_recipe(model_cfg) -> dict | None:
    return int8_recipe(model_cfg) if model_cfg.dtype == "int8" else None


def summarize(spec: EvalSpec, task, records: list[dict], method_role: str, model_config,
              energy: dict | None = None) -> dict[str, Any]:
    """The run's summary. ``energy``: the meter's ``status()`` (``measured``, ``reason``, ``devices``); without it,
    what the records say (measured where some record has ``energy_j``)."""
    ok = [x for x in records if not is_failed(x)]
    device = next((str(x["device"]) for x in records if x.get("device")), None) or str(spec.devices[0])
    precision = matmul_precision(spec.model.dtype, spec.run.tf32, device)
    also = {role: name for role, name, _ in spec.also}
    also_params = {role: params for role, _, params in spec.also}
    rows = {role: [x for x in ok if x["role"] == role] for role in ("baseline", "method", *PEERS, *also)}
    method_rows = rows[method_role]
    skipped = sorted({x["id"] for x in records if "skipped" in x})
    errors = [{k: x[k] for k in ("id", "role", "repeat", "error")} for x in records if "error" in x]
    cls = METHODS.get(spec.method)
    if energy is None:
        measured = any(x.get("energy_j") is not None for x in ok)
        energy = {"measured": measured, "reason": None if measured else "no energy meter in this run", "devices": ""}

    def exact(role_rows: list[dict], method: str) -> float | None:
        """Share of prompts equal to the baseline, for methods lossless under greedy decoding (else None)."""
        if not (lossless_under_greedy(METHODS.get(method)) and spec.sampling.greedy):
            return None
        eq = [x["equal_to_baseline"] for x in role_rows if x.get("equal_to_baseline") is not None]
        return sum(eq) / len(eq) if eq else None

    def quality(rs: list[dict]) -> dict:
        first = [x for x in rs if x.get("repeat", 0) == 0]
        return task.aggregate([x["score"] for x in first]) if first else {}

    def ppl(rs: list[dict]) -> float | None:
        n = sum(x.get("nll_tokens") or 0 for x in rs)
        s = sum(x.get("nll") or 0.0 for x in rs)
        return perplexity(s, n) if n and s / n < 700 else None  # exp() of more overflows: no meaningful value

    def drafting(rs: list[dict]) -> dict:
        """Draft use of some records: acceptance of drafted tokens, mean tokens committed per target forward
        (``accepted``), the draft's share of wall time; None where the records did not draft."""
        drafted, wall = sum(x.get("drafted") or 0 for x in rs), sum(x["wall_s"] for x in rs)
        forwards = sum(x.get("draft_forwards") or 0 for x in rs)
        acc = [a for x in rs for a in x.get("accepted") or []]
        return {"draft_forwards": forwards,
                "draft_acceptance": sum(x.get("draft_accepted") or 0 for x in rs) / drafted if drafted else None,
                "mean_accepted_length": statistics.fmean(acc) if acc else None,
                "draft_time_share": sum(x.get("draft_s") or 0.0 for x in rs) / wall if wall > 0 and forwards else None}

    mq, bq = quality(method_rows), quality(rows["baseline"])
    role_method = {"baseline": spec.bench.baseline, "method": spec.method, **PEERS, **also}
    if method_role == "baseline":
        method_exact = 1.0 if method_rows and lossless_under_greedy(cls) and spec.sampling.greedy else None
    else:
        method_exact = exact(method_rows, spec.method)
    peers = {}
    for role in (*PEERS, *also):
        if rows[role]:
            sp = speed_summary(rows[role], rows["baseline"])
            peers[role] = {"method": role_method[role], "exactness": METHODS.get(role_method[role]).exactness,
                           "params": also_params.get(role, {}),
                           "tokens_per_s": sp["tokens_per_s"], "speedup": sp["speedup"],
                           "speedup_median": sp.get("speedup_median"),
                           "decode_tokens_per_s": sp["decode_tokens_per_s"],
                           "tokens_per_forward": sp["tokens_per_forward"],
                           "exact_match_rate": exact(rows[role], role_method[role]),
                           "energy_j_per_token": joules_per_token(rows[role]), "perplexity": ppl(rows[role]),
                           "metric": quality(rows[role]).get(task.metric), **drafting(rows[role]),
                           "busy_records": sum(bool(x.get("busy")) for x in rows[role]),
                           **divergences(rows[role], precision)}
    summary: dict[str, Any] = {
        "method": spec.method,
        "method_params": spec.method_params,
        "baseline": spec.bench.baseline,
        "draft": spec.draft.name if spec.draft else None,
        "draft_path": spec.draft.path if spec.draft else None,  # a config name (``local``) names no one draft
        "dataset": spec.dataset.name,
        "model": spec.model.name,
        "dtype": spec.model.dtype,
        # how the int8 model was built (scheme, SmoothQuant alpha, linears kept fp32); None unless dtype=int8
        "int8_recipe": _int8_recipe(spec.model),
        "draft_int8_recipe": _int8_recipe(spec.draft) if spec.draft else None,  # (drafts default to weight_only)
        "near_tie_precision": precision,  # the grid of the near-tie bound: tf32 for fp32 on a CUDA GPU with tf32
        "n_samples": len({x["id"] for x in method_rows}),
        "skipped": skipped,
        "n_errors": len(errors),
        "errors": errors,
        "repeats": spec.run.repeats,
        "max_new_tokens": spec.run.max_new_tokens,
        "sampling": asdict(spec.sampling),
        "threads": spec.run.threads,
        "kv_cache": spec.run.kv_cache,  # the decoders' KV cache and forward (the hf peers run transformers' own)
        "sandbox": isolation() if task.sandboxed else None,  # which isolation ran model output, see metrics/sandbox.py
        "exactness": cls.exactness,
        **speed_summary(method_rows, rows["baseline"] or method_rows),
        # the same without the prompts whose generation repeats a token 10 times in a row (the CLLM authors' speed
        # script drops them: metrics.speed.nonrepetitive_speed); every method, beside the figures above
        **nonrepetitive_speed(method_rows, rows["baseline"] or method_rows),
        "hf_tokens_per_s": tokens_per_s(rows["hf"]) if rows["hf"] else None,
        "exact_match_rate": method_exact,
        "first_divergences": [x["first_divergence"] for x in method_rows if x.get("first_divergence") is not None],
        **divergences(method_rows, precision),
        "near_tie_ulps": NEAR_TIE_ULPS,
        **drafting(method_rows),
        "peers": peers,
        "metric_name": task.metric,
        "metric": mq.get(task.metric),
        "baseline_metric": bq.get(task.metric),
        "metrics": mq,
        "perplexity": ppl(method_rows),
        "perplexity_scorer": perplexity_scorer(spec),
        "baseline_perplexity": ppl(rows["baseline"]),
        "energy": dict(energy),
        "energy_j_per_token": joules_per_token(method_rows),
        "baseline_energy_j_per_token": joules_per_token(rows["baseline"]),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "busy": busy_summary(ok, rows),
        "extras": {k: statistics.fmean(x["extras"][k] for x in method_rows if k in x["extras"])
                   for k in sorted({k for x in method_rows for k in x["extras"]})},
    }
    if rows["hf"]:
        summary["hf_exact_match_rate"] = peers["hf"]["exact_match_rate"]
    try:
        if torch.cuda.is_available():
            summary["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    except RuntimeError:
        pass
    if task.metric == "pass" and spec.run.repeats > 1 and not spec.sampling.greedy:
        summary["pass_at_k"] = pass_at_k_summary(method_rows, spec.run.repeats)
    return summary


def busy_summary(records: list[dict], rows: dict[str, list[dict]]) -> dict[str, Any]:
    """How many timed records ran while other processes competed for the CPU (:mod:`pardec.metrics.busy`):
    ``records`` (all roles), ``by_role`` (roles with any), ``measured`` (whether any record was measured) and the
    ``threshold_cores`` a record's ``busy`` mark used. A busy record's timing is disturbed: a table that publishes
    speed refuses a cell built on one unless told otherwise."""
    by_role = {role: n for role, rs in rows.items() if (n := sum(bool(x.get("busy")) for x in rs))}
    return {"records": sum(bool(x.get("busy")) for x in records), "of": len(records), "by_role": by_role,
            "measured": any(x.get("busy") is not None for x in records), "threshold_cores": BUSY_CORES}


def pass_at_k_summary(rows: list[dict], n: int) -> dict[str, float]:
    """pass@k for k in 1, 2, 5, 10, 100 up to ``n`` samples per prompt (the unbiased estimator of
    :func:`pardec.metrics.passk.pass_at_k`, averaged over the prompts with at least k samples; None: none has)."""
    per_doc: dict[str, list[float]] = {}
    for x in rows:
        per_doc.setdefault(x["id"], []).append(float(x["score"].get("pass") or 0.0))
    out = {}
    for k in (1, 2, 5, 10, 100):
        if k <= n:
            vals = [pass_at_k(len(v), int(sum(v)), k) for v in per_doc.values() if len(v) >= k]
            out[f"pass@{k}"] = statistics.fmean(vals) if vals else None
    return out
