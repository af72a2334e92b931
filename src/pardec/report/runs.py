"""Collect evaluation run dirs into one Spec-Bench-style report: markdown tables, a CSV and plots.

    python -m pardec.report runs outputs/multirun/2026-*/* --out reports/x

Every run dir written by ``python -m evaluate`` holds a ``summary.json`` (one method on one dataset,
against its baseline) and a ``results.jsonl`` (one line per prompt per role). Runs are grouped into
table rows by (method, params and draft, model, dtype, setting: max_new_tokens and sampling), so runs that differ
in any of them are never averaged together; the baseline (``ar``) gets its own row at 1.00× per setting, and
transformers' decoders run beside it (``peers`` in the summary: ``hf_generate``, ``hf_pld``, ``hf_assisted``)
get theirs. Prompts whose generation failed (``error`` in results.jsonl) are counted, never measured. Energy per
generated token (``energy_j_per_token``) gets its own table where some run measured it, else one line saying
why not ("not measured: <reason>" from the summaries' ``energy``).
"""

from __future__ import annotations

import argparse
import csv
import statistics
import warnings
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pardec.evaluation.tables import comparison_rows
from pardec.report.markdown import MISSING, markdown_table
from pardec.report.plots import plot_accepted_hist, plot_speedup, plot_speedup_vs_tpf
from pardec.report.run_dirs import ReportWarning, load_runs

# ------------------------------------------------------------------------------------------- table


@dataclass
class Cell:
    """One (row, dataset) entry: means over the runs that fell in it."""

    speedup: float | None
    speedup_std: float | None
    tokens_per_s: float | None
    baseline_tokens_per_s: float | None
    hf_tokens_per_s: float | None
    tokens_per_forward: float | None
    exact_match: float | None
    draft_acceptance: float | None
    exactness: str | None
    metric_name: str | None
    metric: float | None
    perplexity: float | None
    energy_j_per_token: float | None = None
    energy_reason: str | None = None  # why a run of this cell has no energy_j_per_token


@dataclass
class Row:
    """A table row: one method (or the baseline) for one (model, dtype, setting), across datasets."""

    method: str
    params: str
    model: str
    dtype: str
    is_baseline: bool
    is_peer: bool = False  # transformers' decoders run beside the baseline (``peers`` of the summaries)
    label: str = ""
    cells: dict[str, Cell] = field(default_factory=dict)
    setting: str = ""  # max_new_tokens and sampling, as :func:`_setting` writes them

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        """(method, params, model, dtype, setting), as :func:`_group` gives it for a run."""
        return self.method, self.params, self.model, self.dtype, self.setting

    def overall(self, attr: str) -> float | None:
        """Mean of a cell attribute over the datasets that have it."""
        return _mean(getattr(c, attr) for c in self.cells.values())

    def exactness(self) -> str:
        """What the method guarantees (``tokens`` / ``distribution`` / ``approximate``), as its runs say."""
        return next((c.exactness for c in self.cells.values() if c.exactness), MISSING)

    def quality(self) -> str:
        """Task metric(s) averaged over datasets, each with its name, e.g. ``correct 0.120``."""
        by_name: dict[str, list[float]] = defaultdict(list)
        for c in self.cells.values():
            if c.metric is not None:
                by_name[c.metric_name or "metric"].append(c.metric)
        return " · ".join(f"{name} {statistics.fmean(v):.3f}" for name, v in by_name.items()) or MISSING


def _setting(run: dict[str, Any]) -> str:
    """What a run generated under besides its method: ``max_new_tokens=256, greedy`` or ``max_new_tokens=256,
    temperature=0.7, top_k=0, top_p=0.9``. The sampling seed is left out: runs differing only in it are repeats of
    one setting (averaged, with a warning)."""
    s = run.get("sampling") or {}
    parts = [f"max_new_tokens={run['max_new_tokens']}"] if run.get("max_new_tokens") is not None else []
    if s.get("temperature"):
        parts += [f"{k}={s.get(k)}" for k in ("temperature", "top_k", "top_p")]
    elif s:
        parts.append("greedy")
    return ", ".join(parts)


def _draft(run: dict[str, Any]) -> list[tuple[str, str]]:
    """``[("draft", "<name>")]`` (``<name> <path>`` when the summary gives a path), or [] without a draft."""
    if not run.get("draft"):
        return []
    return [("draft", f"{run['draft']} {run['draft_path']}" if run.get("draft_path") else str(run["draft"]))]


