"""Trajectory collection on tiny random Llamas: fixed points = greedy AR, resume, merge, schema errors."""

from __future__ import annotations

import json

import pytest
import torch

from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.training.cllm.augment import augment_in_place, augment_states, has_degenerate_repetition
from pardec.training.cllm.collect import (
    CollectConfig,
    collect,
    collection_meta,
    jacobi_stream,
)
from pardec.training.cllm.trajectories import SCHEMA_VERSION, TrajectoryError, load_trajectories
from pardec.training.stages import Prompt, read_part
from tests.conftest import tiny
from tests.training.cllm.helpers import jacobi_trajectories

TEXTS = ["Hello", "def fibonacci(n):\n    return", "The quick brown fox jumps over the lazy dog. " * 3,
         "Natalia sold clips to 48 of her friends.", "1 2 3"]


def _prompts(tok) -> list[Prompt]:
    return [Prompt(i, f"doc{i}", tok(t)["input_ids"]) for i, t in enumerate(TEXTS)]


def _greedy(cm, ids, max_new, eos: set[int]) -> list[int]:
    return build_decoder("ar", cm, None).generate(ids, max_new, Stopper(eos_ids=eos)).tokens


@pytest.mark.parametrize("block_size", [4, 7])
def test_fixed_points_are_greedy_ar_in_a_padded_batch(block_size):
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = [p.ids for p in _prompts(lm.tokenizer)]
    max_new = 19  # not a multiple of the block size: the last block is shorter
    ref = [_greedy(cm, p, max_new, set()) for p in prompts]
    eos = {ref[1][9]}  # make row 1 stop early (and any other row that emits this token)
    ref_eos = [_greedy(cm, p, max_new, eos) for p in prompts]
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = jacobi_trajectories(cm, prompts, block_size, max_new, eos, gens)
    for r, full, want in zip(out, ref, ref_eos):
        for b in r["blocks"]:
            assert b["states"][-1] == b["fixed_point"]
            assert all(len(s) == len(b["fixed_point"]) for s in b["states"])
            assert all(a != c for a, c in zip(b["states"], b["states"][1:]))  # every recorded state is new
            assert len(b["states"]) <= len(b["fixed_point"]) + 1
        fps = [t for b in r["blocks"] for t in b["fixed_point"]]
        assert fps == full[: len(fps)]
        assert r["answer_ids"] == want
        assert r["stop_reason"] == ("eos" if len(want) < max_new or want[-1] in eos else "length")
        assert r["unconverged"] == 0
    assert out[1]["stop_reason"] == "eos" and len(out[1]["answer_ids"]) <= 10


def _plain_jacobi(model, prompt, block_size, max_new, eos, gen, guess_from="context") -> dict:
    """Uncached reference: every iteration recomputes prompt + committed tokens + the whole block. A block's initial
    guess: n uniform draws (one randint) from the prompt + the answer so far, or from the prompt alone."""
    seq, produced, blocks, answer = list(prompt), 0, [], []
    while True:
        n = min(block_size, max_new - produced)
        pool = seq if guess_from == "context" else list(prompt)
        guess = [pool[i] for i in torch.randint(len(pool), (n,), generator=gen).tolist()]
        states, forwards = [guess], 0
        while True:
            with torch.no_grad():
                new = model(torch.tensor([seq + guess[:-1]])).logits[0, len(seq) - 1 :].argmax(-1).tolist()
            forwards += 1
            if new == guess:
                break
            states.append(new)
            guess = new
        blocks.append({"states": states, "fixed_point": guess, "forwards": forwards})
        seq += guess
        produced += n
        stop = next((j for j, t in enumerate(guess) if t in eos), None)
        answer += guess if stop is None else guess[: stop + 1]
        if stop is not None or produced >= max_new:
            return {"answer_ids": answer, "blocks": blocks, "stop": "eos" if stop is not None else "length"}


