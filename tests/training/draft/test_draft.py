"""Draft distillation on tiny random Llamas: the data stage (resume, refusal), the loss, the trainer, and
`python -m train +experiment=draft_tiny` end to end (generate -> train -> eval), then resumed from a checkpoint."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from pardec import REPO_ROOT
from pardec.config import ConfigError, DatasetConfig, ModelConfig
from pardec.models.draft import build_draft
from pardec.models.loading import load_model
from pardec.train import run
from pardec.training.completions import (
    CompletionCollator,
    CompletionDataset,
    GenerateConfig,
    Source,
    check_settings,
    generate,
    generation_meta,
    greedy_batch,
    grows,
    load_completions,
)
from pardec.training.draft.trainer import (
    DraftConfig,
    DraftTrainer,
    distill_token_loss,
)
from pardec.training.stages import Prompt, read_part
from tests.conftest import VOCAB, tiny
from tests.training.test_train_app import _compose

TEXTS = ["Hello", "def fibonacci(n):\n    return", "The quick brown fox jumps over the lazy dog. " * 3,
         "Natalia sold clips to 48 of her friends.", "1 2 3"]


def _prompts(tok) -> list[Prompt]:
    return [Prompt(i, f"src/doc{i}", tok(t)["input_ids"]) for i, t in enumerate(TEXTS)]


# ------------------------------------------------------------------------------------------- data stage
def test_greedy_batch_matches_single_prompts():
    lm = tiny()
    prompts = [p.ids for p in _prompts(lm.tokenizer)]
    single = [greedy_batch(lm.model, [p], 9, set(), 0)[0] for p in prompts]
    eos = {single[1][0][4]}  # row 1 stops at its 5th token
    batched = greedy_batch(lm.model, prompts, 9, eos, 0)
    for (ids, why), (ref, _) in zip(batched, single):
        stop = next((j for j, t in enumerate(ref) if t in eos), None)
        assert ids == (ref if stop is None else ref[: stop + 1])
        assert why == ("length" if stop is None else "eos")
    assert batched[1][1] == "eos" and len(batched[1][0]) <= 5


def test_greedy_batch_topk_is_the_targets_own_distribution():
    """The stored top-k of each completion position is the teacher-forced next-token distribution of the target
    over the whole vocabulary (the row that produced completion token j; greedy: its first id is that token)."""
    lm = tiny()
    prompts = [p.ids for p in _prompts(lm.tokenizer)]
    plain = greedy_batch(lm.model, prompts, 7, set(), 0)
    eos = {plain[1][0][3]}
    out = greedy_batch(lm.model, prompts, 7, eos, 0, topk=5)
    for p, (ids, why, (top_ids, top_lp)), (ref, _) in zip(prompts, out, plain):
        stop = next((j for j, t in enumerate(ref) if t in eos), None)
        assert ids == (ref if stop is None else ref[: stop + 1])  # the completions are unchanged
        assert why == ("length" if stop is None else "eos")
        assert len(top_ids) == len(top_lp) == len(ids) and all(len(r) == 5 for r in top_ids + top_lp)
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(torch.tensor([p + ids])).logits[0, len(p) - 1 : -1].float(), -1)
        want_lp, want_ids = logp.topk(5, -1)
        assert [r[0] for r in top_ids] == ids
        assert torch.allclose(torch.tensor(top_lp), want_lp, atol=2e-4)
        assert torch.equal(torch.tensor(top_ids)[:, 0], want_ids[:, 0])


def test_generate_stores_the_teacher_and_records_it_in_meta(tmp_path):
    lm = tiny()
    prompts = _prompts(lm.tokenizer)
    cfg = _gen(tmp_path, teacher_topk=3)
    meta = generation_meta(cfg, {"name": "tiny"}, set())
    assert meta["teacher_topk"] == 3 and "teacher_topk" not in generation_meta(_gen(tmp_path), {}, set())
    generate(cfg, lm.model, 0, set(), prompts, meta)
    for r in load_completions(cfg.out_dir):
        assert len(r["teacher_ids"]) == len(r["teacher_logprobs"]) == len(r["completion_ids"]) == 6
        assert [t[0] for t in r["teacher_ids"]] == r["completion_ids"]
        assert all(a >= b for row in r["teacher_logprobs"] for a, b in zip(row, row[1:]))
    with pytest.raises(FileExistsError, match="other settings"):  # a resumed run must keep k
        generate(_gen(tmp_path), lm.model, 0, set(), prompts, generation_meta(_gen(tmp_path), {"name": "tiny"}, set()))
    with pytest.raises(ConfigError, match=r"teacher_topk=-1 is out of range.*>= 0"):
        _gen(tmp_path, teacher_topk=-1)


def test_the_corpus_is_written_by_the_target_at_completions_dtype(tmp_path):
    from pardec.training.completions import generating_model

    fp32 = ModelConfig(name="tiny", source="tiny_random", path="x", dtype="fp32")
    assert generating_model(_gen(tmp_path), fp32) is fp32
    assert generating_model(_gen(tmp_path, dtype="fp32"), fp32) is fp32
    bf16 = generating_model(_gen(tmp_path, dtype="bf16"), fp32)
    assert bf16.dtype == "bf16" and {**bf16.identity(), "dtype": "fp32"} == fp32.identity()
    lm = tiny()
    lm16 = load_model(replace(lm.cfg, dtype="bf16"))
    assert next(lm16.model.parameters()).dtype == torch.bfloat16
    cfg = _gen(tmp_path, dtype="bf16")
    meta = generation_meta(cfg, lm16.cfg.identity(), set())
    assert meta["model"]["dtype"] == "bf16"
    generate(cfg, lm16.model, 0, set(), _prompts(lm.tokenizer), meta)
    with pytest.raises(FileExistsError, match=r"other settings.*bf16"):  # an fp32 target may not continue it
        generate(_gen(tmp_path), lm.model, 0, set(), _prompts(lm.tokenizer),
                 generation_meta(_gen(tmp_path), lm.cfg.identity(), set()))


def _gen(tmp_path, **kw) -> GenerateConfig:
    return GenerateConfig(**{"max_new_tokens": 6, "batch_size": 2, "out_dir": str(tmp_path / "gen"), **kw})


def test_generate_resumes_after_kill_and_refuses_other_settings(tmp_path):
    lm = tiny()
    prompts = _prompts(lm.tokenizer)
    ref_cfg = _gen(tmp_path / "ref")
    meta = generation_meta(ref_cfg, {"name": "tiny"}, set())
    stats = generate(ref_cfg, lm.model, 0, set(), prompts, meta)
    assert stats["complete"] and stats["prompts"] == 5 and stats["tokens"] == 30
    ref = load_completions(ref_cfg.out_dir)
    assert [r["index"] for r in ref] == list(range(5)) and ref[0]["source"] == "src"

    cfg = _gen(tmp_path)
    assert generate(cfg, lm.model, 0, set(), prompts, meta, stop_after=3) is None  # "killed" after 3 records
    part = tmp_path / "gen" / "part-0.jsonl"
    with part.open("a") as f:
        f.write('{"schema_version": 1, "id": "src/doc9", "prom')  # and a half-written line
    with pytest.raises(FileNotFoundError, match="stage=generate"):
        load_completions(cfg.out_dir)
    stats = generate(cfg, lm.model, 0, set(), prompts, meta)
    assert stats["complete"] and len(read_part(part)) == 5  # no duplicates, the cut line is gone
    drop = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in load_completions(cfg.out_dir)] == \
        [{k: v for k, v in r.items() if k not in drop} for r in ref]

    other = _gen(tmp_path, max_new_tokens=7)
    with pytest.raises(FileExistsError, match=r"other settings \(max_new_tokens was 6, now 7\).*completions.overwrite"):
        generate(other, lm.model, 0, set(), prompts, generation_meta(other, {"name": "tiny"}, set()))
    over = _gen(tmp_path, max_new_tokens=7, overwrite=True)
    assert generate(over, lm.model, 0, set(), prompts, generation_meta(over, {"name": "tiny"}, set()))["tokens"] == 35


def test_a_corpus_grows_in_place_and_keeps_its_records(tmp_path):
    """Raising a source's max_prompts (or appending a source) grows the corpus: only the new prompts are generated,
    the old records are kept byte for byte, and the merged file is renumbered in the new prompt order (== a fresh
    generation of the grown list). Lowering max_prompts or changing a dataset is still refused."""
    lm = tiny()
    tok = lm.tokenizer
    a, b = DatasetConfig(name="gsm8k", path="a.jsonl"), DatasetConfig(name="gsm8k", path="b.jsonl")

    def setup(na: int, nb: int, out: str):
        ids = [f"a/{i}" for i in range(na)] + [f"b/{i}" for i in range(nb)]
        texts = TEXTS[:na] + TEXTS[3:3 + nb]
        prompts = [Prompt(i, d, tok(t)["input_ids"]) for i, (d, t) in enumerate(zip(ids, texts))]
        cfg = _gen(tmp_path, out_dir=str(tmp_path / out), sources=[Source(a, na), Source(b, nb)])
        return cfg, prompts, generation_meta(cfg, {"name": "tiny"}, set())

    small = setup(2, 1, "gen")
    generate(small[0], lm.model, 0, set(), small[1], small[2])
    part = tmp_path / "gen" / "part-0.jsonl"
    before = part.read_text()
    assert [r["id"] for r in load_completions(small[0].out_dir)] == ["a/0", "a/1", "b/0"]

    big = setup(3, 2, "gen")
    assert grows(small[2], big[2]) and not grows(big[2], small[2]) and not grows(small[2], small[2])
    check_settings(big[0], big[2])  # passes: it only grows
    stats = generate(*big[:1], lm.model, 0, set(), big[1], big[2])
    assert stats["complete"] and stats["prompts"] == 5
    assert part.read_text().startswith(before) and len(read_part(part)) == 5  # 2 new records appended
    assert json.loads((tmp_path / "gen" / "meta.json").read_text())["sources"][0]["max_prompts"] == 3
    fresh = setup(3, 2, "fresh")
    generate(fresh[0], lm.model, 0, set(), fresh[1], fresh[2])
    drop = ("seconds",)
    got = [{k: v for k, v in r.items() if k not in drop} for r in load_completions(big[0].out_dir)]
    assert got == [{k: v for k, v in r.items() if k not in drop} for r in load_completions(fresh[0].out_dir)]
    assert [r["index"] for r in got] == list(range(5)) and got[3]["id"] == "b/0"  # b/0 was index 2

    shrunk = setup(2, 2, "gen")
    with pytest.raises(FileExistsError, match=r"sources.*completions.overwrite"):
        check_settings(shrunk[0], shrunk[2])
    with pytest.raises(FileExistsError, match="other settings"):
        generate(shrunk[0], lm.model, 0, set(), shrunk[1], shrunk[2])
    other = dict(big[2], sources=[dict(big[2]["sources"][0], dataset=asdict(b)), big[2]["sources"][1]])
    assert not grows(big[2], other)
    everything = dict(big[2], sources=[dict(s, max_prompts=None) for s in big[2]["sources"]])
    assert grows(big[2], everything) and not grows(everything, big[2])  # null: all documents


def test_python_docstrings_prompts():
    from pardec.tasks.base import build_task

    task = build_task(DatasetConfig(name="python_docstrings", split="train"))
    docs = task.docs()
    assert len(docs) > 200 and len({d["id"] for d in docs}) == len(docs) and docs == task.docs()
    assert docs[0]["id"] == "string.capwords"
    tok = tiny().tokenizer
    text = tok.decode(task.prompt_ids(docs[0], tok, chat=True))
    assert "Write a Python function `capwords(s, sep=None)`" in text and "<|im_start|>assistant" in text
    methods = build_task(DatasetConfig(name="python_docstrings", split="train", extra={"members": "methods"}))
    mdocs = methods.docs()
    assert len(mdocs) > 200 and not {d["id"] for d in mdocs} & {d["id"] for d in docs}  # no prompt twice
    first = mdocs[0]
    assert first["qualname"].endswith("." + first["name"]) and first["signature"].startswith("(self")
    text = tok.decode(methods.prompt_ids(first, tok, chat=True))
    assert f"Write a Python method `{first['qualname']}(self" in text
    plain = tok.decode(methods.prompt_ids(first, tok, chat=False))
    assert plain.startswith(f"class {first['qualname'].split('.')[0]}:\n    def {first['name']}(self")
    with pytest.raises(ConfigError, match=r"members='classes' is not valid.*functions, methods"):
        build_task(DatasetConfig(name="python_docstrings", extra={"members": "classes"}))


# ------------------------------------------------------------------------------------------- loss, trainer
def test_loss_properties():
    torch.manual_seed(0)
    teacher = torch.randn(2, 5, 11)
    assert torch.allclose(distill_token_loss(teacher.clone(), teacher, "fkl"), torch.zeros(2, 5), atol=1e-6)
    # shifting all logits of a position changes nothing: the teacher is renormalised over the kept ids
    assert torch.allclose(distill_token_loss(teacher + 3.0, teacher, "fkl"), torch.zeros(2, 5), atol=1e-5)
    student = torch.randn(2, 5, 11, requires_grad=True)
    fkl = distill_token_loss(student, teacher, "fkl")
    assert (fkl > 0).all()
    fkl.sum().backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    ce = distill_token_loss(student, teacher, "ce")
    want = torch.nn.functional.cross_entropy(student.reshape(-1, 11), teacher.argmax(-1).reshape(-1), reduction="none")
    assert torch.allclose(ce, want.view(2, 5))
    # tvd / jsd (DistillSpec): 0 at the teacher, shift-invariant, bounded, the hand-computed values, gradients flow
    p, q = teacher.softmax(-1), student.softmax(-1)
    for loss, bound in (("tvd", 1.0), ("jsd", math.log(2))):
        assert torch.allclose(distill_token_loss(teacher + 2.0, teacher, loss), torch.zeros(2, 5), atol=1e-6)
        got = distill_token_loss(student, teacher, loss)
        assert ((got > 0) & (got <= bound + 1e-6)).all()
    m = 0.5 * (p + q)
    want_jsd = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    assert torch.allclose(distill_token_loss(student, teacher, "tvd"), 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(distill_token_loss(student, teacher, "jsd"), want_jsd, atol=1e-6)
    student.grad = None
    distill_token_loss(student, teacher, "tvd").sum().backward()
    assert student.grad.abs().sum() > 0


def test_samples_mask_only_completion_positions():
    ds = CompletionDataset([{"prompt_ids": [1, 2, 3], "completion_ids": [7, 8]},
                            {"prompt_ids": [4], "completion_ids": [9, 10, 11]}], max_length=3)
    assert CompletionDataset(ds.records)[0] == {"input_ids": [1, 2, 3, 7], "loss_mask": [False, False, True, True]}
    assert ds[0] == {"input_ids": [2, 3, 7], "loss_mask": [False, True, True]} and ds.n_truncated == 1
    b = CompletionCollator(pad_id=0)([ds[0], ds[1]])
    assert b["input_ids"].tolist() == [[2, 3, 7], [4, 9, 10]]
    assert b["loss_mask"].tolist() == [[False, True, True], [True, True, True]]


def test_compute_loss_counts_completion_positions_only(tmp_path):
    lm = tiny()
    vocab = list(range(0, VOCAB, 7))
    records = [{"prompt_ids": lm.tokenizer(t)["input_ids"], "completion_ids": [5, 6, 7]} for t in TEXTS[:2]]
    ds = CompletionDataset(records)
    args = DraftConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no")
    student = build_draft(lm.model, [1], vocab)
    trainer = DraftTrainer(model=student, args=args, train_dataset=ds, data_collator=CompletionCollator(0),
                             teacher=copy.deepcopy(lm.model))  # the trainer freezes its teacher
    batch = CompletionCollator(0)([ds[0], ds[1]])
    loss = trainer.compute_loss(student, batch)
    want = []
    for r in records:  # by hand, one unpadded sequence at a time, completion positions only
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"][:-1]])
        n = len(r["completion_ids"])
        s = student(ids, draft_logits=True).logits[0, -n:]
        t = lm.model(ids).logits[0, -n:, vocab]
        want.append(distill_token_loss(s, t, "fkl"))
    assert torch.allclose(loss, torch.cat(want).mean(), atol=1e-5)
    loss.backward()
    assert student.lm_head.weight.grad is not None and not any(p.requires_grad for p in trainer.teacher.parameters())


def test_cached_teacher_samples_keep_the_rows_of_the_kept_positions():
    rec = {"prompt_ids": [1, 2, 3], "completion_ids": [7, 8, 9],
           "teacher_ids": [[7, 1], [8, 2], [9, 3]], "teacher_logprobs": [[-0.1, -3.0], [-0.2, -2.0], [-0.3, -1.5]]}
    short = {"prompt_ids": [4], "completion_ids": [5], "teacher_ids": [[5, 6]], "teacher_logprobs": [[-0.5, -1.0]]}
    ds = CompletionDataset([rec, short], max_length=3, teacher=True)
    assert ds[0] == {"input_ids": [3, 7, 8], "loss_mask": [True, True, True], "teacher_ids": [[7, 1], [8, 2], [9, 3]],
                     "teacher_logprobs": [[-0.1, -3.0], [-0.2, -2.0], [-0.3, -1.5]]}
    cut = CompletionDataset([rec], max_length=2, teacher=True)[0]  # the first completion position is cut away
    assert cut["loss_mask"] == [True, True] and cut["teacher_ids"] == [[8, 2], [9, 3]]
    assert "teacher_ids" not in CompletionDataset([rec])[0]  # only when asked
    b = CompletionCollator(0)([ds[1], ds[0]])
    assert b["teacher_ids"].tolist() == [[5, 6], [7, 1], [8, 2], [9, 3]]  # x[loss_mask]'s order
    assert b["input_ids"][b["loss_mask"]].tolist() == [4, 3, 7, 8]
    with pytest.raises(ValueError, match="mixes records with and without a cached teacher"):
        CompletionCollator(0)([ds[0], CompletionDataset([rec])[0]])


def _teacher_records(lm, k: int) -> list[dict]:
    """Records whose cached teacher is the target's teacher-forced top-k (k = V: the whole distribution)."""
    records = []
    for t in TEXTS[:2]:
        p, c = lm.tokenizer(t)["input_ids"], [5, 6, 7]
        with torch.no_grad():
            logp = torch.log_softmax(lm.model(torch.tensor([p + c[:-1]])).logits[0, -3:].float(), -1)
        lp, ids = logp.topk(k, -1)
        records.append({"prompt_ids": p, "completion_ids": c, "teacher_ids": ids.tolist(),
                        "teacher_logprobs": lp.tolist()})
    return records


