"""``python -m pardec.bench table``: which methods a zoo allows, the runs it makes, the cells of a run (per-prompt
speed against ar with a bootstrap interval, exactness flagged, ended and looping shares, busy count), a refused
continuation with other settings, and (slow) a tiny end-to-end table that a rerun continues instead of redoing."""

from __future__ import annotations

import argparse
import json

import pytest

from pardec.bench import table as T


def test_the_plan_leaves_out_what_the_zoo_lacks_and_refuses_an_unknown_method():
    shared, own, notes = T.plan("all", has=lambda name: name in {"draft", "eagle3"})
    assert "sps" in shared and "eagle3:path=zoo:eagle3:mode=chain" in shared and "pld" in shared
    assert "sps:confidence_threshold=0.4" in shared  # the CPU-sized role beside the paper's gamma
    assert not any(m.startswith("dflash") for m in shared) and own == []
    assert any("the zoo has no 'dflash' (make zoo ZOO_NAMES=dflash)" in n for n in notes)
    shared, own, _ = T.plan("pld,jacobi@cllm", has=lambda name: True)
    assert shared == ["pld"] and own == [("jacobi", "cllm")]
    with pytest.raises(T.TableError, match=r"--methods 'pdl' is not one of the table's: .*pld"):
        T.plan("pdl", has=lambda name: True)


def test_one_run_per_benchmark_and_one_per_own_model():
    a = argparse.Namespace(benchmarks="gsm8k,humaneval", n=3, max_new_tokens=8, dtype="fp32", threads=1,
                           model="smollm2_135m", extra=["bench.warmup=0"])
    runs = T.commands(a, ["pld", "sps"], [("jacobi", "cllm")])
    assert [name for name, _ in runs] == ["gsm8k", "gsm8k@cllm", "humaneval", "humaneval@cllm"]
    args = dict(runs)["gsm8k"]
    assert 'bench.also=["pld","sps"]' in args and "draft.path=zoo:draft" in args and "bench.include_hf=true" in args
    assert "dataset.path=${paths.data_dir}/gsm8k/test.jsonl" in args and args[-1] == "bench.warmup=0"
    own = dict(runs)["humaneval@cllm"]
    assert "model.path=zoo:cllm" in own and 'bench.also=["jacobi"]' in own and "draft.path=zoo:draft" not in own
    assert "perplexity.enabled=false" in own and "perplexity.enabled=false" in args
    judged = dict(T.commands(argparse.Namespace(**{**vars(a), "benchmarks": "mt_bench"}), ["pld"], [("jacobi", "cllm")]))
    assert "perplexity.enabled=false" in judged["mt_bench"]  # lossless roles: ar's outputs, no scoring
    assert {"perplexity.enabled=true", "perplexity.model=smollm2_135m"} <= set(judged["mt_bench@cllm"])  # no judge here


def _rec(id_, role, wall, tokens, forwards, equal=None, busy=False):
    return {"id": id_, "role": role, "repeat": 0, "wall_s": wall, "n_tokens": len(tokens), "turn_tokens": [tokens],
            "tokens": tokens, "target_forwards": forwards, "equal_to_baseline": equal, "busy": busy, "score": {}}


def test_cells_hold_per_prompt_speed_with_an_interval_and_flag_an_inexact_lossless_method():
    loop = [7] * 12
    records = [_rec("a", "baseline", 2.0, list(range(8)), 8), _rec("b", "baseline", 4.0, loop, 12),
               _rec("a", "also:pld", 1.0, list(range(8)), 4, True), _rec("b", "also:pld", 1.0, loop, 3, True, True),
               _rec("a", "also:sps", 4.0, list(range(8)), 8, False), _rec("b", "also:sps", 4.0, loop, 12, True)]
    summary = {"baseline": "ar", "baseline_metric": 0.5, "peers": {
        "also:pld": {"method": "pld", "exactness": "tokens", "exact_match_rate": 1.0, "metric": 0.5},
        "also:sps": {"method": "sps", "exactness": "distribution", "exact_match_rate": 0.5, "metric": 0.0}}}
    cells = T.cells(records, summary, max_new_tokens=10)
    pld = cells["pld"]
    assert pld["speedup_mean"] == pytest.approx(3.0) and pld["speedup_median"] == pytest.approx(3.0)
    lo, hi = pld["speedup_ci95"]
    assert 2.0 <= lo <= 3.0 <= hi <= 4.0
    assert pld["tokens_per_forward"] == pytest.approx(20 / 7) and pld["busy"] == 1 and not pld["flagged"]
    assert pld["ended_share"] == 0.5 and pld["loop_share"] == 0.5  # 8 < 10 tokens ended; 12 sevens loop
    assert cells["sps"]["flagged"] and cells["sps"]["speedup_mean"] == pytest.approx(0.75)
    assert cells["ar"]["speedup_mean"] == 1.0 and cells["ar"]["metric"] == 0.5
    assert T.bootstrap_ci([1.0]) is None
    sampled = T.cells(records, summary, max_new_tokens=10, sampled=True)  # draws: no exact match, no flag
    assert sampled["sps"]["exact_match_rate"] is None and not sampled["sps"]["flagged"]
    assert sampled["pld"]["speedup_mean"] == pytest.approx(3.0)


