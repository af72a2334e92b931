"""pardec.report on synthetic run dirs: loading, table values, CSV, plots, CLI."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from pardec.report import MISSING, ReportWarning, build_table, load_runs, main, render_markdown

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("speedup.png", "accepted_hist.png", "speedup_vs_tpf.png")


def summary(method: str, dataset: str, **over: Any) -> dict[str, Any]:
    """A summary.json like the one `python -m evaluate` writes."""
    base = {
        "method": method, "method_params": {}, "baseline": "ar", "dataset": dataset, "model": "smollm2_135m",
        "dtype": "bf16", "n_samples": 2, "skipped": [], "repeats": 1, "max_new_tokens": 16,
        "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": 0},
        "tokens_per_s": 40.0, "tokens_per_s_std": 0.0, "baseline_tokens_per_s": 30.0,
        "baseline_tokens_per_s_std": 0.0, "hf_tokens_per_s": None,
        "speedup": 1.33, "speedup_std": 0.0, "speedup_median": 1.3,
        "tokens_per_forward": 1.8, "baseline_tokens_per_forward": 1.0, "exact_match_rate": 1.0,
        "metric_name": "correct", "metric": 0.5, "baseline_metric": 0.5,
        "perplexity": 5.0, "baseline_perplexity": 5.0, "peak_rss_mb": 100.0,
        "accepted_histogram": {"1": 10, "2": 5}, "extras": {"fast_forward": 1.3}, "exactness": "tokens",
    }  # fmt: skip
    return base | over


def make_run(root: Path, name: str, summ: dict[str, Any], results: str | None = None) -> Path:
    """A run dir with summary.json and results.jsonl (`results` overrides the jsonl text)."""
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text(f"method: {summ['method']}\n")
    (run / "summary.json").write_text(json.dumps(summ))
    if results is None:
        lines = [
            {"id": i, "method": summ["method"], "role": role, "repeat": 0, "n_tokens": 3, "accepted": [2, 1]}
            for i in range(2)
            for role in ("method", "baseline")
        ]
        results = "".join(json.dumps(line) + "\n" for line in lines)
    (run / "results.jsonl").write_text(results)
    return run


@pytest.fixture
def multirun(tmp_path: Path) -> Path:
    """3 methods × 2 datasets: repeats>1 on one, a truncated results.jsonl, a null metric, a missing cell."""
    root = tmp_path / "multirun" / "2026-01-01" / "12-00-00"
    ar = {"speedup": 1.0, "tokens_per_forward": 1.0, "accepted_histogram": {"1": 9}}
    humaneval = {"metric_name": "pass@1", "metric": 0.25, "baseline_metric": 0.25}
    truncated = '{"id": 0, "role": "method", "accepted": [1]}\n{"id": 1, "role": "meth'
    make_run(root, "0", summary("ar", "gsm8k", **ar))
    make_run(root, "1", summary("ar", "humaneval", **ar, **humaneval))
    make_run(root, "2", summary("jacobi", "gsm8k", speedup=1.37, speedup_std=0.05, repeats=3))
    make_run(
        root, "3", summary("jacobi", "humaneval", speedup=1.21, **humaneval) | {"metric": None}, truncated
    )
    make_run(root, "4", summary("pld", "gsm8k", speedup=2.0, exact_match_rate=0.9, hf_tokens_per_s=28.0))
    return root.parent.parent


def test_load_runs_glob_and_recursive(multirun: Path) -> None:
    with pytest.warns(ReportWarning, match="truncated last line"):
        by_glob = load_runs([str(multirun / "2026-*" / "*" / "*")])
    with pytest.warns(ReportWarning):
        by_parent = load_runs([str(multirun)])
    assert len(by_glob) == len(by_parent) == 5
    assert {r["run_dir"] for r in by_glob} == {r["run_dir"] for r in by_parent}
    truncated = next(r for r in by_glob if r["run_dir"].endswith("3"))
    assert truncated["n_results"] == 1


def test_load_runs_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_runs([str(tmp_path / "empty")])
    with pytest.raises(FileNotFoundError, match="no paths match"):
        load_runs([str(tmp_path / "nothing-*")])
    make_run(tmp_path, "bad", summary("jacobi", "gsm8k"))
    (tmp_path / "bad" / "summary.json").write_text("{not json")
    make_run(tmp_path, "good", summary("jacobi", "gsm8k"))
    with pytest.warns(ReportWarning, match="corrupt"):
        runs = load_runs([str(tmp_path / "bad"), str(tmp_path / "good")])
    assert [Path(r["run_dir"]).name for r in runs] == ["good"]


def test_main_reports_a_bad_path_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "crashed").mkdir()
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "crashed"), "--out", str(tmp_path / "out")])
    assert exc.value.code == 2
    assert "crashed holds no summary.json" in capsys.readouterr().err


def test_histogram_falls_back_to_results(tmp_path: Path) -> None:
    make_run(tmp_path, "r", summary("pld", "gsm8k", accepted_histogram=None))
    (run,) = load_runs([str(tmp_path / "r")])
    assert run["accepted_histogram"] == {2: 2, 1: 2}  # method lines only


def table(md: str, n: int = 0) -> dict[str, list[str]]:
    """The n-th markdown table of `md` as {row label: cells}, header included under "Method"."""
    tables = [block for block in md.split("\n\n") if block.startswith("| Method")]
    rows = [line.strip("| ").split(" | ") for line in tables[n].splitlines() if not line.startswith("|-")]
    return {row[0]: row[1:] for row in rows}


def test_table_values(multirun: Path) -> None:
    with pytest.warns(ReportWarning):
        rows = build_table(load_runs([str(multirun)]))
    assert [r.label for r in rows] == ["ar", "jacobi", "pld"]  # one model/dtype: no tags in labels
    md = render_markdown(rows)
    speed, tps = table(md, 0), table(md, 1)
    assert speed["Method"] == ["gsm8k", "humaneval", "Mean speedup", "Tokens/forward", "Exactness", "Exact match",
                               "Draft acceptance", "Quality", "Perplexity"]  # fmt: skip
    assert speed["ar"] == ["1.00×", "1.00×", "1.00×", "1.00", "reference", MISSING, MISSING,
                           "correct 0.500 · pass@1 0.250", "5.00"]  # fmt: skip
    assert speed["jacobi"] == ["1.37× ± 0.05", "1.21×", "1.29×", "1.80", "tokens", "100.0%", MISSING,
                               "correct 0.500", "5.00"]  # fmt: skip
    assert speed["pld"] == ["2.00×", MISSING, "2.00×", "1.80", "tokens", "90.0%", MISSING, "correct 0.500", "5.00"]
    assert tps["pld"] == ["40.0 / 30.0 / 28.0", MISSING]
    assert tps["ar"] == ["30.0 / 30.0 / 28.0", "30.0 / 30.0 / –"]


def test_labels_tag_model_and_dtype_when_they_vary(tmp_path: Path) -> None:
    make_run(tmp_path, "a", summary("jacobi", "gsm8k", dtype="bf16"))
    make_run(tmp_path, "b", summary("jacobi", "gsm8k", dtype="fp32", speedup=1.1))
    rows = build_table(load_runs([str(tmp_path)]))
    assert [r.label for r in rows] == ["ar (bf16)", "jacobi (bf16)", "ar (fp32)", "jacobi (fp32)"]
    assert rows[3].cells["gsm8k"].speedup == pytest.approx(1.1)


def test_method_params_split_rows_when_they_vary(tmp_path: Path) -> None:
    make_run(tmp_path, "a", summary("jacobi", "gsm8k", method_params={"window": 8}))
    make_run(tmp_path, "b", summary("jacobi", "gsm8k", method_params={"window": 16}, speedup=1.5))
    make_run(tmp_path, "c", summary("pld", "gsm8k", method_params={"ngram": 3}))
    rows = build_table(load_runs([str(tmp_path)]))
    assert [r.label for r in rows] == ["ar", "jacobi (window=16)", "jacobi (window=8)", "pld"]


def test_runs_differing_in_draft_sampling_or_max_new_tokens_are_never_averaged(tmp_path: Path) -> None:
    import warnings

    sampled = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 0}
    make_run(tmp_path, "a", summary("sps", "gsm8k", draft="d1", speedup=1.5))
    make_run(tmp_path, "b", summary("sps", "gsm8k", draft="d2", speedup=1.1))
    make_run(tmp_path, "c", summary("sps", "gsm8k", draft="d1", max_new_tokens=256, speedup=1.9))
    make_run(tmp_path, "d", summary("sps", "gsm8k", draft="d1", sampling=sampled, speedup=1.2))
    make_run(tmp_path, "e", summary("sps", "gsm8k", draft="local", draft_path="/x/final", speedup=1.3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReportWarning)  # one run per row and dataset: nothing averaged
        rows = build_table(load_runs([str(tmp_path)]))
    labels = {r.label: r.cells["gsm8k"].speedup for r in rows}
    assert labels == {
        "ar (max_new_tokens=16, greedy)": 1.0,
        "sps (draft=d1, max_new_tokens=16, greedy)": pytest.approx(1.5),
        "sps (draft=d2, max_new_tokens=16, greedy)": pytest.approx(1.1),
        "sps (draft=local /x/final, max_new_tokens=16, greedy)": pytest.approx(1.3),
        "ar (max_new_tokens=16, temperature=0.7, top_k=0, top_p=0.9)": 1.0,
        "sps (draft=d1, max_new_tokens=16, temperature=0.7, top_k=0, top_p=0.9)": pytest.approx(1.2),
        "ar (max_new_tokens=256, greedy)": 1.0,
        "sps (draft=d1, max_new_tokens=256, greedy)": pytest.approx(1.9),
    }
    assert "sps (draft=d1, max_new_tokens=256, greedy)" in render_markdown(rows)


def test_runs_differing_only_in_the_sampling_seed_are_repeats(tmp_path: Path) -> None:
    for i, speedup in enumerate((1.2, 1.4)):
        sampling = {"temperature": 0.7, "top_k": 0, "top_p": 1.0, "seed": i}
        make_run(tmp_path, str(i), summary("jacobi", "gsm8k", sampling=sampling, speedup=speedup))
    with pytest.warns(ReportWarning, match="2 runs"):
        rows = build_table(load_runs([str(tmp_path)]))
    assert [r.label for r in rows] == ["ar", "jacobi"] and rows[1].cells["gsm8k"].speedup == pytest.approx(1.3)


def test_repeated_runs_of_a_cell_are_averaged(tmp_path: Path) -> None:
    make_run(tmp_path, "a", summary("jacobi", "gsm8k", speedup=1.2))
    make_run(tmp_path, "b", summary("jacobi", "gsm8k", speedup=1.4))
    with pytest.warns(ReportWarning, match="2 runs"):
        rows = build_table(load_runs([str(tmp_path)]))
    cell = rows[1].cells["gsm8k"]
    assert (cell.speedup, cell.speedup_std) == (pytest.approx(1.3), pytest.approx(0.1414, abs=1e-4))


def test_main_end_to_end(multirun: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report"
    with pytest.warns(ReportWarning):
        main([str(multirun / "2026-*" / "*" / "*"), "--out", str(out)])
    printed = capsys.readouterr().out
    assert "| jacobi | 1.37× ± 0.05 |" in printed
    assert (out / "report.md").read_text().count("| pld |") == 2  # speedup and tokens/s tables
    with (out / "report.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 5
    columns = {"method", "dataset", "speedup", "peak_rss_mb", "extras.fast_forward", "sampling.temperature"}
    assert columns | {"run_dir", "n_results", "n_skipped"} <= rows[0].keys()
    assert not any(c.startswith(("accepted_histogram", "skipped")) for c in rows[0])
    jacobi_he = next(r for r in rows if r["method"] == "jacobi" and r["dataset"] == "humaneval")
    assert jacobi_he["metric"] == "" and float(jacobi_he["speedup"]) == 1.21
    for name in PLOTS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("method", ["jacobi", "ar"])  # an ar-only report has nothing to plot: "no data"
def test_plots_with_a_single_run(tmp_path: Path, method: str) -> None:
    make_run(tmp_path, "only", summary(method, "gsm8k"))
    main([str(tmp_path / "only"), "--out", str(tmp_path / "out")])
    for name in PLOTS:
        assert (tmp_path / "out" / name).read_bytes()[:8] == PNG_MAGIC


def test_peers_and_draft_rows_and_csv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """transformers' decoders (``peers``) get their own rows, a draft tags its rows, CSV flattens peers,
    errored prompts are counted and left out of the histogram."""
    peer = {"exactness": "tokens", "speedup_std": None, "draft_forwards": 0, "draft_acceptance": None}
    peers = {
        "hf": peer | {"method": "hf_generate", "tokens_per_s": 29.0, "speedup": 0.97, "tokens_per_forward": 1.0,
                      "exact_match_rate": 1.0},
        "hf_pld": peer | {"method": "hf_pld", "tokens_per_s": 45.0, "speedup": 1.5, "tokens_per_forward": 2.1,
                          "exact_match_rate": 1.0, "draft_acceptance": 0.4},
        "hf_assisted": peer | {"method": "hf_assisted", "tokens_per_s": 36.0, "speedup": 1.2, "draft_forwards": 90,
                               "tokens_per_forward": 2.5, "exact_match_rate": 0.5, "draft_acceptance": 0.6},
    }  # fmt: skip
    results = "".join(json.dumps(x) + "\n" for x in [
        {"id": 0, "role": "method", "repeat": 0, "accepted": [3, 1]},
        {"id": 1, "role": "method", "repeat": 0, "error": "model 'x' produced non-finite logits (NaN/inf)"},
        {"id": 0, "role": "baseline", "repeat": 0, "accepted": [1, 1]},
    ])  # fmt: skip
    make_run(tmp_path, "a", summary("sps", "gsm8k", draft="smollm2_distilled", exactness="distribution",
                                    draft_acceptance=0.7, peers=peers, accepted_histogram=None), results)
    make_run(tmp_path, "b", summary("pld", "gsm8k", peers={"hf": peers["hf"]}))
    runs = load_runs([str(tmp_path)])
    a = next(r for r in runs if r["method"] == "sps")
    assert (a["n_results"], a["n_errors"]) == (2, 1) and a["accepted_histogram"] == {3: 1, 1: 1}
    rows = build_table(runs)  # hf_generate is in both runs: averaged without a warning
    assert [r.label for r in rows] == ["ar", "hf_assisted", "hf_generate", "hf_pld", "pld", "sps"]
    assert rows[-1].params == rows[1].params == "draft=smollm2_distilled"  # a label shows it only where it varies
    assert [r.is_peer for r in rows] == [False, True, True, True, False, False]
    speed = table(render_markdown(rows))
    assert speed["hf_pld"] == ["1.50×", "1.50×", "2.10", "tokens", "100.0%", "40.0%", MISSING, MISSING]
    assert speed["sps"][3:6] == ["distribution", "100.0%", "70.0%"]
    assert speed["hf_generate"][:2] == ["0.97×", "0.97×"]
    main([str(tmp_path), "--out", str(tmp_path / "out")])
    capsys.readouterr()
    with (tmp_path / "out" / "report.csv").open() as fh:
        sps = next(r for r in csv.DictReader(fh) if r["method"] == "sps")
    assert float(sps["peers.hf_pld.tokens_per_s"]) == 45.0 and sps["peers.hf_assisted.method"] == "hf_assisted"
    assert sps["n_errors"] == "1" and sps["draft"] == "smollm2_distilled"


def test_bench_also_roles_keep_their_parameters_in_the_row(tmp_path: Path) -> None:
    """A ``bench.also`` role (e.g. adaptive sps) is its own row, named by its parameters, not merged into the
    run's method."""
    also = {"method": "sps", "params": {"adaptive": True}, "exactness": "distribution", "speedup_std": None,
            "draft_forwards": 50, "draft_acceptance": 0.3, "tokens_per_s": 20.0, "speedup": 0.9,
            "tokens_per_forward": 1.7, "exact_match_rate": 1.0}
    make_run(tmp_path, "a", summary("sps", "gsm8k", draft="smollm2_distilled", exactness="distribution",
                                    peers={"also:sps:adaptive=true": also | {"perplexity": 4.5, "metric": 0.75}}))
    rows = build_table(load_runs([str(tmp_path)]))
    sps = [r for r in rows if r.method == "sps"]
    assert sorted(r.params for r in sps) == ["adaptive=True, draft=smollm2_distilled", "draft=smollm2_distilled"]
    adaptive = next(r for r in sps if "adaptive" in r.params).cells["gsm8k"]
    assert (adaptive.perplexity, adaptive.metric, adaptive.metric_name) == (4.5, 0.75, "correct")
