"""The AR rows' whole teacher answers (issue #25): collected answers extended from the completions corpus, matched by
prompt ids; mismatches, missing prompts and another teacher; the kind's generate stage (resume, skip)."""

from __future__ import annotations

import json

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.training.cllm.answers import check_same_teacher, extend_answers, whole_answers
from pardec.training.cllm.data import TrajectoryDataset
from pardec.training.completions import GenerateConfig, generate, generation_meta, load_completions
from pardec.training.losses import IGNORE_INDEX
from pardec.training.stages import Prompt
from tests.conftest import tiny
from tests.training.cllm.helpers import jacobi_trajectories

TEXTS = ["Hello", "def fibonacci(n):\n    return", "Natalia sold clips to 48 of her friends.", "1 2 3"]
COLLECTED, WHOLE = 8, 16  # answer tokens collected (2 blocks of 4) / the whole answers' cap


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Trajectories of 8 tokens and a completions corpus of 16 (HF generate, batched, left-padded) of the same
    prompts; the EOS is a token that prompt 0's greedy answer first emits after the collected blocks."""
    lm = tiny()
    cm = CachedModel(lm.model)
    prompts = [lm.tokenizer(t)["input_ids"] for t in TEXTS]
    ar = build_decoder("ar", cm, None)
    full = ar.generate(prompts[0], WHOLE, Stopper(eos_ids=set())).tokens
    eos = {next(t for k, t in enumerate(full) if k >= COLLECTED + 2 and t not in full[:k])}
    greedy = [ar.generate(p, WHOLE, Stopper(eos_ids=eos)).tokens for p in prompts]
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = jacobi_trajectories(cm, prompts, 4, COLLECTED, eos, gens, batch_size=3)
    records = [{"id": f"doc{i}", "index": i, "prompt_ids": p, **r} for i, (p, r) in enumerate(zip(prompts, out))]
    cfg = GenerateConfig(max_new_tokens=WHOLE, batch_size=3, out_dir=str(tmp_path_factory.mktemp("gen") / "c"))
    # the corpus lists the prompts in another order, with one the collection does not have
    listed = [Prompt(0, "src/extra", lm.tokenizer("An extra prompt")["input_ids"])]
    listed += [Prompt(i + 1, f"src/doc{j}", prompts[j]) for i, j in enumerate([3, 1, 0, 2])]
    assert generate(cfg, lm.model, lm.tokenizer.pad_token_id, eos, listed, generation_meta(cfg, {"m": 1}, eos))
    return records, load_completions(cfg.out_dir), greedy, eos


def test_whole_answers_run_past_the_collected_blocks_to_the_eos(setup):
    records, completions, greedy, eos = setup
    assert all(r["stop_reason"] == "length" and len(r["answer_ids"]) == COLLECTED for r in records)
    kept, stats = extend_answers(records, completions, WHOLE)
    assert [r["ar_answer_ids"] for r in kept] == greedy  # the teacher's whole greedy answers
    assert greedy[0][-1] in eos and len(greedy[0]) > COLLECTED + 2
    assert stats["stopped_short"] == stats["extended"] == len(records) and stats["mismatched"] == 0
    assert stats["ending_with_eos"] == sum(g[-1] in eos for g in greedy) >= 1
    assert stats["ar_tokens"] == sum(map(len, greedy)) and stats["collected_tokens"] == COLLECTED * len(records)

    # the AR row of every sample of record 0: prompt + whole answer, every answer token a label, the EOS included
    ds = TrajectoryDataset(kept, "global", "all")
    rec = kept[0]
    n_prompt, n_ar = len(rec["prompt_ids"]), len(rec["prompt_ids"]) + len(greedy[0])
    samples = [ds[i] for i in range(len(ds)) if ds.items[i][0] == 0]
    assert len(samples) == len(rec["blocks"])
    for s in samples:
        assert s["ids"][:n_ar] == rec["prompt_ids"] + greedy[0] and set(s["segment"][:n_ar]) == {0}
        labels = s["ar_targets"][: n_ar - 1]
        assert labels == [IGNORE_INDEX] * (n_prompt - 1) + greedy[0]  # the tokens past the blocks, the EOS last
        assert s["ar_targets"][n_ar - 1 :] == [IGNORE_INDEX] * (len(s["ids"]) - n_ar + 1)
    # the consistency part is what it was with the collected answers: same pairs relative to each segment
    plain = TrajectoryDataset(records, "global", "all")
    for i in range(len(ds)):
        a, b = ds[i], plain[i]
        assert a["context"] == b["context"]
        shift = a["segments"][0] - b["segments"][0]
        assert shift == len(ar_row(kept, ds, i)) - len(ar_row(records, plain, i))
        assert a["pairs"] == [(p + shift, t) for p, t in b["pairs"]]