@pytest.mark.parametrize("batch_size,guess_from", [(1, "context"), (2, "context"), (5, "context"), (2, "prompt")])
def test_continuous_batching_records_plain_jacobi_states_with_less_work(batch_size, guess_from):
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = [p.ids for p in _prompts(lm.tokenizer)]
    block, max_new = 6, 17
    full = [_greedy(cm, p, max_new, set()) for p in prompts]
    eos = {full[3][4], full[0][13]}  # rows stop at different blocks, so rows leave and others join mid-run
    ref = [_plain_jacobi(lm.model, p, block, max_new, eos, torch.Generator().manual_seed(i), guess_from)
           for i, p in enumerate(prompts)]
    run, tokens = [], [0]
    forward = cm.forward

    def counting(ids, *a, **kw):
        if not kw.get("last_only"):  # block forwards (prefills run last_only)
            tokens[0] += ids.numel()
        return forward(ids, *a, **kw)
    cm.forward = counting
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    for key, r in jacobi_stream(cm, zip(range(5), prompts, gens), batch_size, block, max_new, eos,
                                guess_from=guess_from):
        run.append(key)
        want = ref[key]
        assert [b["states"] for b in r["blocks"]] == [b["states"] for b in want["blocks"]]
        assert r["answer_ids"] == want["answer_ids"] and r["stop_reason"] == want["stop"]
    assert sorted(run) == list(range(5))
    plain = sum(b["forwards"] * len(b["fixed_point"]) for r in ref for b in r["blocks"])
    assert tokens[0] < 0.7 * plain  # cached final positions, no confirming forward, converged rows parked


def _cfg(tmp_path, **kw) -> CollectConfig:
    return CollectConfig(block_size=5, max_new_tokens=12, batch_size=2, out_dir=str(tmp_path / "traj"), **kw)


def test_collect_resume_after_kill_reproduces_the_records(tmp_path):
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = _prompts(lm.tokenizer)
    ref_cfg = _cfg(tmp_path / "ref")
    meta = collection_meta(ref_cfg, {"model": "tiny"}, set())
    stats = collect(ref_cfg, cm, set(), prompts, meta)
    assert stats["complete"] and stats["kept"] == len(prompts) and stats["blocks"] == 3 * len(prompts)
    ref = load_trajectories(ref_cfg.out_dir)
    assert [r["index"] for r in ref] == list(range(len(prompts)))

    cfg = _cfg(tmp_path)
    assert collect(cfg, cm, set(), prompts, meta, stop_after=3) is None  # "killed" after 3 records
    part = tmp_path / "traj" / "part-0.jsonl"
    written = [r["id"] for r in read_part(part)]
    assert len(written) == 3
    other_rank = next(f"doc{i}" for i in range(len(prompts)) if f"doc{i}" not in written)
    with part.open("a") as f:
        f.write('{"schema_version": 1, "id": "doc3", "prom')  # and a half-written line
    # a second "rank" of an earlier 2-process run wrote one of the others already
    ref_lines = (tmp_path / "ref" / "traj" / "part-0.jsonl").read_text().splitlines()
    (tmp_path / "traj" / "part-1.jsonl").write_text(next(x for x in ref_lines if f'"id":"{other_rank}"' in x) + "\n")
    stats = collect(cfg, cm, set(), prompts, meta)
    assert stats["complete"] and stats["prompts"] == len(prompts)
    assert load_trajectories(cfg.out_dir) == ref
    ids = [r["id"] for r in read_part(part)]
    assert ids[:3] == written and sorted(ids) == sorted({f"doc{i}" for i in range(5)} - {other_rank})  # no duplicate

    other = collection_meta(_cfg(tmp_path, seed=1), {"model": "tiny"}, set())
    with pytest.raises(FileExistsError, match="other settings"):
        collect(cfg, cm, set(), prompts, other)


def test_sharded_collection_merges_sorted(tmp_path):
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = _prompts(lm.tokenizer)
    cfg = _cfg(tmp_path)
    meta = collection_meta(cfg, {"model": "tiny"}, set())
    assert collect(cfg, cm, set(), prompts, meta, rank=1, world=2) is None
    stats = collect(cfg, cm, set(), prompts, meta, rank=0, world=2)
    assert stats["complete"]
    recs = load_trajectories(cfg.out_dir)
    assert [r["index"] for r in recs] == list(range(len(prompts)))
    assert {r["id"] for r in read_part(tmp_path / "traj" / "part-1.jsonl")} == {"doc1", "doc3"}


def test_cleaning_drops_repetitive_answers(tmp_path):
    assert has_degenerate_repetition([5] * 9, max_ngram=1, max_repeats=8)
    assert not has_degenerate_repetition([5] * 8, max_ngram=1, max_repeats=8)
    assert has_degenerate_repetition([1, 2, 3] + [7, 8] * 4, max_ngram=2, max_repeats=3)
    assert not has_degenerate_repetition([1, 2, 3] + [7, 8] * 3, max_ngram=2, max_repeats=3)
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = _prompts(lm.tokenizer)
    cfg = _cfg(tmp_path, clean=True, clean_max_ngram=12, clean_max_repeats=1)  # any repeat at all
    stats = collect(cfg, cm, set(), prompts, collection_meta(cfg, {"model": "tiny"}, set()))
    kept = load_trajectories(cfg.out_dir)
    assert stats["kept"] == len(kept) and stats["kept"] + stats["dropped"].get("repetition", 0) == len(prompts)
    assert all(not has_degenerate_repetition(r["answer_ids"], 12, 1) for r in kept)


