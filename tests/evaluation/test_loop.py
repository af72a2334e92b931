"""pardec.evaluation.loop: end-to-end runs on tiny_random (records, summary, peers, bench.also), resume after a
kill, skips, repeats, NaN logits, an empty dataset; and run_document on its own."""

from __future__ import annotations

import json

import pytest

from pardec.config import ConfigError
from pardec.evaluation import run
from tests.evaluation.helpers import TINY, cfg_of, lines, strict_json


def test_end_to_end_run_writes_results_and_summary(tmp_path):
    summary = run(cfg_of("+method=jacobi", "method.block_size=4", "bench.include_hf=true", *TINY), tmp_path)
    recs = lines(tmp_path)
    # no draft: the peers are hf (generate) and hf_pld (its prompt lookup), not hf_assisted
    assert len(recs) == 12 and {r["role"] for r in recs} == {"baseline", "method", "hf", "hf_pld"}
    for r in recs:
        for k in ("id", "method", "tokens", "text", "target_forwards", "draft_forwards", "accepted", "wall_s",
                  "equal_to_baseline", "first_divergence", "score", "draft_s", "drafted", "draft_accepted"):
            assert k in r
        if r["role"] != "baseline":
            assert r["equal_to_baseline"] is True and r["first_divergence"] is None
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary))
    for k in ("method", "baseline", "dataset", "model", "dtype", "n_samples", "tokens_per_s", "baseline_tokens_per_s",
              "hf_tokens_per_s", "speedup", "speedup_median", "tokens_per_forward", "exact_match_rate", "metric",
              "peak_rss_mb", "perplexity"):
        assert k in saved, k
    assert saved["exact_match_rate"] == 1.0 and saved["n_samples"] == 3 and saved["metric_name"] == "pass"
    assert saved["exactness"] == "distribution" and "lossless" not in saved and saved["n_errors"] == 0
    assert set(saved["peers"]) == {"hf", "hf_pld"} and saved["draft"] is None
    for peer in saved["peers"].values():
        assert peer["exact_match_rate"] == 1.0 and peer["tokens_per_s"] > 0 and peer["speedup"] > 0
        assert peer["tokens_per_forward"] >= 1.0
    assert saved["hf_tokens_per_s"] == saved["peers"]["hf"]["tokens_per_s"]
    assert saved["mean_accepted_length"] == pytest.approx(saved["tokens_per_forward"])  # every token counted
    assert saved["perplexity"] == pytest.approx(saved["baseline_perplexity"])
    assert saved["extras"]["fast_forward"] >= 1.0


