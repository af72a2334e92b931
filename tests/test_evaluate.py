"""`python -m evaluate`: config validation, an end-to-end run on tiny_random, resume, skips, multirun."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Literal

import pytest
from hydra import compose, initialize_config_dir

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.evaluate import run, validate
from pardec.registry import UnknownNameError

TINY = ["model=tiny_random", "n_samples=3", "max_new_tokens=12", "bench.warmup=0", "perplexity.enabled=true"]


def cfg_of(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines() if x.strip()]


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([], "no method given: pass +method=<name>; valid methods: ar, bild, firp, hf_assisted, hf_generate, hf_pld, "
                "jacobi, lookahead, medusa, medusa_typical, mjgd, mjsd, ouroboros, pld, sdsat, spectr, sps"),
        (["+method=medusa"], "method 'medusa' needs trained medusa weights: method.heads=<dir>"),
        (["+method=firp", "method.projections=/nonexistent"], "method.projections='/nonexistent' holds no trained "
                                                                  "drafter"),
        (["+method=jacobi", "method.name=jacobo"], "unknown method 'jacobo'. Did you mean 'jacobi'?"),
        (["+method=jacobi", "+method.blocksize=4"], "has no parameter(s) ['blocksize']; valid: block_size"),
        (["+method=jacobi", "method.block_size=0"], "method.block_size=0 is out of range"),
        (["+method=ar", "dataset.name=gsm9k"], "unknown dataset 'gsm9k'. Did you mean 'gsm8k'?"),
        (["+method=ar", "max_new_tokens=0"], "max_new_tokens=0 is out of range: it must be >= 1"),
        (["+method=ar", "n_samples=0"], "n_samples=0 is out of range"),
        (["+method=ar", "dtype=fp8"], "dtype='fp8' is not valid; choose one of: fp32, bf16, fp16"),
        (["+method=ar", "sampling.top_p=1.5"], "sampling.top_p=1.5 is out of range"),
        (["+method=ar", "bench.baseline=nope"], "bench.baseline='nope': unknown method 'nope'. Valid methods: ar, "),
        (["+method=ar", "bench.baseline=sps"], "bench.baseline='sps': method 'sps' needs a draft model"),
        (["+method=ar", "max_new_tokens=abc"], "max_new_tokens='abc' must be int"),
        (["+method=ar", "sampling.temperature=hot"], "sampling.temperature='hot' must be float"),
        (["+method=ar", "model=tiny_random", "model.seed=2.5"], "model.seed=2.5 must be int"),
        (["+method=sps", "draft=tiny_random", "model=tiny_random", "method.gamma=0"], "method.gamma=0 is out of range"),
        (["+method=sps", "draft=tiny_random", "model=tiny_random", "method.gamma=9", "method.adaptive=true",
          "method.gamma_max=8"], "method.gamma=9 must lie in [gamma_min, gamma_max] = [1, 8]"),
        (["+method=mjsd"], "method 'mjsd' needs a draft model: pass draft=<name>"),
        (["+method=bild"], "method 'bild' needs a draft model: pass draft=<name>"),
        (["+method=spectr"], "method 'spectr' needs a draft model: pass draft=<name>"),
        (["+method=mjsd", "draft=tiny_random", "method.num_beams=0"],
         "method.num_beams=0 is out of range: it must be an integer in [1, 64]"),
        (["+method=mjsd", "draft=tiny_random", "method.width=9"], "method.width=9 is out of range: it must be an integer in [1, 8]"),
        (["+method=mjsd", "draft=tiny_random", "method.tau=1.5"], "method.tau=1.5 is out of range: it must be a number in [0.0, 1.0]"),
        (["+method=mjsd", "draft=tiny_random", "method.top_p=0"], "method.top_p=0 is out of range: it must be a number in (0.0, 1.0]"),
        (["+method=mjgd", "method.K=0"], "method.K=0 is out of range"),
        (["+method=spectr", "draft=tiny_random", "method.k=0"], "method.k=0 is out of range: it must be an integer in [1, 64]"),
        (["+method=bild", "draft=tiny_random", "method.fallback_threshold=1.2"],
         "method.fallback_threshold=1.2 is out of range: it must be a number in [0.0, 1.0]"),
        (["+method=bild", "draft=tiny_random", "method.rollback_threshold=-1"],
         "method.rollback_threshold=-1 is out of range: it must be a number in (0.0, 1000000.0]"),
    ],
)
def test_config_errors_name_the_bad_value_and_choices(overrides, needle):
    with pytest.raises((ConfigError, UnknownNameError)) as e:
        validate(cfg_of(*overrides))
    assert needle in str(e.value)


def test_unknown_config_group_option_lists_valid_ones():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as e:
        cfg_of("+method=nope")
    assert "jacobi" in str(e.value)  # Hydra lists the available options


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


def _cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evaluate", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_cli_from_another_directory_and_clear_errors(tmp_path):
    out = tmp_path / "run"
    p = _cli("+method=jacobi", *TINY, f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "speedup (total time)" in p.stdout and (out / "summary.json").is_file()
    bad = _cli("+method=jacobi", "model=tiny_random", "dtype=fp8", f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert bad.returncode == 2 and "dtype='fp8' is not valid" in bad.stderr
    missing = _cli("model=tiny_random", f"hydra.run.dir={tmp_path / 'bad2'}", cwd=tmp_path)
    assert missing.returncode == 2 and "pass +method=<name>" in missing.stderr
    nomodel = _cli("+method=ar", "model=local", "model.path=/no/such/dir", f"hydra.run.dir={tmp_path / 'bad3'}",
                   cwd=tmp_path)
    assert nomodel.returncode == 2 and "/no/such/dir" in nomodel.stderr


def test_multirun_gives_one_dir_per_job_and_wandb_offline(tmp_path):
    sweep = tmp_path / "sweep"
    p = _cli("-m", "+method=ar,pld", "dataset=humaneval", *TINY, "n_samples=1", "logger=wandb",
             f"hydra.sweep.dir={sweep}", cwd=tmp_path,
             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    jobs = sorted(d for d in sweep.iterdir() if (d / "summary.json").is_file())
    assert [json.loads((d / "summary.json").read_text())["method"] for d in jobs] == ["ar", "pld"]
    assert list(jobs[0].glob("wandb/offline-run-*")), "W&B wrote an offline run in the job dir"


def _strict(path: Path) -> list:
    """Parse JSON / JSONL refusing NaN and Infinity (Python's json accepts them by default)."""
    def refuse(token):
        raise AssertionError(f"{path} holds {token}")

    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(x, parse_constant=refuse) for x in text.splitlines() if x.strip()]
    return [json.loads(text, parse_constant=refuse)]


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
    recs = _strict(out / "results.jsonl")
    _strict(out / "summary.json")
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
    assert len(_strict(out / "results.jsonl")) == 8