def test_augmentation_adds_corrected_copies_and_keeps_the_trajectory():
    import random

    states = [[1, 2, 3, 4], [9, 2, 8, 8], [9, 9, 2, 9], [9, 9, 9, 9]]
    blocks = [{"states": [list(s) for s in states], "fixed_point": [9, 9, 9, 9]}]
    augment_states(blocks, 1.0, random.Random(0))
    assert blocks[0]["states"] == states  # the visited states stay true Jacobi successors
    assert blocks[0]["augmented"] == [[1, 9, 9, 9], [9, 2, 9, 9]]  # [9, 9, 2, 9] has nothing after its first error
    augment_states(blocks, 0.0, random.Random(0))
    assert blocks[0]["augmented"] == []


def test_in_place_augmentation_corrects_half_the_wrong_tokens_after_the_first():
    """CLLM §3.2.1 as the official generate_trajectory.py applies it: every state but the last two, w wrong tokens
    -> w // 2 draws with replacement from the wrong positions after the first, corrected in place."""
    import random

    fp = [9, 9, 9, 9, 9]
    states = [[1, 2, 9, 9, 9],   # w = 2: one draw from {1}: position 1 corrected, position 0 (the first) kept
              [9, 3, 9, 4, 9],   # w = 2: one draw from {3}
              [9, 9, 5, 9, 9],   # w = 1: w // 2 = 0 draws, unchanged
              [9, 9, 7, 9, 6],   # the state before the fixed point: never corrected (the official loop skips it)
              list(fp)]
    blocks = [{"states": [list(s) for s in states], "fixed_point": list(fp)}]
    augment_in_place(blocks, random.Random(0))
    assert blocks[0]["states"] == [[1, 9, 9, 9, 9], [9, 3, 9, 9, 9], [9, 9, 5, 9, 9], [9, 9, 7, 9, 6], fp]
    assert "augmented" not in blocks[0]
    # w = 4: 2 draws with replacement from {1, 2, 3}: both distinct with probability 2/3 (2 corrected), the same
    # with 1/3 (1 corrected): E = 2 * 2/3 + 1 * 1/3 = 5/3 tokens corrected; position 0 never
    counts = []
    for seed in range(3000):
        b = [{"states": [[1, 2, 3, 4, 9], [8, 8, 8, 8, 8], list(fp)], "fixed_point": list(fp)}]
        augment_in_place(b, random.Random(seed))
        s = b[0]["states"][0]
        assert s[0] == 1 and s[4] == 9 and b[0]["states"][1] == [8] * 5
        counts.append(sum(a != c for a, c in zip(s, [1, 2, 3, 4, 9])))
    assert set(counts) == {1, 2}
    assert abs(sum(counts) / len(counts) - 5 / 3) < 0.04


def test_collect_config_refuses_unknown_schemes():
    from pardec.config import ConfigError

    with pytest.raises(ConfigError, match=r"collect.augment='paper' is not valid; choose one of: in_place, copies, "
                                          r"none"):
        CollectConfig(augment="paper")
    with pytest.raises(ConfigError, match=r"collect.guess_from='output' is not valid; choose one of: context, "
                                          r"prompt"):
        CollectConfig(guess_from="output")
    with pytest.raises(ConfigError, match=r"collect.augment_prob=0.0 is out of range: it must be in \(0, 1\]"):
        CollectConfig(augment="copies", augment_prob=0.0)


def test_collected_in_place_states_keep_their_first_error_and_the_last_two(tmp_path):
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = _prompts(lm.tokenizer)
    plain, aug = _cfg(tmp_path / "plain", augment="none"), _cfg(tmp_path / "aug")
    assert aug.augment == "in_place" and aug.guess_from == "context"  # the paper's defaults
    for cfg in (plain, aug):
        collect(cfg, cm, set(), prompts, collection_meta(cfg, {"model": "tiny"}, set()))
    changed = 0
    for a, b in zip(load_trajectories(plain.out_dir), load_trajectories(aug.out_dir)):
        assert a["answer_ids"] == b["answer_ids"]
        for x, y in zip(a["blocks"], b["blocks"]):
            fp = x["fixed_point"]
            assert y["fixed_point"] == fp and y["states"][-2:] == x["states"][-2:]
            for s, t in zip(x["states"][:-2], y["states"][:-2]):
                wrong = [j for j in range(len(fp)) if s[j] != fp[j]]
                fixed = [j for j in range(len(fp)) if s[j] != t[j]]
                assert all(t[j] == fp[j] for j in fixed) and wrong[0] not in fixed
                assert len(fixed) <= len(wrong) // 2
                changed += bool(fixed)
    assert changed > 0