def test_each_method_is_compared_with_the_fastest_transformers_peer_prompt_by_prompt(tmp_path):
    from pardec.report import docs

    # against ar, pld and hf_pld tie (means 2.0); prompt by prompt pld is the faster: b's loop weighs hf_pld's mean up
    records = [_rec("a", "baseline", 10.0, [1], 1), _rec("b", "baseline", 10.0, [1], 1),
               _rec("a", "hf_pld", 10.0, [1], 1), _rec("b", "hf_pld", 10 / 3, [1], 1),
               _rec("a", "hf", 10.0, [1], 1), _rec("b", "hf", 10.0, [1], 1),
               _rec("a", "also:pld", 10 / 1.5, [1], 1), _rec("b", "also:pld", 10 / 2.5, [1], 1)]
    summary = {"baseline": "ar", "peers": {"hf": {"method": "hf_generate", "exactness": "tokens"},
                                           "hf_pld": {"method": "hf_pld", "exactness": "tokens"},
                                           "also:pld": {"method": "pld", "exactness": "tokens"}}}
    cells = T.cells(records, summary, max_new_tokens=10)
    assert cells["pld"]["speedup_mean"] == pytest.approx(2.0) == cells["hf_pld"]["speedup_mean"]
    v = cells["pld"]["vs_peer"]
    assert v["peer"] == "hf_pld" and v["n"] == 2 and v["mean"] == pytest.approx((1.5 + 2.5 / 3) / 2)
    assert v["ci95"][0] <= v["mean"] <= v["ci95"][1] and v["median"] == pytest.approx(v["mean"])
    assert cells["hf"]["vs_peer"] is None and cells["hf_pld"]["vs_peer"] is None and cells["ar"]["vs_peer"] is None
    own = T.cells([r for r in records if not r["role"].startswith("hf")], summary, max_new_tokens=10)
    assert own["pld"]["vs_peer"] is None  # a run without transformers' peers (a fine-tuned model's)

    table = {"date": "2026-12-01", "commit": "abc", "host": {"cpu": "x"}, "dtype": "int8", "n": 2,
             "max_new_tokens": 8, "benchmarks": {"gsm8k": {"metric": "correct", "methods": cells}}}
    path = tmp_path / "table_2026-12-01.json"
    path.write_text(json.dumps(table))
    t = docs.tables_of(path)["gsm8k"]
    assert t["columns"][3] == "× hf_pld (95% CI)"
    rows = {r[0]: r for r in t["rows"]}
    assert rows["pld"][3].startswith("1.17 (") and rows["hf_pld"][3] == "–" and rows["ar"][3] == "–"


