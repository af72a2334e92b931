"""pardec.evaluation.loop: end-to-end runs on tiny_random (records, summary, peers, bench.also), resume after a
kill, skips, repeats, NaN logits, an empty dataset; and run_document on its own."""

from __future__ import annotations

import json

import pytest
import torch

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
    # forward_impl=auto (the default) named as it resolved: lean for a Llama on the CPU
    assert (saved["kv_cache"], saved["forward_impl"]) == ("preallocated", "lean") and saved["int8_recipe"] is None


@pytest.mark.slow
def test_an_int8_run_says_how_its_int8_model_was_built_and_fp32_scores_it(tmp_path, monkeypatch):
    import pardec.metrics.perplexity as ppl_mod
    from pardec.models.quant.int8 import is_int8

    scorers = []
    real = ppl_mod.completion_nll
    monkeypatch.setattr("pardec.evaluation.loop.completion_nll", lambda m, *a: scorers.append(m) or real(m, *a))
    summary = run(cfg_of("+method=pld", "dtype=int8", "+model.int8_smooth=0.4", *TINY), tmp_path)
    assert summary["dtype"] == "int8"
    assert summary["int8_recipe"] == {"scheme": "per_token", "smooth_alpha": 0.4, "skip": []}
    # its completions are scored by the fp32 target, so perplexity compares across dtypes and shows int8's cost
    assert summary["perplexity_scorer"] == "tiny_random fp32" and summary["baseline_perplexity"] > 0
    assert scorers and not any(is_int8(m) for m in scorers)
    assert all(next(m.parameters()).dtype == torch.float32 for m in scorers)
    assert summary["draft_int8_recipe"] is None  # no draft
    drafted = run(cfg_of("+method=sps", "draft=tiny_random", "dtype=int8", *TINY), tmp_path / "sps")
    assert drafted["int8_recipe"]["scheme"] == "per_token"  # the target's default recipe
    assert drafted["draft_int8_recipe"] == {"scheme": "weight_only", "smooth_alpha": None, "skip": []}  # drafts'
    scorers.clear()
    plain = run(cfg_of("+method=pld", *TINY), tmp_path / "fp32")
    assert plain["perplexity_scorer"] == "tiny_random fp32" and scorers  # fp32 runs: the target itself


@pytest.mark.slow
def test_a_run_on_the_lean_forward_equals_generate_and_says_so(tmp_path):
    summary = run(cfg_of("+method=pld", "bench.include_hf=true", "forward_impl=lean", *TINY), tmp_path)
    assert summary["forward_impl"] == "lean" and summary["exact_match_rate"] == 1.0
    assert summary["peers"]["hf"]["exact_match_rate"] == 1.0  # transformers' generate() on its own forward
    with pytest.raises(ConfigError, match="forward_impl"):
        run(cfg_of("+method=pld", "forward_impl=fast", *TINY), tmp_path / "bad")


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


def test_kv_cache_dynamic_gives_the_preallocated_caches_tokens(tmp_path):
    texts = {}
    for kind in ("preallocated", "dynamic"):
        run(cfg_of("+method=sps", *TINY, "draft=tiny_random", "n_samples=2", f"kv_cache={kind}"), tmp_path / kind)
        texts[kind] = {(r["id"], r["role"]): r["tokens"] for r in lines(tmp_path / kind)}
    assert texts["preallocated"] == texts["dynamic"] and len(texts["dynamic"]) == 4
    with pytest.raises(ConfigError, match="kv_cache='static' is not valid; choose one of: preallocated, dynamic"):
        run(cfg_of("+method=ar", *TINY, "kv_cache=static"), tmp_path / "bad")


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


@pytest.mark.slow
def test_the_warm_up_leaves_no_state_in_the_timed_decoders(tmp_path):
    """The warm-up generates on the first timed prompt; Ouroboros's warm_start pool (kept across prompts) must not
    start the timed run with what it harvested there: the records equal those of a run without a warm-up."""
    cpu_sized = ("method.gamma=4", "method.window=4", "method.level=4", "method.guess_set=4")  # bench.py's CPU_SIZED
    args = ("+method=ouroboros", "method.warm_start=true", *cpu_sized, "draft=tiny_random", *TINY[:2], "max_new_tokens=24",
            "bench.warmup_tokens=24", "perplexity.enabled=false")
    run(cfg_of(*args, "bench.warmup=0"), tmp_path / "cold")
    run(cfg_of(*args, "bench.warmup=1"), tmp_path / "warm")
    keep = ("id", "role", "tokens", "target_forwards", "draft_forwards", "accepted", "extras")
    cold, warm = ([{k: r[k] for k in keep} for r in lines(tmp_path / d)] for d in ("cold", "warm"))
    assert warm == cold  # before the fix the warm run's first prompt drafted from phrases of its own warm-up