def test_non_finite_numbers_never_reach_json(tmp_path):
    from pardec.evaluate import finite, non_finite, write_json

    rec = {"nll": float("nan"), "extras": {"x": [1.0, float("inf")]}, "ok": 2.0}
    assert non_finite(rec) == "nll" and non_finite({"a": {"b": [0.0, -float("inf")]}}) == "a.b.1"
    assert non_finite({"a": 1.0, "b": None}) is None
    assert finite(rec) == {"nll": None, "extras": {"x": [1.0, None]}, "ok": 2.0}
    write_json(tmp_path / "s.json", {"perplexity": float("nan")})
    assert _strict(tmp_path / "s.json") == [{"perplexity": None}]


@pytest.mark.parametrize("entry,needle", [
    ("nope", "unknown method 'nope'"),
    ("pld:num_pred=0", "method.num_pred=0 is out of range"),
    ("pld:bogus=1", "has no parameter(s) ['bogus']"),
    ("pld:num_pred", "is not key=value"),
    ("sps", "needs a draft model: pass draft=<name>"),
])
def test_bench_also_entries_are_validated_before_loading(entry, needle):
    with pytest.raises((ConfigError, UnknownNameError)) as e:
        validate(cfg_of("+method=ar", f"bench.also=[\"{entry}\"]"))
    assert needle in str(e.value)


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


# ------------------------------------------------------------------------------------------ method parameters
@pytest.mark.parametrize("overrides,message", [
    (["+method=jacobi", "method.block_size=abc"], "method.block_size='abc' must be int (jacobi(block_size: int = 16))"),
    (["+method=jacobi", "method.block_size=2.5"], "method.block_size=2.5 must be int (jacobi(block_size: int = 16))"),
    (["+method=jacobi", "method.max_iters=x"], "method.max_iters='x' must be int or null (jacobi(max_iters: int | None "
                                               "= None))"),
    (["+method=jacobi", "method.record_trajectories=1"], "method.record_trajectories=1 must be bool"),
    (["+method=pld", "method.num_pred=[1,2]"], "method.num_pred=[1, 2] must be int"),
    (["+method=hf_assisted", "draft=tiny_random", "method.assistant_confidence_threshold=high"],
     "method.assistant_confidence_threshold='high' must be float"),
    (["+method=ar", "bench.also=['pld:num_pred=abc']"],
     "bench.also entry 'pld:num_pred=abc': method.num_pred='abc' must be int (pld(num_pred: int = 10))"),
])
def test_method_parameter_types_fail_in_one_line_before_loading(monkeypatch, overrides, message):
    from pardec.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError) as e:
        validate(cfg_of("model=tiny_random", *overrides))
    assert str(e.value) == message or str(e.value).startswith(message), str(e.value)
    assert "\n" not in str(e.value)


