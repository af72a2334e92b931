"""``python -m pardec.bench table --publish``: a table made with :mod:`pardec.bench.table` put on the project's pages.

Under the publication's name (``table_<date the table started>``, or ``--name``) it writes, in the docs directory:
``results/<name>.json`` (the table: command, commits, host, dtype, date, n, every cell), ``results/<name>/<run>.
{results.jsonl,summary.json}.gz`` (every finished run's raw records and summary, gzip without a timestamp, so an
unchanged run rewrites the same bytes), ``img/<name>_<benchmark>.png`` (the figures) and the page (``table.md``,
or ``--page``): per finished benchmark its table marker and figure, and the runs not finished yet. The page's and
the README's table markers are then rendered from the result file (:func:`pardec.report.docs.rewrite`). A table
published before under another name (the page names it) is replaced: its files go, and the README's links to them
follow the new name. Nothing is published from a table without a finished run."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from pathlib import Path

from pardec.report.docs import markdown_files, rewrite
from pardec.tracking import Tracker

INTRO = """\
`python -m pardec.bench table` ([src/pardec/bench/table.py](../src/pardec/bench/table.py)) on one host: every
decoder pardec has (or those its `--methods` names), the trained ones with the [zoo](zoo.md)'s drafters, one `evaluate` run per benchmark with
`ar` the baseline and every other method a role in it (`bench.also`; transformers' `hf`, `hf_pld`, `hf_assisted`
beside it), interleaved per prompt after a warm-up, greedy, the same prompts for all. `jacobi@cllm` and
`sdsat@sdsat` decode the zoo's fine-tuned models in runs of their own, against `ar` on the same model (`ar@cllm`,
`ar@sdsat`). The table is made in parts and continues where it stopped; its result file lists the runs not
finished yet under `pending`, the commit each run ran at under `commits`, and the zoo artifacts it decoded with
(each by its manifest's sha256) under `zoo`. `python -m pardec.bench table --publish` writes this page.

Columns: speed against `ar` (the mean of the per-prompt ratios with its bootstrap interval, the middle ninety-five
percent; the median), the speed against the run's fastest transformers peer prompt by prompt (`× hf_pld`: the mean
of the peer's time over the method's on each prompt, with its interval; means against `ar` do not order two
methods, since a few looping prompts can weigh one up), tokens per target forward, the exact-match rate against `ar`
(a lossless method whose outputs differ is flagged ⚠), the task metric and, where the outputs are not the base
model's `ar`'s (a lossy method, a fine-tuned model), its per-prompt difference from that `ar`'s with its interval
(⚠: the interval lies wholly below minus the method's paper's stated tolerance, `Decoder.quality_tolerance`), the
share of answers that ended before the token limit and of those that loop (a token repeated ten times in a row), and the prompts timed while another process competed for the CPU
(busy)."""

#: the name a page gives its publication: the first table marker's result file
_PUBLISHED = re.compile(r"<!-- table: results/(?P<name>[^ /#]+)\.json#")


class PublishError(ValueError):
    """A table that cannot be published (one line)."""


def published_name(page: Path) -> str | None:
    """The name of the table a page shows now (None: the page does not exist or shows none)."""
    m = _PUBLISHED.search(page.read_text()) if page.is_file() else None
    return m["name"] if m else None


def _gzip(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open("rb") as f, dst.open("wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as z:
        shutil.copyfileobj(f, z)


def page_text(table: dict, name: str, title: str) -> str:
    """The page: title, what the table is, its host and files, per finished benchmark its marker and figure, and
    the runs not finished yet."""
    host = table.get("host") or {}
    lines = [f"# {title}", "", INTRO, "",
             f"Host: {host.get('cpu')}, {host.get('cores')} cores, torch {host.get('torch')}; dtype {table.get('dtype')} "
             f"(`{table.get('command')}`); the run's date, prompts, flags and commits are in "
             f"[results/{name}.json](results/{name}.json); the raw records (every prompt's tokens and timings, each "
             f"run's summary) in [results/{name}/](results/{name}/)."]
    for bench in table["benchmarks"]:
        lines += ["", f"## {bench}", "", f"<!-- table: results/{name}.json#{bench} -->", "<!-- /table -->", "",
                  f"![{bench}: speed against ar over tokens per target forward, one run](img/{name}_{bench}.png)"]
    pending = table.get("pending") or []
    if pending:
        lines += ["", "## Not run yet", "", "The table continues with `python -m pardec.bench table` on the same host: "
                  + ", ".join(f"`{p}`" for p in pending) + "."]
    return "\n".join(lines) + "\n"


def _remove(docs: Path, name: str) -> None:
    (docs / "results" / f"{name}.json").unlink(missing_ok=True)
    shutil.rmtree(docs / "results" / name, ignore_errors=True)
    for png in (docs / "img").glob(f"{name}_*.png"):
        png.unlink()


def busy_cells(table: dict) -> list[str]:
    """``<benchmark>/<method> (<n> busy)`` of every cell with prompts timed while another process competed."""
    return [f"{bench}/{label} ({c['busy']} busy)" for bench, b in table["benchmarks"].items()
            for label, c in b["methods"].items() if c.get("busy")]


def publish(out: Path, table: dict, root: Path, name: str, page: str = "table.md",
            title: str = "The table: every decoder on every benchmark, one run per benchmark",
            allow_busy: bool = False) -> list[Path]:
    """Publish the table of ``out`` (its ``table.json`` already aggregated into ``table``, its figures in
    ``out/plots``) under ``root/docs``; returns the files written. The README's links to a table the page showed
    before under another name follow the new name. A cell with prompts timed on a busy host is refused unless
    ``allow_busy`` (it is then published with its busy count)."""
    if not table.get("benchmarks"):
        raise PublishError(f"nothing to publish from {out}: no run has finished yet")
    busy = busy_cells(table)
    if busy and not allow_busy:
        raise PublishError(f"{len(busy)} cell(s) hold prompts timed while another process competed for the CPU: "
                           f"{', '.join(busy[:5])}{' ...' if len(busy) > 5 else ''}; rerun their benchmark in a new "
                           f"table on a quiet host, or pass --allow-busy to publish them with their busy count")
    docs = root / "docs"
    page_file = docs / page
    before = published_name(page_file)
    if before and before != name:
        _remove(docs, before)
    _remove(docs, name)
    written = [docs / "results" / f"{name}.json"]
    written[0].parent.mkdir(parents=True, exist_ok=True)
    written[0].write_text(json.dumps(table, indent=1) + "\n")
    finished = [run for run in (out / "runs").iterdir() if (run / "summary.json").is_file()] \
        if (out / "runs").is_dir() else []
    for run in sorted(finished):
        for part in ("results.jsonl", "summary.json"):
            dst = docs / "results" / name / f"{run.name}.{part}.gz"
            _gzip(run / part, dst)
            written.append(dst)
    for bench in table["benchmarks"]:
        src = out / "plots" / f"{bench}.png"
        if src.is_file():
            dst = docs / "img" / f"{name}_{bench}.png"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst)
            written.append(dst)
    page_file.write_text(page_text(table, name, title))
    written.append(page_file)
    readme = root / "README.md"
    if before and before != name and readme.is_file():
        readme.write_text(re.sub(rf"\b{re.escape(before)}(?=\.json|/|_)", name, readme.read_text()))
    written += [f for f in markdown_files(root) if rewrite(f, root) and f != page_file]
    return written


def wandb_rows(table: dict) -> dict[str, list[dict]]:
    """The table as W&B tables: per benchmark a row per method (its cell's numbers; ``metric_name`` names the task
    metric), and ``all``: every benchmark's rows together, for W&B's own grouping and plots."""
    out: dict[str, list[dict]] = {}
    for bench, b in table["benchmarks"].items():
        rows = []
        for label, c in b["methods"].items():
            ci = c.get("speedup_ci95") or [None, None]
            rows.append({"benchmark": bench, "method": label, "exactness": c.get("exactness"), "n": c.get("n"),
                         "speedup_mean": c.get("speedup_mean"), "speedup_ci95_low": ci[0], "speedup_ci95_high": ci[1],
                         "speedup_median": c.get("speedup_median"), "tokens_per_forward": c.get("tokens_per_forward"),
                         "exact_match_rate": c.get("exact_match_rate"), "flagged": c.get("flagged"),
                         "metric_name": b.get("metric"), "metric": c.get("metric"), "ended_share": c.get("ended_share"),
                         "loop_share": c.get("loop_share"), "busy": c.get("busy")})
        out[bench] = rows
    out["all"] = [r for rows in list(out.values()) for r in rows]
    return out


def log_wandb(table: dict, run_dir: Path, logger: dict | None = None) -> None:
    """One W&B run (``logger``: the logger config; default offline, or as ``WANDB_MODE`` says) holding the table: its settings as the run's
    config, a W&B table per benchmark and ``all``."""
    config = {k: table.get(k) for k in ("command", "commit", "host", "dtype", "n", "max_new_tokens", "date", "zoo")}
    logger = logger or {"name": "wandb", "mode": os.environ.get("WANDB_MODE", "offline")}
    with Tracker(logger, run_dir, config, prefix="table",
                 name=f"table {table.get('dtype')} {table.get('date')}") as t:
        for key, rows in wandb_rows(table).items():
            t.log_table(key, rows)
        t.log_summary({"pending": ", ".join(table.get("pending") or []) or None})