def test_long_ar_rows_lose_the_answer_after_the_block_before_the_prefix(setup):
    records, completions, greedy, _ = setup
    kept, _ = extend_answers(records, completions, WHOLE)
    rec = kept[2]  # the longest prompt
    n_prompt, whole = len(rec["prompt_ids"]), rec["ar_answer_ids"]
    ar = rec["prompt_ids"] + whole
    fits = TrajectoryDataset([rec], "global", "all", max_length=n_prompt + COLLECTED)  # the collected part fits
    assert fits.n_truncated == len(fits) == 2
    for i in range(len(fits)):
        s = fits[i]
        start = 4 * fits.items[i][1]
        assert s["context"] == n_prompt + start  # the whole prefix: nothing cut on the left
        assert s["ids"][: s["segment"].count(0)] == ar[: n_prompt + COLLECTED]  # the tail past the blocks is cut
    tight = TrajectoryDataset([rec], "global", "all", max_length=6)  # shorter than prompt + block: cut on the left
    for i in range(len(tight)):
        s, b = tight[i], tight.items[i][1]
        n_row, end = s["segment"].count(0), n_prompt + 4 * (b + 1)
        assert n_row == 6 and s["ids"][:n_row] == ar[end - 6 : end] and s["context"] == 2  # prefix's last 2 + block


def ar_row(records, ds, i) -> list[int]:
    rec = records[ds.items[i][0]]
    return rec["prompt_ids"] + (rec.get("ar_answer_ids") or rec["answer_ids"])


def test_a_disagreeing_completion_leaves_the_collected_answer(setup, caplog):
    records, completions, greedy, _ = setup
    bad = [dict(c) for c in completions]
    doc1 = next(c for c in bad if c["id"] == "src/doc1")
    doc1["completion_ids"] = doc1["completion_ids"][:3] + [doc1["completion_ids"][3] + 1] + doc1["completion_ids"][4:]
    short = next(c for c in bad if c["id"] == "src/doc2")
    short["completion_ids"] = short["completion_ids"][:5]  # agrees, but ends within the collected answer
    with caplog.at_level("WARNING"):
        kept, stats = extend_answers(records, bad, WHOLE)
    assert kept[1]["ar_answer_ids"] == records[1]["answer_ids"]  # the collected answer wins
    assert kept[2]["ar_answer_ids"] == records[2]["answer_ids"]  # nothing to extend with
    assert [r["ar_answer_ids"] for r in (kept[0], kept[3])] == [greedy[0], greedy[3]]
    assert stats["mismatched"] == 1 and stats["mismatched_first"] == ["doc1@3"] and stats["extended"] == 2
    assert "1 of 4 trajectory records disagree" in caplog.text and "doc1 at answer position 3" in caplog.text

    # a mismatch past the collected answer is no mismatch: its start agrees
    late = [dict(c) for c in completions]
    late[1]["completion_ids"] = late[1]["completion_ids"][: COLLECTED + 1] + [7, 7]
    assert extend_answers(records, late, WHOLE)[1]["mismatched"] == 0

    # a record that stops short with no completion of its prompt: an error, not a silent short AR row
    with pytest.raises(ConfigError, match=r"1 of 4 trajectory records .* no completion .*first ids: doc3\).*"
                                          r"ar_answer=collected"):
        extend_answers(records, [c for c in completions if c["id"] != "src/doc3"], WHOLE)
    # records that do not stop short of the cap need no completion
    kept, stats = extend_answers(records, [], COLLECTED)
    assert stats["stopped_short"] == stats["extended"] == 0 and all(r["ar_answer_ids"] == r["answer_ids"] for r in kept)

    # the dataset refuses an AR answer that does not hold the collected one
    wrong = {**records[0], "ar_answer_ids": [5] + records[0]["answer_ids"]}
    with pytest.raises(ValueError, match="ar_answer_ids do not start with its collected answer_ids"):
        TrajectoryDataset([wrong])


