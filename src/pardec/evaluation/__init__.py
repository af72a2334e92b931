"""Evaluation, as run by `python -m evaluate +method=<m> [dataset=<d>] [model=<model>]`: run a method and its
baseline on the same prompts, interleaved per prompt, after a warm-up, with a fixed thread count; write
``results.jsonl`` (one line per prompt per role, appended as produced) and ``summary.json`` in the Hydra run dir;
print a table.

Roles: ``baseline`` (``bench.baseline``, plain ``ar`` at the same dtype), ``method``, and, when
``bench.include_hf=true``, transformers' own decoders as peers: ``hf`` (plain ``generate()``), ``hf_pld`` (its
prompt lookup) and, when a draft is configured, ``hf_assisted`` (assisted generation with the same draft model).
A killed run restarted with ``resume=true`` and the same ``hydra.run.dir`` redoes nothing that was written and
duplicates nothing; it is refused, changing nothing in the run dir, when any setting that changes the records
differs from the first attempt's (``run.json``: model and draft configs, dataset, sampling, max_new_tokens,
stop_at_eos, timeout_s, method and its parameters, roles, ...).

A prompt whose generation hits NaN/inf logits (or gives any non-finite number) gets a record with ``error``: it is
left out of every speed and quality aggregate, counted in the summary, and the run goes on. Nothing non-finite is
ever written: JSON is written with ``allow_nan=False`` after mapping NaN/inf to null.

Energy (``energy.enabled``, on by default): every timed generation is a Zeus window over the hardware energy
counters (NVML on GPUs, RAPL on CPUs, see :mod:`pardec.metrics.energy`); records get ``energy_j`` and the summary
``energy_j_per_token`` per role. Where no counter can be read the summary says "not measured" and why: nothing is
estimated. The warm-up is not measured.

A task whose scoring runs model output (HumanEval's code, Spider's SQL: ``sandboxed``) has its sandbox checked before
any model loads: a known-good program must pass and a known-bad one fail (:mod:`pardec.metrics.sandbox`); if not,
the run stops with one line naming the cause instead of scoring every completion 0.

Modules: :mod:`~pardec.evaluation.spec` (:class:`EvalSpec`, :func:`validate`, the resume identity),
:mod:`~pardec.evaluation.results` (the results log, nothing non-finite), :mod:`~pardec.evaluation.loop` (:func:`run`,
:func:`run_document`), :mod:`~pardec.evaluation.summary` (:func:`summarize`, pass@k) and
:mod:`~pardec.evaluation.tables` (the printed tables). The Hydra entry is :mod:`pardec.evaluate`.
"""

from pardec.evaluation.loop import run, run_document
from pardec.evaluation.results import ResultsLog, finite, first_divergence, is_failed, non_finite, write_json
from pardec.evaluation.spec import (
    PEERS,
    RUN_KEYS,
    EvalSpec,
    check_method,
    check_models,
    check_resume,
    check_scorer,
    parse_also,
    run_identity,
    validate,
)
from pardec.evaluation.summary import pass_at_k_summary, running_speed, summarize
from pardec.evaluation.tables import comparison_rows, format_comparison, format_table

__all__ = [
    "PEERS", "RUN_KEYS", "EvalSpec", "ResultsLog", "check_method", "check_models", "check_resume", "check_scorer",
    "comparison_rows", "finite", "first_divergence", "format_comparison", "format_table", "is_failed", "non_finite",
    "parse_also", "pass_at_k_summary", "run", "run_document", "run_identity", "running_speed", "summarize",
    "validate", "write_json",
]