def test_method_parameter_types_accept_what_fits():
    spec = validate(cfg_of("+method=hf_assisted", "model=tiny_random", "draft=tiny_random",
                           "method.assistant_confidence_threshold=0"))  # an int where a float is wanted
    assert spec.method_params["assistant_confidence_threshold"] == 0
    assert validate(cfg_of("+method=jacobi", "model=tiny_random", "method.max_iters=null")).method_params[
        "max_iters"] is None


def test_every_method_parameter_has_a_checkable_type():
    import pardec.decoding  # noqa: F401
    from pardec.decoding.base import METHODS, _hints, method_params

    for name in METHODS.names():
        cls = METHODS.get(name)
        untyped = sorted(set(method_params(cls)) - set(_hints(cls)))
        assert not untyped, f"{name}: annotate {untyped} in __init__ so method.* values are type-checked"


def test_check_params_reads_unions_and_literals():
    from pardec.decoding.base import Decoder, build_decoder, check_params

    class Fake(Decoder):
        name = "fake"

        def __init__(self, target, tokenizer=None, draft=None, mode: Literal["a", "b"] = "a", x: float = 1.0,
                     n: int | None = None, free=None):
            pass

    check_params(Fake, {"mode": "b", "x": 2, "n": None, "free": object()})
    for params, msg in [({"mode": "c"}, "method.mode='c' must be one of 'a', 'b'"),
                        ({"x": True}, "method.x=True must be float"),
                        ({"n": 1.5}, "method.n=1.5 must be int or null (fake(n: int | None = None))")]:
        with pytest.raises(ConfigError, match=re.escape(msg)):
            check_params(Fake, params)
    with pytest.raises(ConfigError, match=re.escape("method.block_size='4' must be int")):
        build_decoder("jacobi", None, None, block_size="4")  # the harness's own entry point checks too


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


# ------------------------------------------------------------------------------------------ resume identity
def _hashes(root: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("override,diff", [
    ("model.seed=1", "model.seed was 0, now 1"),
    ("++model.revision=v2", "model.revision was None, now 'v2'"),
    ("++model.adapter=/some/lora", "model.adapter was None, now '/some/lora'"),
    ("draft=tiny_random", "draft was None, now {"),
    ("dataset.path=/other/humaneval.jsonl", "dataset.path was None, now '/other/humaneval.jsonl'"),
    ("dataset.prompt_style=base", "dataset.prompt_style was 'auto', now 'base'"),
    ("dataset.extra.memory_mb=512", "dataset.extra.memory_mb was 1024, now 512"),
    ("stop_at_eos=false", "stop_at_eos was True, now False"),
    ("timeout_s=5", "timeout_s was 10.0, now 5.0"),
    ("sampling.temperature=0.7", "sampling.temperature was 0.0, now 0.7"),
    ("max_new_tokens=8", "max_new_tokens was 12, now 8"),
    ("method.num_pred=3", "method_params.num_pred was 10, now 3"),
    ("bench.baseline=hf_generate", "baseline was 'ar', now 'hf_generate'"),
])
def test_a_refused_resume_changes_nothing_and_stays_refused(tmp_path_factory, override, diff):
    run_dir = _resumable_run(tmp_path_factory)
    before = _hashes(run_dir)
    args = ("+method=pld", *TINY, "n_samples=1")
    with pytest.raises(FileExistsError, match="resume=true"):  # without resume=true: refused, nothing written
        run(cfg_of(*args, override), run_dir)
    assert _hashes(run_dir) == before
    for _ in range(2):  # refused, and refused again: the first refusal did not make it acceptable
        with pytest.raises(ConfigError) as e:
            run(cfg_of(*args, override, "resume=true"), run_dir)
        msg = str(e.value)
        assert msg.startswith(f"cannot resume {run_dir}") and diff in msg and "hydra.run.dir" in msg, msg
        assert "\n" not in msg
        assert _hashes(run_dir) == before


@functools.cache
def _resumable_dir(root: str) -> Path:
    run_dir = Path(root) / "run"
    run(cfg_of("+method=pld", *TINY, "n_samples=1"), run_dir)
    return run_dir


def _resumable_run(tmp_path_factory) -> Path:
    """One finished tiny run shared by the resume tests (they must leave it unchanged)."""
    return _resumable_dir(str(tmp_path_factory.getbasetemp() / "resumable"))


def test_cli_refused_resume_leaves_the_run_dir_byte_for_byte(tmp_path):
    out = tmp_path / "run"
    args = ("+method=pld", *TINY, "n_samples=1", f"hydra.run.dir={out}")
    assert _cli(*args, cwd=tmp_path).returncode == 0
    before = _hashes(out)
    assert ".hydra/config.yaml" in before and "run.json" in before
    for extra in (("model.seed=3",), ("model.seed=3", "resume=true"), ("model.seed=3", "resume=true")):
        p = _cli(*args, *extra, cwd=tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert _hashes(out) == before, extra
    assert "model.seed was 0, now 3" in p.stderr