def test_looping_whole_answers_are_left_out_under_cleaning(setup):
    records, completions, _, _ = setup
    loop = [dict(c) for c in completions]
    doc0 = next(c for c in loop if c["id"] == "src/doc0")
    doc0["completion_ids"] = doc0["completion_ids"][:COLLECTED] + [9] * 8
    kept, stats = extend_answers(records, loop, WHOLE, repeats=(2, 4))
    assert [r["id"] for r in kept] == ["doc1", "doc2", "doc3"] and stats["dropped_repetition"] == 1
    assert len(extend_answers(records, loop, WHOLE)[0]) == 4  # no cleaning: kept


def test_the_corpus_must_be_the_collections_teacher(tmp_path, setup):
    records, _, _, _ = setup
    traj, corpus = tmp_path / "traj", tmp_path / "corpus"
    traj.mkdir()
    corpus.mkdir()
    model = {"name": "m", "dtype": "fp32", "device": "cpu", "seed": 0}
    (traj / "meta.json").write_text(json.dumps({"model": model, "eos_ids": [2]}))
    (corpus / "meta.json").write_text(json.dumps({"model": {**model, "device": "cuda"}, "eos_ids": [2]}))
    check_same_teacher(traj, corpus)  # another device: numerics only
    (corpus / "meta.json").write_text(json.dumps({"model": {**model, "dtype": "bf16"}, "eos_ids": [2, 3]}))
    with pytest.raises(ConfigError, match=r"not of the teacher .*eos_ids was \[2\], now \[2, 3\]; model.dtype was "
                                          r"'fp32', now 'bf16'\); generate them"):
        whole_answers(records, traj, corpus, WHOLE)
    assert whole_answers(records, traj, corpus, COLLECTED)[1]["extended"] == 0  # nothing stops short: not read
    with pytest.raises(FileNotFoundError, match="stage=generate"):
        whole_answers(records, traj, tmp_path / "none", WHOLE)


# ------------------------------------------------------------------------------------------- the kind's stages
def test_generate_stage_resumes_skips_and_feeds_the_train_stage(tmp_path, monkeypatch):
    from pardec.config import Ranks
    from pardec.models import loading
    from pardec.train import validate
    from pardec.training.cllm import CLLMKind
    from pardec.training.cllm.trajectories import load_trajectories
    from pardec.training.completions import run_generation
    from tests.training.test_train_app import _tiny

    kind = CLLMKind()
    spec = validate(_tiny(tmp_path))
    assert kind.stages == ("collect", "generate", "train", "eval") and spec.ar_answer == "whole"
    assert (spec.collect.max_new_tokens, spec.gen.max_new_tokens) == (12, 20)
    assert [s.max_prompts for s in spec.gen.sources] == [None] and spec.gen.sources[0].dataset == spec.dataset
    kind.stage_collect(spec, tmp_path, Ranks())
    lm = loading.load_model(spec.model)
    assert run_generation(spec.gen, lm, 0, 1, None, stop_after=2) is None  # "killed" after 2 of 6 prompts
    loaded = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda cfg: loaded.append(cfg) or real(cfg))
    stats = kind.stage_generate(spec, tmp_path, Ranks())  # resumed
    assert stats["complete"] and stats["prompts"] == 6 and loaded
    resumed = load_completions(spec.gen.out_dir)

    fresh = validate(_tiny(tmp_path, f"completions.out_dir={tmp_path}/fresh"))
    kind.stage_generate(fresh, tmp_path, Ranks())
    drop = lambda rs: [{k: v for k, v in r.items() if k != "seconds"} for r in rs]  # noqa: E731
    assert drop(load_completions(fresh.gen.out_dir)) == drop(resumed)

    records = load_trajectories(spec.train_data)
    kept, answers = whole_answers(records, spec.train_data, spec.gen.out_dir, spec.gen.max_new_tokens)
    assert answers["extended"] == 6 and answers["mismatched"] == 0  # collector and HF generate agree in fp32
    by_prompt = {tuple(c["prompt_ids"]): c["completion_ids"] for c in resumed}
    assert all(r["ar_answer_ids"] == by_prompt[tuple(r["prompt_ids"])] for r in kept)

    loaded.clear()
    for override, why in [("ar_answer=collected", "ar_answer=collected"),
                          ("completions.max_new_tokens=12", "completions.max_new_tokens=12 <= collect.max_new_tokens")]:
        assert why in kind.stage_generate(validate(_tiny(tmp_path, override)), tmp_path, Ranks())["skipped"]
    assert not loaded  # skipped before loading anything
    with pytest.raises(ConfigError, match="ar_answer='full' is not valid; choose one of: whole, collected"):
        validate(_tiny(tmp_path, "ar_answer=full"))
    other = validate(_tiny(tmp_path, "completions.max_new_tokens=24"))
    with pytest.raises(FileExistsError, match=r"max_new_tokens was 20, now 24\); pass completions.overwrite=true"):
        kind.stage_generate(other, tmp_path, Ranks())  # refused before the model loads
    assert not loaded


