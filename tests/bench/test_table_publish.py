"""``python -m pardec.bench table --publish``: the table's result file, raw records, figures and page written under
docs/, its markers rendered, a publication under an earlier name replaced (the README's links follow), bad names
refused before anything is written."""

from __future__ import annotations

import gzip
import json

import pytest

from pardec.bench import table as T
from pardec.bench import table_publish as P

CELL = {"method": "pld", "exactness": "tokens", "n": 2, "speedup_mean": 2.0, "speedup_ci95": [1.5, 2.5],
        "speedup_median": 2.0, "tokens_per_forward": 2.0, "exact_match_rate": 1.0, "flagged": False, "metric": 0.25,
        "ended_share": 0.0, "loop_share": 0.0, "busy": 0}


def _made_table(out):
    """A table directory with one finished run (gsm8k) and one pending (spider), as bench table leaves it."""
    run = out / "runs" / "gsm8k"
    run.mkdir(parents=True)
    (run / "summary.json").write_text('{"baseline": "ar"}\n')
    (run / "results.jsonl").write_text('{"id": 0, "role": "baseline"}\n')
    (out / "runs" / "spider").mkdir()
    (out / "runs" / "spider" / "run.json").write_text("{}")
    (out / "plots").mkdir()
    (out / "plots" / "gsm8k.png").write_bytes(b"png")
    return {"date": "2026-11-30", "commit": "abc", "host": {"cpu": "Some CPU", "cores": 2, "torch": "2.13"},
            "dtype": "fp32", "n": 2, "max_new_tokens": 8, "pending": ["spider"],
            "benchmarks": {"gsm8k": {"metric": "correct", "methods": {"pld": CELL}}}}


def test_publish_writes_the_result_its_raw_records_figures_and_page_and_replaces_an_earlier_name(tmp_path):
    out, root = tmp_path / "table", tmp_path / "repo"
    table = _made_table(out)
    docs = root / "docs"
    (docs / "results" / "table_old").mkdir(parents=True)
    (docs / "results" / "table_old.json").write_text(json.dumps(table))
    (docs / "img").mkdir()
    (docs / "img" / "table_old_gsm8k.png").write_bytes(b"old")
    (docs / "table.md").write_text("# t\n\n<!-- table: results/table_old.json#gsm8k -->\n<!-- /table -->\n")
    (root / "README.md").write_text("Board:\n\n<!-- table: results/table_old.json#speed -->\n<!-- /table -->\n\n"
                                    "![fig](docs/img/table_old_gsm8k.png)\n")
    written = P.publish(out, table, root, "table_2026-11-29")
    assert not (docs / "results" / "table_old.json").exists() and not (docs / "results" / "table_old").exists()
    assert not (docs / "img" / "table_old_gsm8k.png").exists()
    assert json.loads((docs / "results" / "table_2026-11-29.json").read_text())["pending"] == ["spider"]
    raw = docs / "results" / "table_2026-11-29"
    assert sorted(p.name for p in raw.iterdir()) == ["gsm8k.results.jsonl.gz", "gsm8k.summary.json.gz"]
    assert gzip.decompress((raw / "gsm8k.results.jsonl.gz").read_bytes()) == b'{"id": 0, "role": "baseline"}\n'
    first = (raw / "gsm8k.results.jsonl.gz").read_bytes()
    assert (docs / "img" / "table_2026-11-29_gsm8k.png").read_bytes() == b"png"
    page = (docs / "table.md").read_text()
    assert "<!-- table: results/table_2026-11-29.json#gsm8k -->\n| method |" in page  # rendered
    assert "| pld | 2.00 (1.50–2.50) |" in page and "img/table_2026-11-29_gsm8k.png" in page
    assert "Host: Some CPU, 2 cores, torch 2.13" in page and "## Not run yet" in page and "`spider`" in page
    readme = (root / "README.md").read_text()
    assert "table_old" not in readme and "docs/img/table_2026-11-29_gsm8k.png" in readme
    assert "| method | gsm8k |\n|---|---|\n| pld | 2.00 (1.50–2.50) |" in readme
    assert root / "README.md" in written and docs / "table.md" in written
    P.publish(out, table, root, "table_2026-11-29")  # published again: the same bytes, nothing left of before
    assert (raw / "gsm8k.results.jsonl.gz").read_bytes() == first
    assert P.published_name(docs / "table.md") == "table_2026-11-29"