def test_schema_errors_name_the_file_and_fields(tmp_path):
    f = tmp_path / "trajectories.jsonl"
    with pytest.raises(TrajectoryError, match="does not exist"):
        load_trajectories(f)
    good = {"schema_version": SCHEMA_VERSION, "id": "a", "prompt_ids": [1], "answer_ids": [2],
            "blocks": [{"states": [[3], [2]], "fixed_point": [2]}]}
    f.write_text(json.dumps(good) + "\n" + json.dumps({"schema_version": SCHEMA_VERSION, "id": "b"}) + "\n")
    with pytest.raises(TrajectoryError, match=r"trajectories.jsonl, line 2: missing field\(s\) \['prompt_ids'"):
        load_trajectories(f)
    f.write_text(json.dumps({**good, "schema_version": 1}) + "\n")  # written before augmentation moved out
    with pytest.raises(TrajectoryError, match="schema_version 1"):
        load_trajectories(tmp_path)
    f.write_text(json.dumps({**good, "blocks": [{"states": [[3]], "fixed_point": [2]}]}) + "\n")
    with pytest.raises(TrajectoryError, match="not the fixed point"):
        load_trajectories(f)
    f.write_text("{not json\n")
    with pytest.raises(TrajectoryError, match="line 1: malformed JSON"):
        load_trajectories(f)


def _hashes(root) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_refused_collection_changes_nothing_and_stays_refused(tmp_path):
    from dataclasses import asdict, replace

    from pardec.config import DatasetConfig, ModelConfig

    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = _prompts(lm.tokenizer)[:2]
    cfg = _cfg(tmp_path)
    model = ModelConfig(name="tiny_random", source="tiny_random")
    dataset = DatasetConfig(name="gsm8k", path="/data/gsm8k.jsonl")
    meta = collection_meta(cfg, {"model": model.identity(), "dataset": asdict(dataset)}, set())
    assert collect(cfg, cm, set(), prompts, meta)["complete"]
    before = _hashes(tmp_path / "traj")
    for change, diff in [({"model": replace(model, seed=1)}, "model.seed was 0, now 1"),
                         ({"model": replace(model, adapter="/lora")}, "model.adapter was None, now '/lora'"),
                         ({"dataset": replace(dataset, prompt_style="base")},
                          "dataset.prompt_style was 'auto', now 'base'"),
                         ({"dataset": replace(dataset, extra={"shots": 2})}, "dataset.extra.shots was None, now 2")]:
        ident = {"model": change.get("model", model).identity(), "dataset": asdict(change.get("dataset", dataset))}
        for _ in range(2):  # refused, and refused again
            with pytest.raises(FileExistsError) as e:
                collect(cfg, cm, set(), prompts, collection_meta(cfg, ident, set()))
            assert diff in str(e.value) and "collect.overwrite=true" in str(e.value), str(e.value)
            assert _hashes(tmp_path / "traj") == before


def test_train_collect_refuses_other_settings_before_the_model_loads(tmp_path, monkeypatch):
    from dataclasses import asdict, replace

    from pardec.config import Ranks
    from pardec.train import validate
    from pardec.training.cllm import CLLMKind
    from tests.training.test_train_app import _tiny

    spec = validate(_tiny(tmp_path, "stage=collect"))
    out = tmp_path / "data" / "trajectories" / "cllm_tiny"
    out.mkdir(parents=True)
    old = {"model": replace(spec.model, seed=5).identity(), "dataset": asdict(spec.dataset)}
    (out / "meta.json").write_text(json.dumps(collection_meta(spec.collect, old, {2})))
    before = _hashes(out)

    class Loaded(Exception):
        pass

    def load_model(cfg):
        raise Loaded

    monkeypatch.setattr("pardec.training.cllm.load_model", load_model)
    with pytest.raises(FileExistsError, match=r"model.seed was 5, now 0\); pass collect.overwrite=true"):
        CLLMKind().stage_collect(spec, tmp_path, Ranks())
    assert _hashes(out) == before
    same = {"model": spec.model.identity(), "dataset": asdict(spec.dataset)}
    (out / "meta.json").write_text(json.dumps(collection_meta(spec.collect, same, {2})))
    with pytest.raises(Loaded):  # the same settings pass the early check (EOS ids are checked after loading)
        CLLMKind().stage_collect(spec, tmp_path, Ranks())
