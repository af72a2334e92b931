"""Reports on evaluation and training runs: ``python -m pardec.report <subcommand>`` (``--help`` lists them).

* ``runs`` (:mod:`pardec.report.runs`): evaluation run dirs into one Spec-Bench-style report (tables, CSV, plots);
* ``cllm`` (:mod:`pardec.report.cllm`): Jacobi and lookahead on a base model and its CLLM, plus training curves;
* ``drafters`` (:mod:`pardec.report.drafters`): trained drafters side by side (curves, held-out results);
* ``heads`` (:mod:`pardec.report.heads`): the FIRP paper's analyses, Medusa vs FIRP;
* ``sdsat`` (:mod:`pardec.report.sdsat`): SDSAT against k and the quality-parity table;
* ``extras`` (:mod:`pardec.report.extras`): method extras per role (block efficiency, pool hits, ...);
* ``docs`` (:mod:`pardec.report.docs`): the tables of README.md and docs/, generated from docs/results/ (``--check``).

Every report reads a run's ``summary.json`` through :func:`pardec.evaluation.tables.comparison_rows`. The names of
:mod:`pardec.report.runs` and :mod:`pardec.report.run_dirs` below are loaded on first use, so ``--help`` and
``docs`` start without torch.
"""

import importlib

_RUNS = ("MISSING", "Cell", "Row", "bench_table", "build_table", "main", "render_markdown", "write_report")
_RUN_DIRS = ("ReportWarning", "load_runs", "log_history", "method_entries", "read_results")

COMMANDS = {
    "runs": ("runs", "evaluation run dirs -> report.md, report.csv and plots (Spec-Bench style)"),
    "cllm": ("cllm", "the CLLM report: jacobi/lookahead on base vs CLLM, answer quality, training curves"),
    "drafters": ("drafters", "trained drafters side by side: training curves and held-out results"),
    "heads": ("heads", "FIRP vs Medusa: per-step accuracy, accepted tokens per forward by tree, cosines"),
    "sdsat": ("sdsat", "SDSAT: acceptance and tokens/s against k, the quality-parity table"),
    "extras": ("extras", "method extras per (dataset, role), averaged over prompts, from results.jsonl"),
    "docs": ("docs", "README.md and docs/: rewrite every generated table from docs/results/ (--check: compare only)"),
}

__all__ = ["COMMANDS", "MISSING", "Cell", "ReportWarning", "Row", "bench_table", "build_table", "load_runs",
           "log_history", "main", "method_entries", "read_results", "render_markdown", "save_figure",
           "write_report"]


def __getattr__(name: str):
    if name == "save_figure":
        return importlib.import_module("pardec.report.plots").save_figure
    if name in _RUN_DIRS:
        return getattr(importlib.import_module("pardec.report.run_dirs"), name)
    if name in _RUNS:
        return getattr(importlib.import_module("pardec.report.runs"), name)
    raise AttributeError(f"module 'pardec.report' has no attribute {name!r}")
