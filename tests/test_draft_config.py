"""The `draft=` config group: composition, checks before any weights load (tokenizer, missing dir, offline hub,
a method needing a draft), and an end-to-end run with a draft and HF's speculative peers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from transformers import LlamaConfig

from pardec.config import ConfigError
from pardec.evaluation import run, validate
from pardec.models.loading import load_tokenizer_only, named_config
from tests.evaluation.helpers import TINY, cfg_of, lines, run_cli

DISTILL_FIX = "train it: python -m train +experiment=draft_smollm2"


def _one_line_error(exc: pytest.ExceptionInfo, *needles: str) -> str:
    msg = str(exc.value)
    assert "\n" not in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def test_tiny_random_draft_follows_the_run_dtype():
    spec = validate(cfg_of("+method=sps", "model=tiny_random", "draft=tiny_random", "dtype=bf16"))
    assert spec.draft.source == "tiny_random" and spec.draft.seed == 1 and spec.model.seed == 0
    assert spec.draft.dtype == spec.model.dtype == "bf16"


def test_distilled_draft_path_and_missing_dir(tmp_path):
    cfg = cfg_of("+method=sps", "model=tiny_random", "draft=smollm2_distilled", f"paths.output_dir={tmp_path}")
    want = tmp_path / "train" / "runs" / "draft_smollm2" / "default" / "final"
    assert Path(cfg.draft.path) == want
    with pytest.raises(FileNotFoundError) as e:
        validate(cfg)
    _one_line_error(e, str(want), DISTILL_FIX, "draft 'smollm2_distilled'")


def test_local_draft_needs_a_path_that_exists(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate(cfg_of("+method=sps", "model=tiny_random", "draft=local"))
    _one_line_error(e, "needs draft.path=<dir>")
    with pytest.raises(FileNotFoundError) as e:
        validate(cfg_of("+method=sps", "model=tiny_random", "draft=local", f"draft.path={tmp_path / 'nope'}"))
    _one_line_error(e, str(tmp_path / "nope"), "is not a directory")


@pytest.mark.parametrize("method", ["sps", "hf_assisted"])
def test_a_method_needing_a_draft_without_one(method):
    with pytest.raises(ConfigError) as e:
        validate(cfg_of(f"+method={method}", "model=tiny_random"))
    _one_line_error(e, f"method {method!r} needs a draft model: pass draft=<name>")


def _draft_dir(path: Path, change: str | None) -> Path:
    """A local "draft" dir holding only config.json and a tokenizer (no weights): the check must not need them.
    ``change``: None (the target's tokenizer), ``vocab`` (one added token), ``eos`` (another EOS id)."""
    tok = load_tokenizer_only(named_config("tiny_random"))  # a fresh object: the cached tiny()'s stays untouched
    if change == "vocab":
        tok.add_tokens(["<pardec_extra_token>"])
    elif change == "eos":
        tok.eos_token = "<|im_start|>"
    tok.save_pretrained(path)
    LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(path)
    return path


@pytest.mark.parametrize("change,detail", [("vocab", "vocabularies differ"), ("eos", "eos_token_id 2 vs 1")])
def test_draft_with_another_tokenizer_fails_naming_both(tmp_path, change, detail):
    d = _draft_dir(tmp_path / "d", change)
    with pytest.raises(ConfigError) as e:
        validate(cfg_of("+method=sps", "model=tiny_random", "draft=local", f"draft.path={d}"))
    _one_line_error(e, "draft 'local'", str(d), "model 'tiny_random'", detail)


def test_draft_with_the_same_tokenizer_passes_without_weights(tmp_path):
    d = _draft_dir(tmp_path / "d", None)
    spec = validate(cfg_of("+method=sps", "model=tiny_random", "draft=local", f"draft.path={d}"))
    assert spec.draft.path == str(d)


@pytest.mark.parametrize("group", ["model", "draft"])
def test_hub_model_unavailable_offline_fails_fast(monkeypatch, group):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    over = [f"{group}=hub", f"{group}.path=pardec-tests/no-such-model"]
    over += ["model=tiny_random"] if group == "draft" else []
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        validate(cfg_of("+method=sps", "draft=tiny_random", *over))
    assert time.perf_counter() - t0 < 10
    _one_line_error(e, f"{group} 'hub'", "pardec-tests/no-such-model", "HF_HUB_OFFLINE", f"{group}=local")


def test_hub_model_without_network_fails_fast(monkeypatch):
    import huggingface_hub.constants

    from pardec.models import preflight

    for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(preflight, "hub_reachable", lambda timeout=3.0: False)
    with pytest.raises(ConfigError) as e:
        validate(cfg_of("+method=ar", "model=hub", "model.path=pardec-tests/no-such-model"))
    _one_line_error(e, "cannot be reached (no network)", "pardec-tests/no-such-model")


def test_run_with_a_draft_records_draft_stats_and_hf_peers(tmp_path):
    s = run(cfg_of("+method=sps", "draft=tiny_random", "bench.include_hf=true", *TINY, "n_samples=1"), tmp_path)
    recs = lines(tmp_path)
    assert {r["role"] for r in recs} == {"baseline", "method", "hf", "hf_pld", "hf_assisted"}
    for r in recs:
        assert {"draft_s", "drafted", "draft_accepted", "draft_forwards"} <= r.keys()
        if r["role"] in ("method", "hf_assisted"):
            assert r["draft_forwards"] > 0 and r["drafted"] >= r["draft_accepted"] >= 0 and r["draft_s"] > 0
            assert r["equal_to_baseline"] is True  # greedy, fp32: token for token
    assert s["draft"] == "tiny_random" and s["exactness"] == "distribution" and s["exact_match_rate"] == 1.0
    assert s["draft_forwards"] == sum(r["draft_forwards"] for r in recs if r["role"] == "method")
    drafted = sum(r["drafted"] for r in recs if r["role"] == "method")
    assert s["draft_acceptance"] == pytest.approx(
        sum(r["draft_accepted"] for r in recs if r["role"] == "method") / drafted)
    assert 0 < s["draft_time_share"] < 1 and s["mean_accepted_length"] >= 1.0
    assert set(s["peers"]) == {"hf", "hf_pld", "hf_assisted"}
    assert s["peers"]["hf_assisted"]["exact_match_rate"] == 1.0
    assert s["peers"]["hf_assisted"]["draft_acceptance"] is not None
    assert json.loads((tmp_path / "run.json").read_text())["draft"]["name"] == "tiny_random"


def test_hf_assisted_as_the_method(tmp_path):
    s = run(cfg_of("+method=hf_assisted", "draft=tiny_random", "method.num_assistant_tokens=3", *TINY,
                   "n_samples=1"), tmp_path)
    assert s["method"] == "hf_assisted" and s["exact_match_rate"] == 1.0 and s["draft_forwards"] > 0


@pytest.mark.slow  # starts `python -m evaluate`
def test_cli_missing_distilled_draft_is_one_line(tmp_path):
    p = run_cli("+method=sps", "model=tiny_random", "draft=smollm2_distilled", f"paths.output_dir={tmp_path}",
             f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert p.returncode == 2 and DISTILL_FIX in p.stderr and "Traceback" not in p.stderr
    assert len([x for x in p.stderr.splitlines() if x.startswith("error:")]) == 1