def test_a_quality_loss_beyond_the_papers_tolerance_is_flagged_against_the_base_models_ar(tmp_path):
    from pardec.report import docs

    def rec(id_, role, score):
        return {**_rec(id_, role, 1.0, [1], 1), "score": {"rougeL": score}}

    ids = [str(i) for i in range(10)]
    base = [0.30, 0.20, 0.25, 0.35, 0.22, 0.28, 0.31, 0.19, 0.26, 0.24]
    records = [rec(i, "baseline", b) for i, b in zip(ids, base)]
    records += [rec(i, "also:bild", b - 0.005) for i, b in zip(ids, base)]  # 0.5 points: within BiLD's 1 point
    records += [rec(i, "also:mjsd", b - 0.05) for i, b in zip(ids, base)]  # 5 points below on every prompt
    records += [rec(i, "also:pld", b) for i, b in zip(ids, base)]  # lossless: ar's outputs, no quality cell
    summary = {"baseline": "ar", "metric_name": "rougeL", "peers": {
        "also:bild": {"method": "bild", "exactness": "approximate", "metric": 0.255},
        "also:mjsd": {"method": "mjsd", "exactness": "approximate", "metric": 0.215},
        "also:pld": {"method": "pld", "exactness": "distribution", "exact_match_rate": 1.0}}}
    cells = T.cells(records, summary, max_new_tokens=10)
    bild, mjsd = cells["bild"]["quality"], cells["mjsd"]["quality"]
    assert bild["mean_diff"] == pytest.approx(-0.005) and bild["tolerance"] == 0.01 and not bild["flagged"]
    assert mjsd["mean_diff"] == pytest.approx(-0.05) and mjsd["ci95"][1] < 0 and mjsd["flagged"]
    assert cells["pld"]["quality"] is None and cells["ar"]["quality"] is None

    tuned = [rec(i, "baseline", b - 0.1) for i, b in zip(ids, base)] + [rec(i, "also:jacobi", b - 0.1)
                                                                        for i, b in zip(ids, base)]
    on_model = T.cells(tuned, {"baseline": "ar", "metric_name": "rougeL", "peers": {
        "also:jacobi": {"method": "jacobi", "exactness": "distribution", "exact_match_rate": 1.0}}},
        max_new_tokens=10, base_scores=dict(zip(ids, base)))  # a fine-tuned model: against the base model's ar
    assert on_model["ar"]["quality"]["flagged"] and on_model["jacobi"]["quality"]["mean_diff"] == pytest.approx(-0.1)

    table = {"date": "2026-12-01", "commit": "abc", "host": {"cpu": "x"}, "dtype": "int8", "n": 10,
             "max_new_tokens": 10, "benchmarks": {"cnn_dm": {"metric": "rougeL", "methods": cells}}}
    path = tmp_path / "table_2026-12-01.json"
    path.write_text(json.dumps(table))
    tables = docs.tables_of(path)
    col = tables["cnn_dm"]["columns"].index("Δ rougeL vs ar (95% CI)")
    rows = {r[0]: r for r in tables["cnn_dm"]["rows"]}
    assert rows["mjsd"][col].startswith("-0.050 (") and rows["mjsd"][col].endswith("⚠")
    assert not rows["bild"][col].endswith("⚠") and rows["pld"][col] == "–"
    speed = {r[0]: r[1] for r in tables["speed"]["rows"]}
    assert speed["mjsd"].endswith("; rougeL 0.215 ⚠") and speed["bild"].endswith("; rougeL 0.255")


