"""pardec.evaluation.spec: config validation before anything loads (names, values, method parameters, bench.also),
the sandbox canary of a sandboxed task, and the resume identity (a refused resume changes nothing)."""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Literal

import pytest

from pardec.config import ConfigError
from pardec.evaluation import run, validate
from pardec.registry import UnknownNameError
from tests.evaluation.helpers import TINY, cfg_of, hashes


@pytest.mark.parametrize(
    "overrides,needle",
    [
        ([], "no method given: pass +method=<name>; valid methods: ar, bild, dflash, eagle3, firp, hf_assisted, hf_generate, hf_pld, "
                "jacobi, lookahead, medusa, medusa_typical, mjgd, mjsd, ouroboros, pld, sdsat, spectr, sps"),
        (["+method=medusa"], "method 'medusa' needs trained medusa weights: method.path=<dir>"),
        (["+method=firp", "method.path=/nonexistent"], "method.path='/nonexistent' holds no trained "
                                                                  "drafter"),
        (["+method=jacobi", "method.name=jacobo"], "unknown method 'jacobo'. Did you mean 'jacobi'?"),
        (["+method=ar", "bench.also=['eagle:path=/x']"], "method 'eagle' is now named 'eagle3'"),
        (["+method=jacobi", "+method.blocksize=4"], "has no parameter(s) ['blocksize']; valid: block_size"),
        (["+method=jacobi", "method.block_size=0"], "method.block_size=0 is out of range"),
        (["+method=ar", "dataset.name=gsm9k"], "unknown dataset 'gsm9k'. Did you mean 'gsm8k'?"),
        (["+method=ar", "max_new_tokens=0"], "max_new_tokens=0 is out of range: it must be >= 1"),
        (["+method=ar", "n_samples=0"], "n_samples=0 is out of range"),
        (["+method=ar", "dtype=fp8"], "dtype='fp8' is not valid; choose one of: fp32, bf16, fp16, int8"),
        (["+method=ar", "model=tiny_random", "dtype=int8", "model.device=cuda"], "dtype=int8 is a CPU mode"),
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
        (["+method=mjsd", "draft=tiny_random", "method.tau=1.5"], "method.tau=1.5 is out of range: it must be a number in [0.0, 1.0)"),
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
    from pardec.config import type_hints
    from pardec.decoding.base import METHODS, method_params

    for name in METHODS.names():
        cls = METHODS.get(name)
        untyped = sorted(set(method_params(cls)) - set(type_hints(cls.__init__)))
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


# ------------------------------------------------------------------------------------------ resume identity
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
    before = hashes(run_dir)
    args = ("+method=pld", *TINY, "n_samples=1")
    with pytest.raises(FileExistsError, match="resume=true"):  # without resume=true: refused, nothing written
        run(cfg_of(*args, override), run_dir)
    assert hashes(run_dir) == before
    for _ in range(2):  # refused, and refused again: the first refusal did not make it acceptable
        with pytest.raises(ConfigError) as e:
            run(cfg_of(*args, override, "resume=true"), run_dir)
        msg = str(e.value)
        assert msg.startswith(f"cannot resume {run_dir}") and diff in msg and "hydra.run.dir" in msg, msg
        assert "\n" not in msg
        assert hashes(run_dir) == before


def test_resume_of_a_dir_without_a_run_is_an_error_naming_it(tmp_path, monkeypatch):
    """resume=true on a new or empty run dir (no run.json, no records) used to start afresh silently."""
    from pardec.evaluation.spec import check_has_run
    from pardec.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    for run_dir in (tmp_path / "new", tmp_path / "empty"):
        if run_dir.name == "empty":
            (run_dir / ".hydra").mkdir(parents=True)  # what Hydra writes before the app runs
        with pytest.raises(ConfigError) as e:
            run(cfg_of("+method=pld", *TINY, "resume=true"), run_dir)
        msg = str(e.value)
        assert msg.startswith(f"resume=true but {run_dir} holds no run to resume") and "\n" not in msg, msg
        assert "hydra.run.dir=" in msg and not (run_dir / "run.json").exists()
    # a torchrun --standalone relaunch makes a new torchrun-<id> dir: the error says to name the old one
    with pytest.raises(ConfigError, match=re.escape("a relaunch gets a new launch id: pass hydra.run.dir=<the old "
                                                    "run dir>")):
        check_has_run(tmp_path / "torchrun-0123abcd")
    (tmp_path / "killed").mkdir()
    (tmp_path / "killed" / "run.json").write_text("{}")  # killed before its first record: resumable
    check_has_run(tmp_path / "killed")


@functools.cache
def _resumable_dir(root: str) -> Path:
    run_dir = Path(root) / "run"
    run(cfg_of("+method=pld", *TINY, "n_samples=1"), run_dir)
    return run_dir


def _resumable_run(tmp_path_factory) -> Path:
    """One finished tiny run shared by the resume tests (they must leave it unchanged)."""
    return _resumable_dir(str(tmp_path_factory.getbasetemp() / "resumable"))


# ------------------------------------------------------------------------------------------ sandbox canary
def test_broken_sandbox_is_an_error_before_any_model_loads(monkeypatch, tmp_path):
    import sys

    from pardec.metrics import sandbox
    from pardec.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    sandbox.isolation()  # probed with the real interpreter
    sandbox.clear_canaries()
    monkeypatch.setattr(sys, "executable", "/nonexistent/pardec-venv/bin/python")
    try:
        for dataset in ("humaneval", "spider"):  # code, SQL
            with pytest.raises(sandbox.SandboxError) as e:
                validate(cfg_of("+method=ar", "model=tiny_random", f"dataset={dataset}"))
            msg = str(e.value)
            assert "\n" not in msg and msg.startswith("sandbox canary failed: a known-good ")
            assert "/nonexistent/pardec-venv/bin/python" in msg
        with pytest.raises(sandbox.SandboxError):
            run(cfg_of("+method=ar", *TINY), tmp_path / "run")
        assert not (tmp_path / "run").exists()  # nothing written
        validate(cfg_of("+method=ar", "model=tiny_random", "dataset=gsm8k"))  # runs no model output: not checked
    finally:
        monkeypatch.undo()
        sandbox.clear_canaries()


def test_draft_eagle3_hands_its_path_to_method_eagle3():
    spec = validate(cfg_of("+method=eagle3", "draft=eagle3", "draft.path=/some/eagle3/dir"))
    assert spec.draft is None and spec.method_params["path"] == "/some/eagle3/dir"
    with pytest.raises(ConfigError, match="draft=eagle3 names a eagle3 drafter, which method eagle3 loads; method .sps. needs"):
        validate(cfg_of("+method=sps", "draft=eagle3", "draft.path=/x"))
    spec = validate(cfg_of("+method=dflash", "draft=dflash", "draft.path=/some/dflash/dir"))
    assert spec.draft is None and spec.method_params["path"] == "/some/dflash/dir"
    with pytest.raises(ConfigError, match="draft=dflash names a dflash drafter, which method dflash loads; method .eagle3."):
        validate(cfg_of("+method=eagle3", "draft=dflash", "draft.path=/x"))
    with pytest.raises(ConfigError, match="method.path='/a' and draft.path='/b' both name"):
        validate(cfg_of("+method=eagle3", "method.path=/a", "draft=eagle3", "draft.path=/b"))
