"""SDSAT training on a tiny random Llama: rows and masks of the collator, the trainer's loss against per-row
forwards (Eq. 9), the evaluation's one-forward layout against separate forwards, `+experiment=sdsat_tiny` end to
end (mask -> train -> eval), resume, LoRA, and bad input refused before any model loads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pardec.config import ConfigError, ModelConfig
from pardec.metrics.perplexity import completion_nll
from pardec.models import adaptive
from pardec.models.loading import load_model
from pardec.train import run, validate
from pardec.training.sdsat.masked import MASK_SCHEMA_VERSION
from pardec.training.sdsat.trainer import (
    SDSATCollator,
    SDSATConfig,
    SDSATDataset,
    SDSATTrainer,
    adaptive_report,
    score_sequence,
)
from tests.conftest import VOCAB
from tests.training.test_train_app import _compose

A = 900  # a stand-in adaptive id in the hand-made records
RECORDS = [  # n = 8, start 3: plain labels at t = 2..6; masked positions 3, 4 (window) and 6
    {"ids": [10, 11, 12, 13, 14, 15, 16, 17], "start": 3, "masked_ids": [10, 11, 12, A, A, 15, A, 17], "masked": 3},
    {"ids": [20, 21, 22, 23, 24], "start": 0, "masked_ids": [20, A, 22, 23, 24], "masked": 1},  # padded by 3
]


def _overrides(tmp_path, *extra: str) -> list[str]:
    return ["+experiment=sdsat_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out", *extra]


def _tiny_with_token():
    lm = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu"))
    ids = adaptive.attach_adaptive(lm.model, lm.tokenizer, adaptive.adaptive_tokens(3, False), 3, False)
    return lm, ids


def test_collator_rows_and_masks():
    ds = SDSATDataset(RECORDS, max_length=64)
    b = SDSATCollator(0)([ds[0], ds[1]])
    assert b["input_ids"].shape == (4, 7) and b["targets"].shape == (2, 7)
    assert b["input_ids"][0].tolist() == RECORDS[0]["ids"][:-1] and b["input_ids"][2].tolist() == \
        RECORDS[0]["masked_ids"][:-1]
    assert b["input_ids"][3].tolist() == [20, A, 22, 23, 0, 0, 0]  # right padding
    assert b["targets"][0].tolist() == RECORDS[0]["ids"][1:]
    assert b["plain_mask"].tolist() == [[False, False, True, True, True, True, True], [True] * 4 + [False] * 3]
    assert b["masked_mask"].tolist() == [[False, False, False, True, True, False, True], [False, True] + [False] * 5]
    cut = SDSATDataset(RECORDS[:1], max_length=5)  # cut from the left: start moves with the tokens
    assert cut.n_truncated == 1 and cut[0]["input_ids"] == [13, 14, 15, 16]
    assert cut[0]["plain_mask"] == [True] * 4 and cut[0]["masked_mask"] == [True, True, False, True]


def test_trainer_loss_is_eq9_over_separate_rows(tmp_path):
    lm, (aid,) = _tiny_with_token()
    model = lm.model
    recs = [{**r, "masked_ids": [aid if t == A else t for t in r["masked_ids"]]} for r in RECORDS]
    ds = SDSATDataset(recs, max_length=64)
    batch = SDSATCollator(0)([ds[0], ds[1]])
    p_sum = p_n = m_sum = m_n = 0.0
    with torch.no_grad():
        for s in (ds[0], ds[1]):  # unpadded, one row at a time
            tgt = torch.tensor(s["targets"])
            plain = F.cross_entropy(model(torch.tensor([s["input_ids"]])).logits[0], tgt, reduction="none")
            masked = F.cross_entropy(model(torch.tensor([s["masked_input_ids"]])).logits[0], tgt, reduction="none")
            p_sum += float(plain[torch.tensor(s["plain_mask"])].sum())
            p_n += sum(s["plain_mask"])
            m_sum += float(masked[torch.tensor(s["masked_mask"])].sum())
            m_n += sum(s["masked_mask"])
    assert (p_n, m_n) == (9, 4)
    args = SDSATConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", mask_weight=0.5)
    trainer = SDSATTrainer(model=model, args=args, train_dataset=ds, data_collator=SDSATCollator(0))
    model.train()
    loss = trainer.compute_loss(model, batch)
    assert float(loss.detach()) == pytest.approx(0.5 * (p_sum / p_n + 0.5 * m_sum / m_n), rel=1e-4)
    window = trainer.compute_loss(model, batch, num_items_in_batch=torch.tensor([2 * 9, 2 * 4]))  # a 2x window
    assert float(window.detach()) == pytest.approx(0.5 * float(loss.detach()), rel=1e-4)
    logs = {"loss": 1.0}
    trainer.log(logs)  # both training calls summed: the same token means
    assert logs["plain_loss"] == pytest.approx(p_sum / p_n, rel=1e-4)
    assert logs["masked_loss"] == pytest.approx(m_sum / m_n, rel=1e-4)
    model.eval()


def test_trainer_runs_the_lm_head_only_where_a_row_trains(tmp_path):
    """Positions no row trains (both prompts, the padding tail) get no logits: the loss equals the full-logits one."""
    from pardec.training.losses import sdsat_loss

    lm, (aid,) = _tiny_with_token()
    model = lm.model
    recs = [{**RECORDS[0], "masked_ids": [aid if t == A else t for t in RECORDS[0]["masked_ids"]]},
            {"ids": [20, 21, 22, 23, 24], "start": 3, "masked_ids": [20, 21, 22, aid, 24], "masked": 1}]
    ds = SDSATDataset(recs, max_length=64)
    batch = SDSATCollator(0)([ds[0], ds[1]])
    args = SDSATConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = SDSATTrainer(model=model, args=args, train_dataset=ds, data_collator=SDSATCollator(0))
    seen = []
    handle = model.lm_head.register_forward_hook(lambda mod, a, out: seen.append(tuple(out.shape)))
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        full = model(input_ids=batch["input_ids"]).logits
    handle.remove()
    want = sdsat_loss(full, batch["targets"], batch["plain_mask"], batch["masked_mask"]).total
    assert seen[0] == (4, 5, model.config.vocab_size) and seen[1] == (4, 7, model.config.vocab_size)  # t = 2..6 of 7
    assert float(loss) == pytest.approx(float(want), rel=1e-5)


def test_one_forward_evaluation_matches_separate_forwards():
    lm, ids_a = _tiny_with_token()
    model = lm.model
    ids = list(range(300, 314))  # n = 14, labels from 4
    s = score_sequence(model, ids, 4, ids_a, False, 3, stride=4)  # anchors t = 3, 7, 11
    nll, n = completion_nll(model, ids[:4], ids[4:])
    assert s["tokens"] == n == 10 and s["nll"] == pytest.approx(nll, rel=1e-4)
    with torch.no_grad():
        plain = model(torch.tensor([ids])).logits[0].argmax(-1)
        for a, t in enumerate([3, 7, 11]):
            alone = model(torch.tensor([ids[: t + 1] + ids_a * 3])).logits[0, t + 1 :].argmax(-1)
            assert s["guess"][a].tolist() == alone.tolist()
    assert s["truth"].tolist() == [[305, 306, 307], [309, 310, 311], [313, -1, -1]]
    assert s["model_arg"][1].tolist() == plain[8:11].tolist() and s["model_arg"][2, 1:].tolist() == [-1, -1]
    rep = adaptive_report(torch.tensor([[1, 2, 9], [1, 9, 3]]), torch.tensor([[1, 2, 3], [1, 2, -1]]),
                          torch.tensor([[1, 2, 3], [1, 9, -1]]))
    assert rep["accuracy"] == [1.0, 0.5, 0.0] and rep["accuracy_vs_model"] == [1.0, 1.0, 0.0]
    assert rep["full_depth_anchors"] == 1 and rep["expected_tokens_per_loop"] == 3.0


def test_tiny_end_to_end(tmp_path):
    run_dir = tmp_path / "out" / "run"
    summary = run(_compose(_overrides(tmp_path)), run_dir)
    assert summary["mask"]["complete"] and summary["mask"]["records"] == 6 and summary["mask"]["masked_positions"] > 0
    train = summary["train"]
    assert train["steps"] == 2 and train["samples"] == 6 and not train["lora"]
    history = json.loads((run_dir / "log_history.json").read_text())  # the loss curves, both parts logged
    assert [h["step"] for h in history if "plain_loss" in h and "masked_loss" in h] == [1, 2]
    final = run_dir / "final"
    sdsat = json.loads((final / "config.json").read_text())["sdsat"]
    assert sdsat["adaptive_tokens"] == [adaptive.ADAPTIVE_TOKEN] and sdsat["max_span"] == 3 and not sdsat["diverse"]
    lm = load_model(ModelConfig(name="local", source="local", path=str(final), device="cpu"))  # evaluate's loader
    assert lm.tokenizer.convert_tokens_to_ids(adaptive.ADAPTIVE_TOKEN) == sdsat["adaptive_ids"][0] == train["adaptive_ids"][0]
    assert lm.model.get_input_embeddings().weight.shape[0] == len(lm.tokenizer) and lm.model.config.use_cache
    ev = json.loads((run_dir / "sdsat_eval.json").read_text())
    overall = ev["overall"]
    assert overall["sequences"] == 2 and overall["tokens"] > 0 and overall["ppl_ratio"] > 0
    assert len(overall["adaptive"]["accuracy"]) == 3 and overall["adaptive"]["anchors"] > 0
    assert set(ev["per_source"]) == {"ref:gsm8k"}
    assert json.loads((run_dir / "train_summary.json").read_text())["eval"]["ppl_ratio"] == overall["ppl_ratio"]


@pytest.mark.slow  # two training runs
def test_resume_continues_from_the_checkpoint(tmp_path):
    """Four steps straight equal two steps, a stop, and two resumed steps (constant lr, same data order)."""
    run(_compose(_overrides(tmp_path, "stage=mask")), tmp_path / "out" / "mask")
    base = _overrides(tmp_path, "stage=train", "trainer.save_strategy=steps", "trainer.save_steps=2",
                      "trainer.lr_scheduler_type=constant", "trainer.warmup_steps=0")
    straight, split = tmp_path / "out" / "straight", tmp_path / "out" / "split"
    run(_compose([*base, "trainer.max_steps=4"]), straight)
    run(_compose([*base, "trainer.max_steps=2"]), split)
    assert (split / "checkpoint-2").is_dir() and not (split / "checkpoint-4").exists()
    run(_compose([*base, "trainer.max_steps=4", "trainer.resume_from_checkpoint=true"]), split)
    state = json.loads((split / "checkpoint-4" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "loss" in h]
    assert [h["step"] for h in logged] == [1, 2, 3, 4] and all("plain_loss" in h and "masked_loss" in h for h in logged)
    a = load_model(ModelConfig(name="a", source="local", path=str(straight / "final"), device="cpu")).model
    b = load_model(ModelConfig(name="b", source="local", path=str(split / "final"), device="cpu")).model
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow  # a training run and a merge
def test_lora_trains_the_adaptive_rows_and_merges(tmp_path):
    run(_compose(_overrides(tmp_path, "stage=mask")), tmp_path / "out" / "mask")
    run_dir = tmp_path / "out" / "lora"
    summary = run(_compose(_overrides(tmp_path, "stage=train", "trainer.lora.enabled=true", "trainer.lora.r=4",
                                      "trainer.max_steps=1", "trainer.lr_scheduler_type=constant",
                                      "trainer.warmup_steps=0")), run_dir)
    assert summary["train"]["lora"] and summary["train"]["steps"] == 1 and (run_dir / "adapter").is_dir()
    lm, (aid,) = _tiny_with_token()  # the base with the token attached: what training started from
    final = load_model(ModelConfig(name="local", source="local", path=str(run_dir / "final"), device="cpu"))
    assert adaptive.adaptive_of(final.model.config)["adaptive_ids"] == [aid]
    assert final.tokenizer.convert_tokens_to_ids(adaptive.ADAPTIVE_TOKEN) == aid
    emb0, emb1 = lm.model.get_input_embeddings().weight, final.model.get_input_embeddings().weight
    assert not torch.allclose(emb0[aid], emb1[aid])  # the adaptive row trained
    torch.testing.assert_close(emb0[:aid], emb1[:aid])  # the ordinary rows did not
    changed = [k for k, v in lm.model.state_dict().items() if not torch.equal(v, final.model.state_dict()[k])]
    assert any("proj" in k for k in changed) and "lm_head.weight" not in changed


@pytest.mark.slow
def test_bad_input_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import pardec.models.loading as loading

    def no_load(*_a, **_k):
        raise AssertionError("a model or tokenizer was loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setattr(loading, "load_tokenizer_only", no_load)
    cases = [
        (["adaptive.max_span=0"], ConfigError, "adaptive.max_span=0 is out of range: it must be an integer >= 1"),
        (["adaptive.diverse=3"], ConfigError, "adaptive.diverse=3 is not valid"),
        (["+mask.max_span=4"], ConfigError, "mask.max_span is not a mask key here: set adaptive.max_span"),
        (["mask.ratio=0"], ConfigError, r"mask.ratio=0.* is out of range"),
        (["eval.stride=0"], ConfigError, "eval.stride=0 is out of range"),
        (["adaptive.diverse=true", "eval.k_max=4"], ConfigError, "eval.k_max=4 is out of range: diverse"),
        (["+eval.topk=3"], ConfigError, r"unknown key\(s\) \['topk'\] in eval"),
        (["trainer.mask_weight=-1"], ConfigError, "trainer.mask_weight=-1 is out of range"),
        (["+trainer.bogus=1"], ConfigError, r"unknown key\(s\) \['bogus'\] in trainer; valid: lora, .*mask_weight"),
        (["stage=generate"], ConfigError, "stage='generate' is not valid for a sdsat experiment; choose one of: mask"),
        (["stage=train"], FileNotFoundError, r"meta.json does not exist; build the masked corpus first"),
    ]
    for ov, err, pattern in cases:
        with pytest.raises(err, match=pattern) as e:
            run(_compose(_overrides(tmp_path, *ov)), tmp_path / "out" / "bad")
        assert "\n" not in str(e.value)
    out = tmp_path / "data" / "sdsat" / "sdsat_tiny"
    out.mkdir(parents=True)
    (out / "meta.json").write_text(json.dumps({"schema_version": 0}))
    (out / "stats.json").write_text(json.dumps({"schema_version": 0, "complete": True}))
    with pytest.raises(ValueError, match=rf"meta.json: schema_version 0, this pardec reads {MASK_SCHEMA_VERSION}") as e:
        run(_compose(_overrides(tmp_path, "stage=train")), tmp_path / "out" / "bad")
    assert "\n" not in str(e.value)
    monkeypatch.undo()  # stage=all: the mask stage reads the tokenizer (no weights), then refuses the directory
    monkeypatch.setattr(loading, "load_model", no_load)
    now = MASK_SCHEMA_VERSION
    with pytest.raises(FileExistsError, match=rf"other settings \(.*schema_version was 0, now {now}.*mask.overwrite=true"):
        run(_compose(_overrides(tmp_path, "stage=all")), tmp_path / "out" / "bad")
    meta = {"schema_version": now, "model": {}, "adaptive_tokens": [adaptive.ADAPTIVE_TOKEN], "adaptive_ids": [VOCAB],
            "ratio": 0.5, "max_span": 3, "diverse": False, "seed": 0, "max_length": 256, "sources": []}
    (out / "meta.json").write_text(json.dumps(meta))
    (out / "stats.json").write_text(json.dumps({"schema_version": now, "complete": True}))
    with pytest.raises(ConfigError, match=r"built with other settings \(ratio was 0.5, now 0.3; sources was") as e:
        validate(_compose(_overrides(tmp_path, "stage=train")))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.heavy  # torchrun: two gloo ranks
def test_deepspeed_zero3_two_ranks_on_cpu(tmp_path):
    """torchrun, 2 CPU ranks, gloo, ZeRO-3 (a from_pretrained model, sharded while loading): the adaptive token is
    attached to the partitioned embeddings, trained, and final/ holds it whole."""
    import os
    import subprocess
    import sys

    from pardec import REPO_ROOT

    local = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu"))
    local.model.save_pretrained(tmp_path / "base")
    local.tokenizer.save_pretrained(tmp_path / "base")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
           *_overrides(tmp_path, "threads=1", "stage=all", "trainer.deepspeed=zero3", "model=local",
                       f"model.path={tmp_path}/base", "trainer.lr_scheduler_type=constant", "trainer.warmup_steps=0")]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, "\n".join(line for line in proc.stderr.splitlines() if "Error" in line or "error" in line)[-4000:]
    (run_dir,) = (tmp_path / "out" / "train" / "runs" / "sdsat_tiny").iterdir()
    final = load_model(ModelConfig(name="local", source="local", path=str(run_dir / "final"), device="cpu"))
    (aid,) = adaptive.adaptive_of(final.model.config)["adaptive_ids"]
    assert final.tokenizer.convert_tokens_to_ids(adaptive.ADAPTIVE_TOKEN) == aid == len(local.tokenizer)
    emb = final.model.get_input_embeddings().weight.detach()
    mean = local.model.get_input_embeddings().weight.detach().mean(0)
    assert emb.shape[0] == aid + 1 and 0 < float((emb[aid] - mean).abs().max()) < 0.1  # from the mean, trained
    assert json.loads((run_dir / "train_summary.json").read_text())["eval"]["tokens"] > 0