def test_a_published_table_is_rederived_from_its_raw_records_and_refused_where_a_cell_would_change(tmp_path, capsys):
    import gzip

    records = [_rec("a", "baseline", 2.0, [1, 2], 2), _rec("b", "baseline", 4.0, [1, 2], 2),
               _rec("a", "hf_pld", 1.0, [1, 2], 1), _rec("b", "hf_pld", 4.0, [1, 2], 2),
               _rec("a", "also:pld", 1.0, [1, 2], 1), _rec("b", "also:pld", 2.0, [1, 2], 1)]
    summary = {"baseline": "ar", "metric_name": "correct", "peers": {
        "hf_pld": {"method": "hf_pld", "exactness": "tokens"}, "also:pld": {"method": "pld", "exactness": "tokens"}}}
    raw = tmp_path / "table_x"
    raw.mkdir()
    with gzip.open(raw / "gsm8k.results.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    with gzip.open(raw / "gsm8k.summary.json.gz", "wt") as f:
        json.dump(summary, f)
    published = {label: {k: v for k, v in c.items() if k != "vs_peer"}  # as a table before the field existed
                 for label, c in T.cells(records, summary, max_new_tokens=8).items()}
    table = {"date": "2026-12-01", "commit": "abc", "dtype": "int8", "n": 2, "max_new_tokens": 8,
             "sampling": {"temperature": 0.0},
             "benchmarks": {"gsm8k": {"metric": "correct", "methods": published, "timed_s": 14.0}}}
    result = tmp_path / "table_x.json"
    result.write_text(json.dumps(table))
    assert T.main(["--rederive", str(result)]) == 0
    assert "added vs_peer" in capsys.readouterr().out
    new = json.loads(result.read_text())
    assert new["benchmarks"]["gsm8k"]["methods"]["pld"]["vs_peer"]["mean"] == pytest.approx(1.5)  # 1/1, 4/2
    assert new["benchmarks"]["gsm8k"]["methods"]["pld"]["speedup_mean"] == published["pld"]["speedup_mean"]
    assert new["rederived"][0]["added"] == ["vs_peer"] and new["benchmarks"]["gsm8k"]["timed_s"] == 14.0

    table["benchmarks"]["gsm8k"]["methods"]["pld"]["speedup_mean"] = 9.9  # not what its records say
    result.write_text(json.dumps(table))
    assert T.main(["--rederive", str(result)]) == 2
    assert "gsm8k/pld does not come out as published from its records (['speedup_mean'])" in capsys.readouterr().err
    assert json.loads(result.read_text()) == table  # nothing written
    assert T.main(["--rederive", str(tmp_path / "none.json")]) == 2


def test_the_sampled_table_runs_at_its_temperature_in_a_directory_of_its_own(tmp_path, monkeypatch):
    a = argparse.Namespace(benchmarks="gsm8k", n=3, max_new_tokens=8, dtype="fp32", threads=1, model="smollm2_135m",
                           extra=[], temperature=1.0)
    args = dict(T.commands(a, ["pld"], []))["gsm8k"]
    assert "sampling.temperature=1" in args and "sampling.temperature=0" not in args
    assert "sampling.temperature=0" in dict(T.commands(argparse.Namespace(**{**vars(a), "temperature": 0.0}),
                                                        ["pld"], []))["gsm8k"]
    ident = T.identity(a, ["pld"], [])
    assert ident["temperature"] == 1.0 and "temperature" not in T.identity(
        argparse.Namespace(**{**vars(a), "temperature": 0.0}), ["pld"], [])  # a greedy table's identity as before
    monkeypatch.setattr(T, "REPO_ROOT", tmp_path)
    assert T.main(["--temperature", "1", "--dry-run", "--methods", "pld"]) == 0
    with pytest.raises(SystemExit):
        T.main(["--temperature", "-1"])


def test_a_continuation_with_other_settings_is_refused_in_one_line(tmp_path):
    ident = {"host": {"cpu": "x"}, "dtype": "fp32", "n": 20}
    T.check_identity(tmp_path, ident)
    T.check_identity(tmp_path, ident)  # the same: continues
    with pytest.raises(T.TableError) as e:
        T.check_identity(tmp_path, {**ident, "host": {"cpu": "y"}, "dtype": "bf16"})
    msg = str(e.value)
    assert "\n" not in msg and "'x'" in msg and "'y'" in msg and "dtype was 'fp32', now 'bf16'" in msg


def test_the_identity_names_each_zoo_artifact_by_its_manifest_so_a_rebuilt_drafter_is_refused(tmp_path, monkeypatch):
    from pardec import zoo

    monkeypatch.setattr(zoo, "ZOO_DIR", tmp_path / "zoo")
    for name in ("draft", "eagle3", "cllm", "medusa"):
        (tmp_path / "zoo" / "smollm2" / name).mkdir(parents=True)
        (tmp_path / "zoo" / "smollm2" / name / zoo.MANIFEST).write_text(f'{{"name": "{name}"}}')
    runs = (["pld", "sps", "mjsd", "eagle3:path=zoo:eagle3"], [("jacobi", "cllm")])
    used = T.zoo_used(*runs)
    assert sorted(used) == ["cllm", "draft", "eagle3"] and all(len(h) == 64 for h in used.values())
    out = tmp_path / "table"
    T.check_identity(out, {"dtype": "fp32", "zoo": used})
    T.check_identity(out, {"dtype": "fp32", "zoo": T.zoo_used(*runs)})  # unchanged: continues
    (tmp_path / "zoo" / "smollm2" / "eagle3" / zoo.MANIFEST).write_text('{"name": "eagle3", "retrained": true}')
    with pytest.raises(T.TableError, match="zoo"):
        T.check_identity(out, {"dtype": "fp32", "zoo": T.zoo_used(*runs)})


def test_a_continuation_at_another_commit_continues_and_each_run_keeps_its_commits(tmp_path, monkeypatch):
    """A table of several hours is made in parts on one host: a later commit continues it, and every run lists
    the commits it ran at; the table names one commit only when every run used it."""

    T.check_identity(tmp_path, {"host": {"cpu": "x"}, "dtype": "fp32", "n": 20})
    monkeypatch.setattr("pardec.bench.table_run.git_state", lambda: {"commit": "a" * 40})
    assert T.record_commit(tmp_path, "gsm8k") == "a" * 40
    T.record_commit(tmp_path, "gsm8k")  # the same commit again: listed once
    monkeypatch.setattr("pardec.bench.table_run.git_state", lambda: {"commit": "b" * 40})
    T.check_identity(tmp_path, {"host": {"cpu": "x"}, "dtype": "fp32", "n": 20})  # no commit in the identity
    T.record_commit(tmp_path, "gsm8k")
    T.record_commit(tmp_path, "spider")
    commits = json.loads((tmp_path / "table_run.json").read_text())["commits"]
    assert commits == {"gsm8k": ["a" * 40, "b" * 40], "spider": ["b" * 40]}
    assert T._one_commit(commits) == "several: aaaaaaaaa, bbbbbbbbb"
    assert T._one_commit({"spider": ["b" * 40]}) == "b" * 40


def test_bad_arguments_are_refused(capsys):
    for args, want in ((["--benchmarks", "gsm8k,squad"], "--benchmarks 'squad' is not one of: gsm8k, spider"),
                       (["--n", "0"], "--n=0 is out of range")):
        with pytest.raises(SystemExit):
            T.main(args)
        assert want in capsys.readouterr().err


@pytest.mark.slow
def test_a_tiny_table_end_to_end_and_a_rerun_continues(tmp_path, capsys):
    args = ["--benchmarks", "humaneval", "--methods", "pld,jacobi", "--n", "2", "--max-new-tokens", "8",
            "--model", "tiny_random", "--threads", "1", "--out", str(tmp_path), "bench.warmup=0"]
    assert T.main(args) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    cells = table["benchmarks"]["humaneval"]["methods"]
    assert {"ar", "pld", "jacobi", "hf", "hf_pld"} <= set(cells)
    assert all(c["n"] == 2 and c["exact_match_rate"] == 1.0 and not c["flagged"] for c in cells.values())
    assert table["dtype"] == "fp32" and table["n"] == 2 and table["commit"] and table["host"]["cpu"]
    assert list(table["commits"]) == ["humaneval"] and table["commits"]["humaneval"] == [table["commit"]]
    assert "| pld |" in (tmp_path / "table.md").read_text()
    capsys.readouterr()
    assert T.main(args) == 0
    assert "humaneval: done earlier" in capsys.readouterr().out
    assert T.main([*args[:5], "3", *args[6:]]) == 2
    assert "n was 2, now 3" in capsys.readouterr().err


def test_a_published_table_renders_per_benchmark_and_as_the_leaderboard(tmp_path):
    from pardec.report import docs

    cell = {"method": "pld", "exactness": "tokens", "n": 2, "speedup_mean": 1.5, "speedup_ci95": [1.2, 1.8],
            "speedup_median": 1.4, "tokens_per_forward": 2.0, "exact_match_rate": 1.0, "flagged": False,
            "metric": 0.5, "ended_share": 1.0, "loop_share": 0.0, "busy": 0}
    lossy = {**cell, "method": "jacobi", "exactness": "approximate", "metric": 0.25, "busy": 1}
    table = {"date": "2026-11-29", "commit": "abc", "host": {"cpu": "x"}, "dtype": "fp32", "n": 2,
             "max_new_tokens": 8, "benchmarks": {"gsm8k": {"metric": "correct", "methods": {"pld": cell}},
                                                 "humaneval": {"metric": "pass", "methods": {"jacobi@cllm": lossy}}}}
    path = tmp_path / "table_2026-11-29.json"
    path.write_text(json.dumps(table))
    tables = docs.tables_of(path)
    assert tables["speed"]["columns"] == ["method", "gsm8k", "humaneval"]
    assert tables["speed"]["rows"] == [["pld", "1.50 (1.20–1.80)", "—"],
                                       ["jacobi@cllm", "—", "1.50 (1.20–1.80); pass 0.250 (busy 1)"]]
    assert tables["gsm8k"]["columns"][5] == "correct" and tables["gsm8k"]["rows"][0][:3] == ["pld", "1.50 (1.20–1.80)",
                                                                                            "1.40"]
    tuned = {**cell, "exactness": "tokens", "metric": None, "perplexity": 8.5}  # ar on a fine-tuned model, judged task
    table["benchmarks"] = {"mt_bench": {"metric": "score", "methods": {"pld": cell, "ar@cllm": tuned}}}
    path.write_text(json.dumps(table))
    tables = docs.tables_of(path)
    assert tables["speed"]["rows"] == [["pld", "1.50 (1.20–1.80)"], ["ar@cllm", "1.50 (1.20–1.80); ppl 8.50"]]
    assert tables["mt_bench"]["columns"][5:7] == ["score", "ppl (base)"] and tables["mt_bench"]["rows"][1][6] == "8.50"


def test_each_benchmark_gets_a_figure_with_every_plotted_method_numbered_in_its_legend(tmp_path):
    from pardec.report.table import plot_benchmarks

    def cell(speed, tpf, exactness="tokens", metric=0.5, flagged=False):
        return {"speedup_mean": speed, "speedup_ci95": [speed - 0.1, speed + 0.1], "tokens_per_forward": tpf,
                "exactness": exactness, "metric": metric, "flagged": flagged}

    methods = {f"m{i}": cell(0.5 + i / 20, 1 + i / 10) for i in range(22)}
    methods["jacobi@cllm"] = cell(1.2, 1.8, "approximate", 0.1)
    methods["sps"] = cell(1.1, 2.4, "distribution", flagged=True)
    methods["no_forwards"] = {**cell(1.0, 1.0), "tokens_per_forward": None}  # (hf_generate counts none): not drawn
    table = {"date": "2026-11-29", "commit": "abcdef1234", "host": {"cpu": "Some CPU"}, "dtype": "fp32", "n": 20,
             "max_new_tokens": 128, "benchmarks": {"gsm8k": {"metric": "correct", "methods": methods},
                                                   "humaneval": {"metric": "pass", "methods": {"ar": cell(1.0, 1.0)}}}}
    legends = plot_benchmarks(table, tmp_path / "plots")
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["gsm8k.png", "humaneval.png"]
    assert len(legends["gsm8k"]) == 24 and legends["gsm8k"][0] == "1 m0" and "24 sps" in legends["gsm8k"]
    assert not any("no_forwards" in e for e in legends["gsm8k"]) and legends["humaneval"] == ["1 ar"]


def test_aggregate_publishes_the_finished_runs_and_lists_the_rest_as_pending(tmp_path, capsys):
    """A table made in parts: --aggregate runs nothing and writes what the finished runs hold, naming the others."""
    run = tmp_path / "runs" / "gsm8k"
    run.mkdir(parents=True)
    summary = {"baseline": "ar", "metric_name": "correct", "baseline_metric": 0.25,
               "peers": {"also:pld": {"method": "pld", "exactness": "tokens", "exact_match_rate": 1.0, "metric": 0.25}}}
    (run / "summary.json").write_text(json.dumps(summary))
    recs = [{"id": i, "role": role, "wall_s": w, "n_tokens": 8, "target_forwards": f, "turn_tokens": [[1, 2] * 4]}
            for i in range(2) for role, w, f in (("baseline", 2.0, 8), ("also:pld", 1.0, 4))]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    args = ["--benchmarks", "gsm8k,humaneval", "--methods", "pld", "--n", "2", "--max-new-tokens", "8",
            "--out", str(tmp_path), "--aggregate"]
    assert T.main(args) == 0
    table = json.loads((tmp_path / "table.json").read_text())
    assert table["pending"] == ["humaneval"] and table["command"].endswith("--max-new-tokens 8 --out " + str(tmp_path))
    pld = table["benchmarks"]["gsm8k"]["methods"]["pld"]
    assert pld["speedup_mean"] == 2.0 and pld["tokens_per_forward"] == 2.0 and pld["n"] == 2
    assert table["benchmarks"]["gsm8k"]["timed_s"] == 6.0
    assert (tmp_path / "plots" / "gsm8k.png").is_file() and "Not finished yet: humaneval" in (
        tmp_path / "table.md").read_text()
    assert "not finished yet: humaneval" in capsys.readouterr().out
    assert not (tmp_path / "runs" / "humaneval").exists()  # nothing ran


def test_after_a_zoo_rebuild_only_the_runs_that_decode_with_it_run_anew(tmp_path):
    """A rebuilt zoo artifact refuses the table (naming --redo); --redo sets aside the runs that decode with it and
    the rest of the table continues, unless a kept run holds a changed drafter too."""
    from pardec.bench import table_run

    ident = {"dtype": "fp32", "zoo": {"cllm": "a", "draft": "b"}}
    T.check_identity(tmp_path, ident)
    for run in ("gsm8k", "gsm8k@cllm"):
        (tmp_path / "runs" / run).mkdir(parents=True)
        (tmp_path / "runs" / run / "run.json").write_text("{}")
        (tmp_path / "runs" / run / "summary.json").write_text("{}")
    T.record_commit(tmp_path, "gsm8k@cllm")
    uses = {"gsm8k": {"draft"}, "gsm8k@cllm": {"cllm"}, "spider": {"draft"}}
    rebuilt = {"cllm": "c", "draft": "b"}
    with pytest.raises(T.TableError, match=r"zoo\.cllm was 'a', now 'c'\) \(a rebuilt zoo artifact: --redo"):
        T.check_identity(tmp_path, {**ident, "zoo": rebuilt})
    with pytest.raises(T.TableError, match="--redo 'gsm8k@clm' is not one of the table's runs: gsm8k, gsm8k@cllm"):
        table_run.redo(tmp_path, ["gsm8k@clm"], rebuilt, uses)
    with pytest.raises(T.TableError, match=r"cannot keep the run gsm8k: .* draft .*\(--redo gsm8k@cllm,gsm8k\)"):
        table_run.redo(tmp_path, ["gsm8k@cllm"], {"cllm": "c", "draft": "d"}, uses)
    assert (tmp_path / "runs" / "gsm8k@cllm" / "summary.json").is_file()  # a refused redo moves nothing
    [moved] = table_run.redo(tmp_path, ["gsm8k@cllm"], rebuilt, uses)
    assert moved.parent == tmp_path / "runs" / "superseded" and (moved / "summary.json").is_file()
    assert not (tmp_path / "runs" / "gsm8k@cllm").exists() and (tmp_path / "runs" / "gsm8k").is_dir()
    T.check_identity(tmp_path, {**ident, "zoo": rebuilt})  # continues with the rebuilt drafter
    assert "gsm8k@cllm" not in json.loads((tmp_path / "table_run.json").read_text()).get("commits", {})


def test_a_table_begun_before_a_method_was_renamed_continues_under_the_new_name(tmp_path):
    from pardec.bench import table_run

    T.check_identity(tmp_path, {"dtype": "fp32", "shared": ["pld", "eagle:path=zoo:eagle3:mode=chain"]})
    table_run.kept_shared(tmp_path, T.current_entry)
    T.check_identity(tmp_path, {"dtype": "fp32", "shared": ["pld", "eagle3:path=zoo:eagle3:mode=chain"]})
    records = [_rec("a", "baseline", 2.0, [1, 2], 2), _rec("a", "also:eagle:path=zoo:eagle3", 1.0, [1, 2], 1, True)]
    summary = {"baseline": "ar", "peers": {"also:eagle:path=zoo:eagle3": {"method": "eagle", "exactness": "distribution",
                                                                        "exact_match_rate": 1.0}}}
    assert "eagle3:path=zoo:eagle3" in T.cells(records, summary, max_new_tokens=8)  # one label for old and new runs


def test_status_says_how_far_each_run_is(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "humaneval").mkdir(parents=True)
    (runs / "humaneval" / "run.json").write_text("{}")
    (runs / "humaneval" / "results.jsonl").write_text("".join(
        json.dumps({"id": i, "role": r}) + "\n" for i in ("a", "b") for r in ("baseline", "also:pld")))
    assert T.run_status(runs / "humaneval", 20) == "2 of 20 prompts timed"
    assert T.run_status(runs / "gsm8k", 20) == "not started"
    (runs / "humaneval" / "summary.json").write_text("{}")
    assert T.run_status(runs / "humaneval", 20) == "done"
    assert T.main(["--benchmarks", "humaneval,gsm8k", "--methods", "pld", "--out", str(tmp_path), "--status"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == ["humaneval: done", "gsm8k: not started"]
    assert not (tmp_path / "table_run.json").exists()  # nothing ran, nothing recorded