def _group(run: dict[str, Any]) -> tuple[str, str, str, str, str]:
    """(method, method params (and draft) as ``k=v, ...``, model, dtype, setting) of a run: its row in the table."""
    params = sorted((run.get("method_params") or {}).items()) + _draft(run)
    return (str(run["method"]), ", ".join(f"{k}={v}" for k, v in params), str(run.get("model", "?")),
            str(run.get("dtype", "?")), _setting(run))


def _mean(values: Iterable[float | None]) -> float | None:
    present = [float(v) for v in values if v is not None]
    return statistics.fmean(present) if present else None


def _energy_reason(run: dict[str, Any]) -> str:
    """Why a run's summary may hold no energy per token (its ``energy.reason``)."""
    energy = run.get("energy")
    if not energy:
        return "the run recorded no energy"
    return energy.get("reason") or "some generations were not measured"


def _entry(run: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The numbers one role of a run (a row of :func:`~pardec.evaluation.tables.comparison_rows`) contributes to
    its table row: the baseline's speedup is 1.0 and its own exact match, acceptance and exactness are left empty
    (it is the reference); a peer names the run's metric only where it has a metric of its own."""
    role = row["role"]
    repeated = (run.get("repeats") or 1) > 1
    return {
        "speedup": 1.0 if role == "baseline" else row.get("speedup"),
        "speedup_std": row.get("speedup_std") if repeated and role == "method" else None,
        "tokens_per_s": row.get("tokens_per_s"),
        "baseline_tokens_per_s": run.get("baseline_tokens_per_s"),
        "hf_tokens_per_s": run.get("hf_tokens_per_s"),
        "tokens_per_forward": row.get("tokens_per_forward"),
        "exact_match": row.get("exact_match_rate"),
        "draft_acceptance": row.get("draft_acceptance"),
        "exactness": row.get("exactness"),
        "metric_name": run.get("metric_name") if role in ("baseline", "method") or row.get("metric") is not None
        else None,
        "metric": row.get("metric"),
        "perplexity": row.get("perplexity"),  # absent in peers of summaries before 2026-11-21
        "energy_j_per_token": row.get("energy_j_per_token"),
        "energy_reason": _energy_reason(run),
    }


def _cell(entries: list[dict[str, Any]]) -> Cell:
    """Average entries; several runs of one cell get the std of their speedups, one run keeps its own."""
    speedups = [e["speedup"] for e in entries if e["speedup"] is not None]
    std = entries[0]["speedup_std"] if len(entries) == 1 else None
    if len(speedups) > 1 and len(set(speedups)) > 1:
        std = statistics.stdev(speedups)
    names = {e["metric_name"] for e in entries if e["metric_name"]}
    return Cell(
        speedup=_mean(speedups),
        speedup_std=std,
        metric_name=" / ".join(sorted(names)) or None,
        exactness=next((e["exactness"] for e in entries if e["exactness"]), None),
        energy_reason=next((e["energy_reason"] for e in entries if e["energy_j_per_token"] is None), None),
        **{k: _mean(e[k] for e in entries) for k in (
            "tokens_per_s", "baseline_tokens_per_s", "hf_tokens_per_s",
            "tokens_per_forward", "exact_match", "draft_acceptance", "metric", "perplexity",
            "energy_j_per_token")},
    )  # fmt: skip


def build_table(runs: Sequence[dict[str, Any]]) -> list[Row]:
    """Rows grouped by (method, method params and draft, model, dtype, setting), the baseline's row first in each
    (model, dtype, setting), then the peers (transformers' decoders, from each run's ``peers``), then the methods.

    Labels name the params, model, dtype and setting only where they vary. Several runs of one (row, dataset) cell
    are averaged, with a :class:`ReportWarning` (not for the baseline and peers, which every job reruns).
    """
    entries: dict[tuple[str, str, str, str, str, bool], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    peer_keys: set[tuple[str, str, str, str, str, bool]] = set()
    for run in runs:
        method, params, model, dtype, setting = _group(run)
        dataset = str(run["dataset"])
        for row in comparison_rows(run):
            if row["role"] == "baseline":
                key = (str(row["method"]), "", model, dtype, setting, True)
            elif row["role"] == "method":
                key = (method, params, model, dtype, setting, False)
            else:  # a peer: tagged by a bench.also role's own parameters, and the draft where it drafted
                tag = sorted(row["params"].items()) + (_draft(run) if row.get("draft_forwards") else [])
                key = (str(row["method"]), ", ".join(f"{k}={v}" for k, v in tag), model, dtype, setting, False)
                peer_keys.add(key)
            entries[key][dataset].append(_entry(run, row))

    params_of: dict[str, set[str]] = defaultdict(set)
    for method, params, *_ in entries:
        params_of[method].add(params)
    models, dtypes, settings = {k[2] for k in entries}, {k[3] for k in entries}, {k[4] for k in entries}
    rows = []
    for key in sorted(entries, key=lambda k: (k[2], k[3], k[4], not k[5], k not in peer_keys, k[0], k[1])):
        method, params, model, dtype, setting, is_base = key
        varying = ((params, len(params_of[method]) > 1), (model, len(models) > 1), (dtype, len(dtypes) > 1),
                   (setting, len(settings) > 1))
        tags = [tag for tag, varies in varying if varies and tag]
        label = f"{method} ({', '.join(tags)})" if tags else method
        cells = {ds: _cell(es) for ds, es in sorted(entries[key].items())}
        for ds, es in entries[key].items():
            if len(es) > 1 and not is_base and key not in peer_keys:
                where = f"{method} [{params}] {model} {dtype} [{setting}] on {ds}"
                warnings.warn(f"{len(es)} runs of {where}: averaged", ReportWarning, stacklevel=2)
        rows.append(Row(method, params, model, dtype, is_base, key in peer_keys, label, cells, setting))
    return rows


def datasets_of(rows: Sequence[Row]) -> list[str]:
    """Sorted datasets appearing in any row."""
    return sorted({ds for row in rows for ds in row.cells})


# ------------------------------------------------------------------------------------------ format


def _num(value: float | None, fmt: str = ".2f") -> str:
    return MISSING if value is None else f"{value:{fmt}}"


def format_speedup(mean: float | None, std: float | None = None) -> str:
    """``1.37×``, or ``1.37× ± 0.05`` when a std is known."""
    if mean is None:
        return MISSING
    return f"{mean:.2f}×" + (f" ± {std:.2f}" if std is not None else "")


def render_markdown(rows: Sequence[Row]) -> str:
    """The speedup table (Spec-Bench style) and the tokens/s table, as markdown."""
    datasets = datasets_of(rows)
    speed = markdown_table(
        ["Method", *datasets, "Mean speedup", "Tokens/forward", "Exactness", "Exact match", "Draft acceptance",
         "Quality", "Perplexity"],
        [
            [
                row.label,
                *(format_speedup(c.speedup, c.speedup_std) if (c := row.cells.get(ds)) else MISSING
                  for ds in datasets),
                format_speedup(row.overall("speedup")),
                _num(row.overall("tokens_per_forward")),
                "reference" if row.is_baseline else row.exactness(),
                _num(row.overall("exact_match"), ".1%"),
                _num(row.overall("draft_acceptance"), ".1%"),
                row.quality(),
                _num(row.overall("perplexity")),
            ]
            for row in rows
        ],
        centered=True,
    )  # fmt: skip

    def tps(c: Cell | None) -> str:
        if c is None:
            return MISSING
        return " / ".join(
            _num(v, ".1f") for v in (c.tokens_per_s, c.baseline_tokens_per_s, c.hf_tokens_per_s)
        )

    throughput = markdown_table(
        ["Method", *datasets], [[row.label, *(tps(row.cells.get(ds)) for ds in datasets)] for row in rows], centered=True
    )
    return (
        "## Speedup over the baseline\n\n" + speed + "\n\n"
        "## Tokens/s (method / baseline / HF generate)\n\n" + throughput + "\n\n"
        "## Energy per generated token (J)\n\n" + _energy(rows, datasets) + "\n"
    )


def _energy(rows: Sequence[Row], datasets: list[str]) -> str:
    """J per generated token per row and dataset (– where not measured, the reasons below), or, where no run
    measured energy, "not measured: <reasons>"."""
    reasons = sorted({c.energy_reason for row in rows for c in row.cells.values()
                      if c.energy_j_per_token is None and c.energy_reason})  # fmt: skip
    if all(c.energy_j_per_token is None for row in rows for c in row.cells.values()):
        return "not measured: " + ("; ".join(reasons) or "no run recorded energy")
    table = markdown_table(
        ["Method", *datasets, "Mean"],
        [[row.label, *(_num(c.energy_j_per_token, ".4g") if (c := row.cells.get(ds)) else MISSING for ds in datasets),
          _num(row.overall("energy_j_per_token"), ".4g")] for row in rows],
        centered=True,
    )  # fmt: skip
    return table + ("\n\n– not measured: " + "; ".join(reasons) if reasons else "")


def bench_table(summaries: Sequence[dict[str, Any]]) -> str:
    """One row per (dataset, dtype, sampling, role) of :func:`~pardec.evaluation.tables.comparison_rows`, the
    runs unaveraged (``pardec.bench speed``'s table.md): the baseline, the peers (transformers' decoders, the
    ``bench.also`` methods) and the run's method, with the completions' perplexity under the target, the task
    metric and the energy per token (– where not measured)."""
    rows = ["| dataset | dtype | sampling | method | exactness | tokens/s | speedup vs ar (median) | "
            "tokens / target forward | exact match vs ar | draft acceptance | draft time share | perplexity | "
            "metric | J/token |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in sorted(summaries, key=lambda s: (s["dataset"], s["dtype"], s["sampling"]["temperature"])):
        sp = s["sampling"]
        how = "greedy" if not sp["temperature"] else f"T={sp['temperature']:g} k={sp['top_k']} p={sp['top_p']:g}"
        where = f"| {s['dataset']} | {s['dtype']} | {how} |"
        metric = f"{s['metric_name']}=" if s.get("metric_name") else ""
        for r in comparison_rows(s):
            base = r["role"] == "baseline"
            speedup = "1.00" if base else f"{_num(r['speedup'])} ({_num(r.get('speedup_median'))})"
            rows.append(f"{where} {r['label']} | {'distribution' if base else r.get('exactness') or MISSING} | "
                        f"{_num(r['tokens_per_s'], '.1f')} | {speedup} | {_num(r['tokens_per_forward'])} | "
                        f"{_num(r['exact_match_rate'])} | {_num(r.get('draft_acceptance'))} | "
                        f"{_num(r.get('draft_time_share'))} | {_num(r.get('perplexity'), '.3f')} | "
                        f"{metric}{_num(r.get('metric'))} | {_num(r.get('energy_j_per_token'), '.3g')} |")
    energy = {s["energy"]["reason"] for s in summaries if s.get("energy") and not s["energy"].get("measured")}
    if energy:
        rows.append(f"\nEnergy not measured: {'; '.join(sorted(energy))}.")
    return "\n".join(rows)


# ----------------------------------------------------------------------------------------- writers


def write_markdown(rows: Sequence[Row], path: Path) -> str:
    """Write report.md; returns its text."""
    text = "# pardec report\n\n" + render_markdown(rows)
    path.write_text(text, encoding="utf-8")
    return text


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _flatten(prefix: str, value: dict[str, Any]) -> dict[str, Any]:
    """Scalars of nested dicts as ``<prefix>.<key>[.<key>...]`` (lists left out)."""
    out: dict[str, Any] = {}
    for k, v in value.items():
        if _scalar(v):
            out[f"{prefix}.{k}"] = v
        elif isinstance(v, dict):
            out.update(_flatten(f"{prefix}.{k}", v))
    return out


def write_csv(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """One row per run: every scalar summary field; dicts (``extras``, ``method_params``, ``sampling``, ``peers``
    ...) flattened to ``<field>.<key>`` (``peers.hf_pld.tokens_per_s``); lists and the accepted histogram left
    out."""
    flat = []
    for run in runs:
        row = {}
        for key, value in run.items():
            if _scalar(value):
                row[key] = value
            elif isinstance(value, dict) and key != "accepted_histogram":
                row.update(_flatten(key, value))
        flat.append(row)
    columns = list(dict.fromkeys(k for row in flat for k in row))
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns)
        writer.writeheader()
        writer.writerows(flat)


def write_report(runs: Sequence[dict[str, Any]], out: Path) -> str:
    """Write report.md, report.csv and the three PNGs into ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    rows = build_table(runs)
    text = write_markdown(rows, out / "report.md")
    write_csv(runs, out / "report.csv")
    plot_speedup(rows, out / "speedup.png")
    plot_accepted_hist(runs, rows, out / "accepted_hist.png", _group)
    plot_speedup_vs_tpf(runs, out / "speedup_vs_tpf.png")
    return text


def main(argv: Sequence[str] | None = None, prog: str | None = "python -m pardec.report runs") -> None:
    """CLI: ``python -m pardec.report runs RUN_DIR_OR_GLOB ... --out DIR``."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run dirs, dirs holding run dirs, or globs (quote them)")
    parser.add_argument("--out", required=True, type=Path, help="directory for report.md/.csv and plots")
    args = parser.parse_args(argv)
    format_warning = warnings.formatwarning
    warnings.formatwarning = lambda message, category, *_args, **_kw: f"{category.__name__}: {message}\n"
    try:
        try:
            runs = load_runs(args.runs)
        except (FileNotFoundError, ValueError) as err:  # a bad argument: usage and message, no traceback
            parser.error(str(err))
        print(write_report(runs, args.out))
    finally:
        warnings.formatwarning = format_warning
    print(f"wrote {len(runs)} runs to {args.out}")

