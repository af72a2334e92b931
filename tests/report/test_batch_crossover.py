"""docs/batch.md's overview of every published batch run (pardec.report.batch): one row per result file, newest
first, each method's crossover, batched ar's gain at the run's largest batch, and the methods whose rows differ."""

from __future__ import annotations

import json

import pytest

from pardec.report.batch import host_class, render_crossover
from pardec.report.docs import rewrite
from pardec.report.markdown import DocsError


def _run(date, dataset, dtype, cells, crossover, host=None, **ident):
    return {"date": date, "crossover": crossover, "cells": cells,
            "identity": {"dataset": dataset, "dtype": dtype, "n": 8, "max_new_tokens": 64,
                         "host": host or {"cpu": "AMD EPYC", "flags": ["avx2", "fma"]}, **ident}}


def _cell(method, b, vs_at_1=None, em=1.0):
    return {"method": method, "batch_size": b, "vs_ar_at_1": vs_at_1, "exact_match": em}


def test_one_row_per_run_newest_first_with_crossover_gain_and_differing_rows(tmp_path):
    (tmp_path / "results").mkdir()
    old = _run("2026-11-30", "gsm8k", "fp32", [_cell("ar", 1, 1.0), _cell("ar", 8, 3.1), _cell("pld", 1),
                                               _cell("mjsd:num_beams=4", 8, em=0.0)],
               {"pld": 2, "mjsd:num_beams=4": None})
    new = _run("2026-12-02", "cnn_dm", "int8", [_cell("ar", 1, 1.0), _cell("ar", 4, 2.5),
                                                _cell("eagle3:path=zoo:eagle3:mode=chain", 4)],
               {"eagle3:path=zoo:eagle3:mode=chain": 1}, attention="invariant",
               host={"cpu": "AMD EPYC", "flags": ["avx2", "avx512f"]})
    (tmp_path / "results" / "batch_a.json").write_text(json.dumps(old))
    (tmp_path / "results" / "batch_b.json").write_text(json.dumps(new))
    (tmp_path / "results" / "table_x.json").write_text("{}")  # not a batch run: not read
    rows = [r for r in render_crossover(tmp_path / "batch.md", tmp_path).splitlines()[2:] if r]
    assert rows == [
        "| [2026-12-02](results/batch_b.json) | cnn_dm | int8 (invariant attention) | 8 × 64 | AMD EPYC, AVX-512 | "
        "1, 4 | 2.50× at 4 | eagle3 mode=chain: 1 | none |",
        "| [2026-11-30](results/batch_a.json) | gsm8k | fp32 | 8 × 64 | AMD EPYC, AVX2 only | 1, 8 | 3.10× at 8 | "
        "pld: 2, mjsd num_beams=4: never (up to 8) | mjsd num_beams=4 |"]


def test_the_block_is_filled_by_the_docs_rewrite_and_a_file_that_is_no_batch_run_is_refused(tmp_path):
    docs = tmp_path / "docs"
    (docs / "results").mkdir(parents=True)
    (docs / "results" / "batch_a.json").write_text(json.dumps(_run("2026-12-01", "gsm8k", "fp32", [_cell("ar", 1, 1.0)],
                                                                   {})))
    page = docs / "batch.md"
    page.write_text("x\n<!-- batch-crossover -->\nstale\n<!-- /batch-crossover -->\ny\n")
    assert rewrite(page, tmp_path)
    text = page.read_text()
    assert "stale" not in text and "[2026-12-01](results/batch_a.json)" in text and text.endswith("y\n")
    (docs / "results" / "batch_b.json").write_text('{"title": "not a run"}')
    with pytest.raises(DocsError, match="batch_b.json: not a batch run"):
        rewrite(page, tmp_path)


@pytest.mark.parametrize("flags, vec", [(["avx2", "fma"], "AVX2 only"), (["avx2", "avx512f"], "AVX-512"),
                                        (["avx512f", "amx_tile"], "AMX")])
def test_host_class(flags, vec):
    assert host_class({"cpu": "X", "flags": flags}) == f"X, {vec}"