def test_resume_after_a_kill_redoes_and_duplicates_nothing(tmp_path):
    args = ("+method=pld", *TINY, "n_samples=4")
    run(cfg_of(*args), tmp_path)
    full = lines(tmp_path)
    # simulate a kill: keep 3 complete records and half of the 4th
    raw = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("".join(raw[:3]) + raw[3][: len(raw[3]) // 2])
    with pytest.raises(FileExistsError, match="resume=true"):
        run(cfg_of(*args), tmp_path)
    run(cfg_of(*args, "resume=true"), tmp_path)
    again = lines(tmp_path)
    keys = [(r["id"], r["role"], r["repeat"]) for r in again]
    assert len(keys) == len(set(keys)) == len(full) == 8
    assert again[:3] == full[:3]  # finished records untouched
    assert [r["tokens"] for r in again] == [r["tokens"] for r in full]  # greedy: same tokens again
    with pytest.raises(ConfigError, match="cannot resume"):
        run(cfg_of("+method=jacobi", *TINY, "n_samples=4", "resume=true"), tmp_path)


def test_prompt_longer_than_context_is_skipped_and_recorded(tmp_path):
    summary = run(cfg_of("+method=ar", *TINY, "max_new_tokens=2040", "n_samples=2"), tmp_path)
    recs = lines(tmp_path)
    assert len(recs) == 2 and all("exceeds the model's context of 2048 tokens" in r["skipped"] for r in recs)
    assert summary["n_samples"] == 0 and len(summary["skipped"]) == 2


def test_repeats_report_mean_and_std(tmp_path):
    s = run(cfg_of("+method=jacobi", *TINY, "n_samples=2", "repeats=2"), tmp_path)
    assert len(lines(tmp_path)) == 8 and s["repeats"] == 2
    assert s["speedup_std"] is not None and s["tokens_per_s_std"] is not None


def test_nan_logits_record_an_error_and_the_run_goes_on(tmp_path):
    import copy

    import torch

    from pardec.config import DatasetConfig
    from pardec.tasks.base import build_task
    from tests.conftest import tiny

    lm = tiny(0)
    task = build_task(DatasetConfig(name="humaneval"))
    p0, p1 = (set(task.prompt_ids(d, lm.tokenizer, lm.chat, [])) for d in task.docs()[:2])
    poison = min(p0 - p1)  # in the first prompt only: its embedding becomes NaN
    model = copy.deepcopy(lm.model)
    with torch.no_grad():
        model.model.embed_tokens.weight[poison] = float("nan")
    model.save_pretrained(tmp_path / "nan_model")
    lm.tokenizer.save_pretrained(tmp_path / "nan_model")
    out, args = tmp_path / "run", ("+method=pld", "model=local", f"model.path={tmp_path / 'nan_model'}", *TINY[1:],
                                   "n_samples=2", "bench.include_hf=true")
    s = run(cfg_of(*args, "bench.warmup=1"), out)  # the warm-up (first prompt) hits it too
    recs = strict_json(out / "results.jsonl")
    strict_json(out / "summary.json")
    first = task.docs()[0]["id"]
    assert len(recs) == 8  # 2 prompts x (baseline, method, hf, hf_pld): the run went on
    for r in recs:
        if r["id"] == first:
            assert "NaN" in r["error"] and "n_tokens" not in r
        else:
            assert "error" not in r and r["n_tokens"] == 12 and r["nll"] is not None
    assert s["n_errors"] == 4 and {e["id"] for e in s["errors"]} == {first}
    assert {e["role"] for e in s["errors"]} == {"baseline", "method", "hf", "hf_pld"}
    assert s["n_samples"] == 1 and s["exact_match_rate"] == 1.0 and s["perplexity"] is not None  # second only
    from pardec.metrics.sandbox import isolation

    assert s["sandbox"] == isolation()  # HumanEval runs model output: the summary says which isolation ran
    # resume: errored records count as done (not retried forever), nothing is duplicated
    run(cfg_of(*args, "resume=true"), out)
    assert len(strict_json(out / "results.jsonl")) == 8


def test_bench_also_runs_more_methods_side_by_side(tmp_path):
    s = run(cfg_of("+method=pld", *TINY, "draft=tiny_random", "n_samples=2",
                   'bench.also=["sps:adaptive=true:gamma=3", "jacobi:block_size=4"]'), tmp_path)
    roles = {(r["id"], r["role"]) for r in lines(tmp_path)}
    assert len(roles) == 2 * 4  # baseline, method, two `also` roles; nothing duplicated
    also = {k: v for k, v in s["peers"].items() if k.startswith("also:")}
    assert set(also) == {"also:sps:adaptive=true:gamma=3", "also:jacobi:block_size=4"}
    sps = also["also:sps:adaptive=true:gamma=3"]
    assert sps["method"] == "sps" and sps["params"] == {"adaptive": True, "gamma": 3}
    assert sps["exactness"] == "distribution" and sps["exact_match_rate"] == 1.0
    assert sps["draft_forwards"] > 0 and sps["tokens_per_s"] > 0
    assert also["also:jacobi:block_size=4"]["exact_match_rate"] == 1.0


# ------------------------------------------------------------------------------------------ datasets
def test_empty_dataset_is_an_error_before_any_model_loads(tmp_path, monkeypatch):
    from pardec.models import loading
    from pardec.tasks.base import DataError

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError) as e:
        run(cfg_of("+method=ar", *TINY, f"dataset.path={empty}"), tmp_path / "run")
    assert f"dataset 'humaneval' has no documents: dataset.path={empty}" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written


def test_the_warm_up_leaves_no_state_in_the_timed_decoders(tmp_path):
    """The warm-up generates on the first timed prompt; Ouroboros's warm_start pool (kept across prompts) must not
    start the timed run with what it harvested there: the records equal those of a run without a warm-up."""
    args = ("+method=ouroboros", "method.warm_start=true", "draft=tiny_random", *TINY[:2], "max_new_tokens=24",
            "bench.warmup_tokens=24", "perplexity.enabled=false")
    run(cfg_of(*args, "bench.warmup=0"), tmp_path / "cold")
    run(cfg_of(*args, "bench.warmup=1"), tmp_path / "warm")
    keep = ("id", "role", "tokens", "target_forwards", "draft_forwards", "accepted", "extras")
    cold, warm = ([{k: r[k] for k in keep} for r in lines(tmp_path / d)] for d in ("cold", "warm"))
    assert warm == cold  # before the fix the warm run's first prompt drafted from phrases of its own warm-up