def test_cached_teacher_loss_is_the_online_loss_on_its_top_k(tmp_path):
    """With the whole vocabulary cached, trainer.teacher=cached gives the online loss, logs and gradients; with
    k ids, the KL to the teacher renormalised on its top k ids that the draft keeps."""
    lm = tiny()
    vocab = list(range(0, VOCAB, 7))
    records = _teacher_records(lm, VOCAB)

    def trainer_for(teacher, recs):
        args = DraftConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                           teacher="online" if teacher is not None else "cached")
        ds = CompletionDataset(recs, teacher=teacher is None)
        student = build_draft(lm.model, [1], vocab)
        return DraftTrainer(model=student, args=args, train_dataset=ds, data_collator=CompletionCollator(0),
                            teacher=teacher), ds

    results = []
    for teacher in (copy.deepcopy(lm.model), None):
        trainer, ds = trainer_for(teacher, records)
        trainer.model.train()
        loss = trainer.compute_loss(trainer.model, CompletionCollator(0)([ds[0], ds[1]]))
        loss.backward()
        results.append((loss.detach(), trainer.model.lm_head.weight.grad.clone(), trainer._log_sums.clone()))
    (l_on, g_on, s_on), (l_ca, g_ca, s_ca) = results
    assert torch.allclose(l_on, l_ca, atol=1e-5) and torch.allclose(g_on, g_ca, atol=1e-6)
    assert torch.allclose(s_on, s_ca, atol=1e-4)  # kl, agreement, kept mass, count

    k = 40
    small = _teacher_records(lm, k)
    trainer, ds = trainer_for(None, small)
    batch = CompletionCollator(0)([ds[0], ds[1]])
    loss = trainer.compute_loss(trainer.model, batch)
    want = []
    for r in small:  # by hand: KL(p_S || q) with S = the top k ids the draft keeps, p renormalised on S
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"][:-1]])
        logq = torch.log_softmax(trainer.model(ids, draft_logits=True).logits[0, -3:].float(), -1)
        for row_ids, row_lp, lq in zip(r["teacher_ids"], r["teacher_logprobs"], logq):
            keep = [(vocab.index(i), lp) for i, lp in zip(row_ids, row_lp) if i in vocab]
            if keep:
                cols, lps = torch.tensor([c for c, _ in keep]), torch.log_softmax(torch.tensor([x for _, x in keep]), 0)
                want.append(float((lps.exp() * (lps - lq[cols].detach())).sum()))
    assert 0 < len(want) and torch.allclose(loss, torch.tensor(want).sum() / 6, atol=1e-5)  # / all 6 positions, found or not