def test_a_cell_timed_on_a_busy_host_is_published_only_when_allowed(tmp_path):
    out, root = tmp_path / "table", tmp_path / "repo"
    table = _made_table(out)
    table["benchmarks"]["gsm8k"]["methods"]["pld"] = {**CELL, "busy": 2}
    with pytest.raises(P.PublishError, match=r"1 cell\(s\) hold prompts timed .*: gsm8k/pld \(2 busy\); .*--allow-busy"):
        P.publish(out, table, root, "table_x")
    assert not (root / "docs").exists()  # refused before anything is written
    P.publish(out, table, root, "table_x", allow_busy=True)
    assert "| pld | 2.00 (1.50–2.50) | 2.00 | 2.00 | 1.00 | 0.250 | 0.00 | 0.00 | 2 |" in (root / "docs" / "table.md").read_text()
    assert json.loads((root / "docs" / "results" / "table_x.json").read_text())["benchmarks"]["gsm8k"]["methods"][
        "pld"]["busy"] == 2


def test_nothing_is_published_before_a_run_finished(tmp_path):
    with pytest.raises(P.PublishError, match="no run has finished yet"):
        P.publish(tmp_path, {"benchmarks": {}, "pending": ["gsm8k"]}, tmp_path, "table_x")
    assert not (tmp_path / "docs").exists()


def test_the_publication_is_named_by_the_date_the_table_started(tmp_path):
    T.check_identity(tmp_path, {"dtype": "fp32"})
    kept = json.loads((tmp_path / "table_run.json").read_text())
    assert T.started(tmp_path) == kept["started"]
    T.check_identity(tmp_path, {"dtype": "fp32"})  # the start date is not part of the identity
    older = tmp_path / "older"
    (older / "runs" / "gsm8k").mkdir(parents=True)
    (older / "table_run.json").write_text('{"dtype": "fp32"}')
    (older / "runs" / "gsm8k" / "run.json").write_text("{}")
    import os

    os.utime(older / "runs" / "gsm8k" / "run.json", (1795953600, 1795953600))  # 2026-11-29 12:00 UTC
    assert T.started(older) == "2026-11-29"


@pytest.mark.parametrize("args, want", [(["--name", "board"], "--name 'board' is not a publication name"),
                                        (["--page", "../README.md"], "--page '../README.md' is not a page")])
def test_bad_publication_arguments_are_refused_before_anything_runs(args, want, capsys, tmp_path):
    with pytest.raises(SystemExit):
        T.main(["--publish", "--out", str(tmp_path), *args])
    assert want in capsys.readouterr().err and not any(tmp_path.iterdir())


def test_the_table_goes_to_wandb_as_one_run_with_a_table_per_benchmark(tmp_path, monkeypatch):
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}.items():
        monkeypatch.setenv(k, v)
    table = _made_table(tmp_path / "table")
    rows = P.wandb_rows(table)
    assert sorted(rows) == ["all", "gsm8k"] and rows["all"] == rows["gsm8k"]
    pld = rows["gsm8k"][0]
    assert pld["method"] == "pld" and pld["speedup_ci95_low"] == 1.5 and pld["metric_name"] == "correct"
    P.log_wandb(table, tmp_path / "table")
    [run] = (tmp_path / "table" / "wandb").glob("offline-run-*")
    tables = sorted(p.name.split("_")[0] for p in run.glob("files/media/table/table/*.table.json"))
    assert tables == ["all", "gsm8k"], sorted(str(p.relative_to(run)) for p in run.rglob("*.json"))
    data = json.loads(next(run.glob("files/media/table/table/gsm8k_*.table.json")).read_text())
    assert "speedup_mean" in data["columns"] and "pld" in data["data"][0]
