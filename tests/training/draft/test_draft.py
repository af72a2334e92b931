"""Draft distillation on tiny random Llamas: the data stage (resume, refusal), the loss, the trainer, and
`python -m train +experiment=draft_tiny` end to end (generate -> train -> eval), then resumed from a checkpoint."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pardec import REPO_ROOT
from pardec.config import DatasetConfig, ModelConfig
from pardec.models.draft import build_draft
from pardec.models.loading import load_model
from pardec.train import run
from pardec.training.completions import (
    CompletionCollator,
    CompletionDataset,
    GenerateConfig,
    generate,
    generation_meta,
    greedy_batch,
    load_completions,
)
from pardec.training.draft.trainer import (
    DraftConfig,
    DraftTrainer,
    distill_token_loss,
)
from pardec.training.stages import Prompt, read_part
from tests.conftest import tiny
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


def test_python_docstrings_prompts():
    from pardec.tasks.base import build_task

    task = build_task(DatasetConfig(name="python_docstrings", split="train"))
    docs = task.docs()
    assert len(docs) > 200 and len({d["id"] for d in docs}) == len(docs) and docs == task.docs()
    assert docs[0]["id"] == "string.capwords"
    tok = tiny().tokenizer
    text = tok.decode(task.prompt_ids(docs[0], tok, chat=True))
    assert "Write a Python function `capwords(s, sep=None)`" in text and "<|im_start|>assistant" in text


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
    vocab = list(range(0, 49152, 7))
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


def test_config_errors():
    from pardec.config import ConfigError
    from pardec.train import validate

    for *ov, pattern in (["draft.layers=[0,3]", r"draft.layers=\[0, 3\] is out of range.*0..2"],
                         ["draft.layers=[]", "non-empty list"],
                         ["draft.vocab_size=1", "vocab_size=1 is out of range"],
                         ["stage=collect", "stage='collect' is not valid for a draft experiment.*generate, train"],
                         ["trainer.loss=rkl", "trainer.loss='rkl' is not valid"],
                         ["completions.sources=[]", "completions.sources is empty"],
                         ["+trainer.bogus=1", r"unknown key\(s\) \['bogus'\] in trainer"]):
        with pytest.raises(ConfigError, match=pattern):
            validate(_compose(["+experiment=draft_tiny", *ov]))
    assert Path(validate(_compose(["+experiment=draft_tiny"])).gen.out_dir).name == "train"