def test_corpus_share_keeps_the_first_fraction_of_each_source():
    from pardec.training.completions import corpus_share

    records = [{"index": i, "source": "gsm8k" if i < 6 else "code"} for i in (5, 0, 3, 1, 2, 4, 8, 6, 7)]
    half = corpus_share(records, 0.5)
    assert sorted(r["index"] for r in half) == [0, 1, 2, 6, 7]  # ceil(3.0) of 6, ceil(1.5) of 3
    assert corpus_share(records, 1.0) is records and len(corpus_share(records, 0.01)) == 2


# ------------------------------------------------------------------------------------------- the app
@pytest.mark.slow  # training runs, one of them through `python -m train`
def test_draft_tiny_end_to_end_then_resume(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    cmd = [sys.executable, "-m", "train", "+experiment=draft_tiny", "threads=1", f"paths.data_dir={tmp_path}/data",
           f"paths.output_dir={tmp_path}/out"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = tmp_path / "out" / "train" / "runs" / "draft_tiny" / "default"
    ev = json.loads((run_dir / "draft_eval.json").read_text())
    assert 0.0 <= ev["agreement"]["gsm8k"]["agreement"] <= 1.0 and ev["agreement"]["gsm8k"]["positions"] == 16
    assert ev["cost"]["target_ms"] > 0 and ev["cost"]["draft_ms"] > 0
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["generate"]["complete"] and summary["train"]["samples"] == 6
    final = load_model(ModelConfig(name="local", source="local", path=str(run_dir / "final"), device="cpu"))
    keep = final.model.config.draft_vocab
    assert len(keep) == 512 and final.model.config.num_hidden_layers == 2 and final.model.config.use_cache
    logits = final.model(torch.tensor([[1, 2, 3, 4]])).logits  # [1, 4, V]
    assert logits[..., keep].isfinite().all() and logits.isfinite().all()
    assert final.tokenizer.eos_token_id in keep

    # train again with checkpoints, then resume from the latest one for one more step
    base = ["+experiment=draft_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out",
            "stage=train", "trainer.save_strategy=steps", "trainer.save_steps=1"]
    run(_compose(base), run_dir)
    run(_compose([*base, "trainer.max_steps=3", "trainer.resume_from_checkpoint=true"]), run_dir)
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]


def test_draft_tiny_trains_from_a_cached_teacher_without_the_target(tmp_path):
    """`trainer.teacher=cached` through the app: refused (naming the fix) on a corpus without top-k log-probs,
    trained from one with them."""
    from pardec.config import ConfigError

    base = ["+experiment=draft_tiny", f"paths.output_dir={tmp_path}/out", "trainer.teacher=cached"]
    run_dir = tmp_path / "out" / "run"
    run(_compose([*base, f"paths.data_dir={tmp_path}/plain", "stage=generate"]), run_dir)
    with pytest.raises(ConfigError, match=r"6 of 6 records .* have none.*completions.teacher_topk=<k>"):
        run(_compose([*base, f"paths.data_dir={tmp_path}/plain", "stage=train"]), run_dir)
    cached = [*base, f"paths.data_dir={tmp_path}/cached", "completions.teacher_topk=8"]
    run(_compose([*cached, "stage=generate"]), run_dir)
    run(_compose([*cached, "stage=train"]), run_dir)
    history = [h for h in json.loads((run_dir / "log_history.json").read_text()) if "loss" in h]
    assert (run_dir / "final" / "config.json").is_file()
    assert len(history) == 2 and all(0.0 < h["teacher_kept_mass"] <= 1.0 and h["loss"] > 0 for h in history)
    summary = json.loads((run_dir / "train_summary.json").read_text())  # stage by stage: both sections stay
    assert summary["stages"] == ["generate", "train"] and summary["generate"]["complete"]
    assert summary["train"]["samples"] == 6


def test_config_errors():
    from pardec.config import ConfigError
    from pardec.train import validate

    for *ov, pattern in (["draft.layers=[0,3]", r"draft.layers=\[0, 3\] is out of range.*0..2"],
                         ["draft.layers=[]", "non-empty list"],
                         ["draft.vocab_size=1", "vocab_size=1 is out of range"],
                         ["stage=collect", "stage='collect' is not valid for a draft experiment.*generate, train"],
                         ["trainer.loss=rkl", "trainer.loss='rkl' is not valid"],
                         ["trainer.teacher=stored", "trainer.teacher='stored' is not valid.*online, cached"],
                         ["completions.teacher_topk=-2", "teacher_topk=-2 is out of range"],
                         ["+completions.dtype=fp8", r"completions.dtype='fp8' is not valid.*fp32, bf16"],
                         ["+eval.dtype=bf16", r"eval.dtype='bf16' is not an option.*completions.dtype"],
                         ["draft.corpus_fraction=0", r"draft.corpus_fraction=0 is out of range.*\(0, 1\]"],
                         ["draft.corpus_fraction=1.5", "corpus_fraction=1.5 is out of range"],
                         ["completions.sources=[]", "completions.sources is empty"],
                         ["+trainer.bogus=1", r"unknown key\(s\) \['bogus'\] in trainer"]):
        with pytest.raises(ConfigError, match=pattern):
            validate(_compose(["+experiment=draft_tiny", *ov]))
    assert Path(validate(_compose(["+experiment=draft_tiny"])).gen.out_dir).name == "train"


def test_agreement_reports_top1_and_the_expected_sampled_acceptance():
    """agreement(): top-1 agreement and the mean of sum_v min(p_v, q_v) (1 - TVD) over the completion positions,
    checked against a hand computation from each model's own full forward; a draft that is the target gives 1 and 1."""
    from pardec.training.draft.trainer import agreement

    target, other = tiny(0).model, tiny(1).model
    records = [{"prompt_ids": [1, 5, 9], "completion_ids": [4, 7, 3]},
               {"prompt_ids": [1, 6], "completion_ids": [8, 2, 11, 12]}]
    same = agreement(target, target, records, pad_id=0, batch_size=2)
    assert same["positions"] == 7 and same["agreement"] == 1.0
    assert same["expected_acceptance_t1"] == pytest.approx(1.0, abs=1e-5)
    got = agreement(other, target, records, pad_id=0, batch_size=1)
    agree, overlap = [], []
    with torch.inference_mode():
        for r in records:
            ids = torch.tensor([r["prompt_ids"] + r["completion_ids"][:-1]])
            lo = len(r["prompt_ids"]) - 1  # the positions that predict completion tokens
            p = target(ids).logits[0, lo:].softmax(-1)
            q = other(ids).logits[0, lo:].softmax(-1)
            agree += (p.argmax(-1) == q.argmax(-1)).tolist()
            overlap += torch.minimum(p, q).sum(-1).tolist()
    assert got["positions"] == 7
    assert got["agreement"] == pytest.approx(sum(agree) / 7)
    assert got["expected_acceptance_t1"] == pytest.approx(sum(overlap) / 7, abs=1e-5)
    assert 0.0 < got["expected_acceptance_t1"] < 1.0


def test_a_corpus_with_the_teacher_serves_a_kind_that_needs_none(tmp_path):
    """One corpus for every drafter: a heads (or CLLM) run asks for no teacher top-k and reuses the draft's corpus,
    which cached it; it takes the corpus's k (a resumed generation keeps recording it) instead of refusing. An
    explicit k, a fresh directory and ``overwrite`` stay as they are."""
    from pardec.training.completions import with_corpus_topk

    lm = tiny()
    prompts = _prompts(lm.tokenizer)
    cached = _gen(tmp_path, teacher_topk=3)
    generate(cached, lm.model, 0, set(), prompts, generation_meta(cached, {"name": "tiny"}, set()))
    plain = with_corpus_topk(_gen(tmp_path))
    assert plain.teacher_topk == 3
    meta = generation_meta(plain, {"name": "tiny"}, set())
    generate(plain, lm.model, 0, set(), prompts, meta)  # accepted: every prompt done, nothing generated again
    assert len(load_completions(plain.out_dir)) == len(prompts)
    assert with_corpus_topk(_gen(tmp_path, teacher_topk=5)).teacher_topk == 5
    assert not with_corpus_topk(_gen(tmp_path, overwrite=True)).teacher_topk
    assert not with_corpus_topk(_gen(tmp_path / "fresh")).teacher_topk