def test_ar_clean_defaults_to_collect_clean_and_sets_the_train_stages_rule(tmp_path, monkeypatch):
    """``ar_clean`` (default: ``collect.clean``) decides alone whether the train stage drops records whose whole
    answer loops; ``collect.clean`` keeps cleaning the collection."""
    from pardec.train import validate
    from pardec.training.cllm import CLLMKind
    from tests.training.test_train_app import _tiny

    class Stop(Exception):
        pass

    seen: list = []

    def fake(records, traj, corpus, cap, repeats=None):
        seen.append(repeats)
        raise Stop

    monkeypatch.setattr("pardec.training.cllm.whole_answers", fake)
    monkeypatch.setattr("pardec.training.cllm.training_args", lambda cls, spec, run_dir: cls(output_dir=str(run_dir)))
    monkeypatch.setattr("pardec.training.cllm.load_trajectories", lambda path: [{"id": "d0"}, {"id": "d1"}])
    kind = CLLMKind()
    for overrides, clean, expect in [((), False, None),
                                     (("collect.clean=true",), True, (8, 8)),
                                     (("collect.clean=true", "ar_clean=false"), True, None),
                                     (("ar_clean=true", "collect.clean_max_repeats=5"), False, (8, 5))]:
        spec = validate(_tiny(tmp_path, *overrides))
        assert (spec.collect.clean, spec.ar_clean) == (clean, expect is not None)
        with pytest.raises(Stop):
            kind.stage_train(spec, tmp_path / "run", None)
        assert seen.pop() == expect
    with pytest.raises(ConfigError, match="ar_clean='yes' must be bool"):
        validate(_tiny(tmp_path, "ar_clean=yes"))


def test_last_block_tail_puts_the_rest_of_the_answer_in_one_sample_per_record(setup):
    """``ar_tail="last_block"`` (the CPU recipe): the record's last sample holds the whole answer, its other samples
    the collected one; the consistency pairs are those of the collected rows in every sample."""
    records, completions, greedy, _ = setup
    kept, _ = extend_answers(records, completions, WHOLE)
    ds = TrajectoryDataset(kept, "global", "all", ar_tail="last_block")
    plain = TrajectoryDataset(records, "global", "all")
    for r, rec in enumerate(kept):
        mine = [i for i in range(len(ds)) if ds.items[i][0] == r]
        assert len(mine) >= 2
        for i in mine:
            answer = greedy[r] if i == mine[-1] else rec["answer_ids"]
            n_ar = len(rec["prompt_ids"]) + len(answer)
            s = ds[i]
            assert s["ids"][:n_ar] == rec["prompt_ids"] + answer and set(s["segment"][:n_ar]) == {0}
            assert s["ar_targets"][len(rec["prompt_ids"]) - 1 : n_ar - 1] == answer
            if i != mine[-1]:
                assert s == plain[i]  # exactly the collected-answer sample
    with pytest.raises(ValueError, match="ar_tail='first' is not valid; choose one of: every_block, last_block"):
        TrajectoryDataset(kept, ar_tail="first")
