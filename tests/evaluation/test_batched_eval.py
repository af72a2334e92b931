"""``evaluate ... batch_size=B`` (pardec.evaluation.batched): every role decodes its prompts as one batch, each prompt
a record as prompt-by-prompt runs write them (its tokens equal to the baseline's under greedy decoding), the summary's
``batch`` entry; multi-turn tasks turn by turn; resume after a kill; what batching cannot run refused before any model
loads."""

from __future__ import annotations

import json

import pytest

from pardec.config import ConfigError
from pardec.evaluation import run
from tests.evaluation.helpers import TINY, cfg_of, lines


def test_a_batched_run_writes_a_record_per_prompt_and_role(tmp_path):
    summary = run(cfg_of("+method=pld", *TINY, "n_samples=5", "batch_size=2", 'bench.also=["jacobi:block_size=4"]'),
                  tmp_path)
    recs = lines(tmp_path)
    assert len(recs) == 15 and {r["role"] for r in recs} == {"baseline", "method", "also:jacobi:block_size=4"}
    one = {r["id"]: r["tokens"] for r in lines_of_batch_one(tmp_path)}
    for r in recs:
        assert r["batch_size"] == 2 and r["wall_s"] > 0 and 0 < r["prefill_s"] <= r["wall_s"]
        assert r["tokens"] == one[r["id"]]  # every row as a prompt-by-prompt run decodes it
        if r["role"] != "baseline":
            assert r["equal_to_baseline"] is True
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["exact_match_rate"] == 1.0 and saved["n_samples"] == 5
    batch = saved["batch"]
    assert batch["batch_size"] == 2 and set(batch["roles"]) == {"baseline", "method", "also:jacobi:block_size=4"}
    for role in batch["roles"].values():
        assert role["tokens_per_s"] > 0 and role["latency"]["p95"] >= role["latency"]["p50"] > 0
    assert summary["batch"] == saved["batch"]


def lines_of_batch_one(tmp_path):
    """The same prompts decoded prompt by prompt (``ar``)."""
    one = tmp_path / "one"
    run(cfg_of("+method=ar", *TINY, "n_samples=5"), one)
    return lines(one)


def test_multi_turn_prompts_run_turn_by_turn(tmp_path):
    data = tmp_path / "mt.jsonl"
    data.write_text("".join(json.dumps({"question_id": i, "category": "writing",
                                        "turns": [f"Write about {w}.", "Now shorter."]}) + "\n"
                            for i, w in enumerate(["cats", "the sea and its many moods", "rain"])))
    run(cfg_of("+method=pld", *TINY, "dataset=mt_bench", f"dataset.path={data}", "batch_size=2",
               "perplexity.enabled=false"), tmp_path / "b")
    run(cfg_of("+method=pld", *TINY, "dataset=mt_bench", f"dataset.path={data}", "perplexity.enabled=false"),
        tmp_path / "s")
    batched, single = lines(tmp_path / "b"), lines(tmp_path / "s")
    key = lambda r: (r["id"], r["role"])  # noqa: E731
    assert {key(r): r["turn_tokens"] for r in batched} == {key(r): r["turn_tokens"] for r in single}
    assert all(len(r["turn_tokens"]) == 2 for r in batched)


def test_resume_after_a_kill_redoes_and_duplicates_nothing(tmp_path):
    args = ("+method=pld", *TINY, "n_samples=4", "batch_size=3")
    run(cfg_of(*args), tmp_path)
    full = lines(tmp_path)
    raw = (tmp_path / "results.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "results.jsonl").write_text("".join(raw[:5]) + raw[5][: len(raw[5]) // 2])  # a kill mid-write
    run(cfg_of(*args, "resume=true"), tmp_path)
    again = lines(tmp_path)
    keys = [(r["id"], r["role"]) for r in again]
    assert len(keys) == len(set(keys)) == len(full) == 8
    assert again[:5] == full[:5]
    assert sorted((r["id"], r["role"], r["tokens"]) for r in again) == sorted(
        (r["id"], r["role"], r["tokens"]) for r in full)
    with pytest.raises(ConfigError, match="cannot resume"):  # batch_size is part of the run's identity
        run(cfg_of("+method=pld", *TINY, "n_samples=4", "batch_size=2", "resume=true"), tmp_path)


@pytest.mark.parametrize(("overrides", "message"), [
    (["+method=hf_pld", "batch_size=2"], r"method: method 'hf_pld' has no batched implementation: batch_size > "
                                         r"1 runs ar, bild, dflash, eagle3, firp, jacobi, lookahead, medusa, "
                                         r"medusa_typical, mjgd, mjsd, ouroboros, pld, sdsat, spectr, sps"),
    (["+method=pld", "batch_size=2", "bench.include_hf=true"], r"bench.include_hf=true adds transformers' decoders"),
    (["+method=pld", "batch_size=2", "repeats=2"], r"batch_size=2 with repeats=2"),
    (["+method=pld", "batch_size=2", 'bench.also=["hf_pld"]'], r"bench.also entry 'hf_pld': method 'hf_pld' "
                                                                r"has no batched implementation"),
    (["+method=pld", "batch_size=0"], r"batch_size=0 is out of range: it must be an integer >= 1"),
    (["+method=pld", "batch_size=2", "draft_forward_impl=compiled"], r"forward_impl=auto / draft_forward_impl="
                                                                     r"compiled are batch-1 forwards"),
    (["+method=pld", "batch_size=2", "forward_impl=compiled", "model.attn_implementation=invariant"],
     r"forward_impl=compiled and model.attn_implementation=invariant: the invariant attention"),
])
def test_what_batching_cannot_run_is_refused_before_any_model_loads(tmp_path, monkeypatch, overrides, message):
    import pardec.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(ConfigError, match=message):
        run(cfg_of(*TINY, *overrides), tmp_path)