@pytest.mark.slow
def test_repeats_of_a_prompt_start_from_the_same_carried_state(tmp_path):
    """Ouroboros's warm_start pool is carried across prompts: every repeat of a prompt starts from the pool before its
    first repeat (not from one holding the prompt's own phrases), and the next prompt continues from the pool after
    the first repeat, so the records of each repeat equal those of a run with repeats=1."""
    cpu_sized = ("method.gamma=4", "method.window=4", "method.level=4", "method.guess_set=4")
    args = ("+method=ouroboros", "method.warm_start=true", *cpu_sized, "draft=tiny_random", *TINY[:1],
            "n_samples=2", "max_new_tokens=16", "bench.warmup=0", "perplexity.enabled=false")
    run(cfg_of(*args, "repeats=1"), tmp_path / "once")
    run(cfg_of(*args, "repeats=3"), tmp_path / "thrice")
    keep = ("id", "role", "tokens", "target_forwards", "draft_forwards", "accepted", "extras")
    once = [{k: r[k] for k in keep} for r in lines(tmp_path / "once")]
    thrice = [{k: r[k] for k in keep} for r in lines(tmp_path / "thrice")]
    assert len(thrice) == 3 * len(once) == 3 * 2 * 2  # 2 prompts x (baseline, method) x 3 repeats
    for rep in range(3):  # records are written prompt by prompt, repeat by repeat, role by role (extras: pool_size)
        assert [x for j, x in enumerate(thrice) if (j // 2) % 3 == rep] == once, rep
    sizes = [r["extras"]["pool_size"] for r in once if r["role"] == "method"]
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]  # the pool is carried from prompt to prompt


# ------------------------------------------------------------------------------------------ divergence margin
def test_divergence_margin_is_read_where_the_records_part(tmp_path):
    """A stub target with hand-set logits: the margin is computed on the baseline's context at the first differing
    position of the first differing turn (a multi-turn task: that turn's prompt is built from the earlier answers)."""
    import torch

    from pardec.evaluation import divergence_logits

    class Stub(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(32, 4)
            self.seen: list[list[int]] = []

        def get_input_embeddings(self):
            return self.embed

        def forward(self, input_ids, use_cache=True, logits_to_keep=0):
            self.seen.append(input_ids[0].tolist())
            logits = torch.zeros(1, input_ids.shape[1], 32)
            logits[0, -1, [3, 9, 4]] = torch.tensor([2.5, 6.0, 5.25])  # top-1 id 9, top-2 id 4: margin 0.75
            return type("Out", (), {"logits": logits[:, -logits_to_keep:] if logits_to_keep else logits})

    class TwoTurns:
        def prompt_ids(self, doc, tok, chat, history):
            assert list(history) == ["first answer"][: len(history)]
            return [1, 2, 10 + len(history)]

    model = Stub()
    base = {"turn_tokens": [[5, 6], [7, 8, 9]], "text": ["first answer", "second"]}
    rec = {"turn_tokens": [[5, 6], [7, 4]]}
    out = divergence_logits(model, TwoTurns(), {}, None, True, rec, base)
    assert model.seen == [[1, 2, 11, 7]]  # turn 2's prompt, then the baseline's tokens before the first difference
    assert out == {"divergence_margin": 0.75, "divergence_top": [[9, 6.0], [4, 5.25]]}
    # a record that stops where the baseline goes on parts there
    divergence_logits(model, TwoTurns(), {}, None, True, {"turn_tokens": [[5, 6], [7]]}, base)
    assert model.seen[-1] == [1, 2, 11, 7]
    divergence_logits(model, TwoTurns(), {}, None, True, {"turn_tokens": [[5, 1], [7]]}, base)
    assert model.seen[-1] == [1, 2, 10, 5]  # first turn differs


def test_divergence_margin_of_a_tiny_llama_with_a_known_margin():
    """The tiny Llama's LM head rebuilt so that at the context the logits are 5 (id a), 3 (id b) and 0 elsewhere:
    the margin read is 2, and the context fed is the baseline's prompt + tokens before the divergence."""
    import copy

    import torch

    from pardec.config import DatasetConfig
    from pardec.evaluation import divergence_logits
    from pardec.tasks.base import build_task
    from tests.conftest import tiny

    lm = tiny(0)
    task = build_task(DatasetConfig(name="humaneval"))
    doc = task.docs()[0]
    prompt = task.prompt_ids(doc, lm.tokenizer, lm.chat, [])
    base_tokens = [11, 22, 33, 44]
    ctx = torch.tensor([prompt + base_tokens[:2]])
    model = copy.deepcopy(lm.model)
    with torch.no_grad():
        h = model(input_ids=ctx, output_hidden_states=True).hidden_states[-1][0, -1]  # after the final norm
        a, b = 123, 4567
        model.lm_head.weight.zero_()
        model.lm_head.weight[a] = 5.0 * h / h.dot(h)
        model.lm_head.weight[b] = 3.0 * h / h.dot(h)
    rec = {"turn_tokens": [base_tokens[:2] + [b]]}
    out = divergence_logits(model, task, doc, lm.tokenizer, lm.chat, rec, {"turn_tokens": [base_tokens],
                                                                          "text": "x"})
    assert out["divergence_margin"] == pytest.approx(2.0, abs=1e-5)
    assert [t for t, _ in out["divergence_top"]] == [a, b]
    assert [v for _, v in out["divergence_top"]] == pytest.approx([5.0, 3.0], abs=1e-5)


def test_a_lossy_method_records_its_divergences_and_the_summary_counts_them(tmp_path):
    """BiLD with a random draft that is never unsure (fallback 0) nor rolled back: its tokens leave the target's."""
    s = run(cfg_of("+method=bild", "draft=tiny_random", "method.fallback_threshold=0.0",
                   "method.rollback_threshold=50", *TINY[:4], "n_samples=2", "perplexity.enabled=false"), tmp_path)
    base, method = ([r for r in lines(tmp_path) if r["role"] == role] for role in ("baseline", "method"))
    for b, m in zip(base, method):
        assert b["divergence_margin"] is None and m["first_divergence"] is not None
        (top1, l1), (_, l2) = m["divergence_top"]
        assert m["divergence_margin"] == pytest.approx(l1 - l2) and m["divergence_margin"] >= 0
        assert top1 == b["tokens"][m["first_divergence"]]  # greedy fp32: the target's top-1 is the baseline's token
    assert s["n_divergences"] == 2 and s["n_near_ties"] == 0 and s["near_tie_ulps"] == 4


def test_the_summary_says_whether_bf16_linears_ran_prepacked(tmp_path):
    from pardec.models.quant import packed

    bf16 = run(cfg_of("+method=sps", "draft=tiny_random", "dtype=bf16", *TINY, "n_samples=1"), tmp_path / "bf16")
    assert bf16["prepacked_linears"] == {"target": packed.supported(), "draft": packed.supported()}
    off = run(cfg_of("+method=pld", "dtype=bf16", "+model.cpu_prepack=false", *TINY, "n_samples=1"),
              tmp_path / "off")
    assert off["prepacked_linears"] == {"target": False, "draft": None}


@pytest.mark.slow
def test_a_run_uses_its_own_forwards_cost_table_and_says_which(tmp_path, monkeypatch):
    """A lean forward's table pads a lean run and feeds ``pld``'s cost-aware draft length; another forward's table
    at the same precision does not; the summary names the table."""
    import pardec.models.cost as cost
    from pardec.models.cost import CostTable

    monkeypatch.setattr(cost, "DATA_DIR", tmp_path / "data")
    args = ("+method=pld", "method.num_pred_by_cost=true", "forward_impl=lean", *TINY)
    with pytest.raises(ConfigError, match="num_pred_by_cost=true needs this machine's forward-cost table"):
        run(cfg_of(*args), tmp_path / "none")
    CostTable("tiny_random", "fp32", 100, {1: 1.0, 2: 1.2, 4: 1.3, 8: 1.5}).save()
    with pytest.raises(ConfigError, match="num_pred_by_cost=true needs this machine's forward-cost table"):
        run(cfg_of(*args), tmp_path / "hf_table")  # (transformers' table describes another forward's rows)
    CostTable("tiny_random", "fp32-lean", 100, {1: 1.0, 2: 1.1, 4: 1.1}).save()
    summary = run(cfg_of(*args), tmp_path / "lean_table")
    assert summary["cost_table"] == "fp32-lean" and summary["exact_match_rate"] == 1.0
    assert run(cfg_of("+method=pld", "forward_impl=hf", *TINY), tmp_path / "hf")["cost_table"] == "fp32"
    # forward_impl=auto (the default) resolves before the table is looked up: lean's table on this CPU
    assert run(cfg_of("+method=pld", *TINY), tmp_path / "auto")["cost_table"] == "fp32-lean"


def test_the_warm_up_keeps_the_decoders_that_carry_nothing(tmp_path, monkeypatch):
    """After the warm-up, only decoders that carry state from one generation to the next (``carried()`` not None:
    Ouroboros's warm_start pool) are built again; the others keep what their warm-up built (a compiled DFlash
    round's graph, compiled once per drafter, would otherwise compile again inside the first timed prompt)."""
    import pardec.evaluation.loop as loop

    built: list[str] = []
    real = loop.build_decoder

    def counting(name, *args, **kwargs):
        built.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(loop, "build_decoder", counting)
    run(cfg_of("+method=pld", *TINY, "bench.include_hf=false", "max_new_tokens=8", "perplexity.enabled=false",
               "bench.warmup=1"), tmp_path / "run")
    assert sorted(built) == ["ar", "pld"]  # once each: neither carries anything
    built.clear()
    run(cfg_of("+method=ouroboros", "method.warm_start=true", "method.gamma=4", "method.window=4", "method.level=4",
               "method.guess_set=4", "draft=tiny_random", *TINY[:2], "bench.include_hf=false", "max_new_tokens=8",
               "perplexity.enabled=false", "bench.warmup=1"), tmp_path / "ouro")
    assert sorted(built) == ["ar", "ouroboros", "ouroboros"]  # the pool's owner again after the warm-up
