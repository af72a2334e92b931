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

Several processes (``torchrun --nproc_per_node N -m evaluate ...``, ``accelerate launch``): rank r runs the prompts
with index % N == r on its own device (``cuda:LOCAL_RANK``), the roles still interleaved per prompt, after its own
warm-up, appending to ``results.rank{r}-of-{N}.jsonl`` (resumed on its own); rank 0 waits for all, merges them into
``results.jsonl`` and writes one ``summary.json`` with ``ranks`` (see :mod:`~pardec.evaluation.ranks`).

Where a role's tokens differ from the baseline's under greedy decoding, its record carries the target's logit margin there
(``divergence_margin``: top-1 minus top-2, ``divergence_top``) and the summary counts the divergences and the
near-ties among them (margin below :data:`~pardec.evaluation.summary.NEAR_TIE_ULPS` ulps of the run's dtype): a
near-tie flip in bf16 is rounding, a divergence with a wide margin a bug (or a lossy method at work).

A task whose scoring runs model output (HumanEval's code, Spider's SQL: ``sandboxed``) has its sandbox checked before
any model loads: a known-good program must pass and a known-bad one fail (:mod:`pardec.metrics.sandbox`); if not,
the run stops with one line naming the cause instead of scoring every completion 0.

Modules: :mod:`~pardec.evaluation.spec` (:class:`EvalSpec`, :func:`validate`, the resume identity),
:mod:`~pardec.evaluation.results` (the results log and the ranks' part files, nothing non-finite),
:mod:`~pardec.evaluation.loop` (:func:`run`, :func:`run_document`, :func:`divergence_logits`),
:mod:`~pardec.evaluation.ranks` (several processes), :mod:`~pardec.evaluation.summary` (:func:`summarize`, near-ties,
pass@k) and :mod:`~pardec.evaluation.tables` (the printed tables). The Hydra entry is :mod:`pardec.evaluate`.
"""

from pardec.evaluation.loop import divergence_logits, run, run_document
from pardec.evaluation.ranks import Ranks
from pardec.evaluation.results import (
    ResultsLog,
    finite,
    first_divergence,
    is_failed,
    merge_parts,
    non_finite,
    part_path,
    write_json,
)
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
from pardec.evaluation.summary import (
    NEAR_TIE_ULPS,
    divergences,
    is_near_tie,
    near_tie_bound,
    pass_at_k_summary,
    running_speed,
    summarize,
)
from pardec.evaluation.tables import comparison_rows, format_comparison, format_table, method_label

__all__ = [
    "NEAR_TIE_ULPS", "PEERS", "RUN_KEYS", "EvalSpec", "Ranks", "ResultsLog", "check_method", "check_models",
    "check_resume", "check_scorer", "comparison_rows", "divergence_logits", "divergences", "finite",
    "first_divergence", "format_comparison", "format_table", "is_failed", "is_near_tie", "merge_parts", "method_label",
    "near_tie_bound", "non_finite", "parse_also", "part_path", "pass_at_k_summary", "run", "run_document",
    "run_identity", "running_speed", "summarize", "validate", "write_json",
]
