"""CLLMTrainer on a tiny random Llama: samples, the loss it computes, a few training steps per variant."""

from __future__ import annotations

import copy

import pytest
import torch

from pardec.models.cached import CachedModel
from pardec.training.collect import jacobi_trajectories
from pardec.training.data import CLLMCollator, TrajectoryDataset
from pardec.training.losses import ar_loss, consistency_loss
from pardec.training.trainer import CLLMConfig, CLLMTrainer
from tests.conftest import tiny

TEXTS = ["Tom has 3 apples and buys 5 more.", "def add(a, b):", "Hi", "A box holds 12 pens. How many in 4 boxes?"]


@pytest.fixture(scope="module")
def records() -> list[dict]:
    lm = tiny()
    prompts = [lm.tokenizer(t)["input_ids"] for t in TEXTS]
    eos = {lm.tokenizer("Hi")["input_ids"][0]}  # unlikely; answers run to the limit
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = jacobi_trajectories(CachedModel(lm.model), prompts, 4, 10, eos, gens)
    return [{"id": str(i), "prompt_ids": p, **r} for i, (p, r) in enumerate(zip(prompts, out))]


def _trainer(tmp_path, records, model=None, **kw) -> CLLMTrainer:
    lm = tiny()
    args = CLLMConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                      logging_steps=1, per_device_train_batch_size=2, learning_rate=1e-3, **kw)
    ds = TrajectoryDataset(records, args.loss_type, args.state_sampling, args.max_length, args.seed)
    return CLLMTrainer(model=model or copy.deepcopy(lm.model), args=args, train_dataset=ds,
                       data_collator=CLLMCollator(lm.tokenizer.pad_token_id))


def test_samples_layout(records):
    rec = records[0]
    ds = TrajectoryDataset([rec], "global", "all")
    assert len(ds) == sum(len(b["states"]) - 1 for b in rec["blocks"])
    s = ds[len(ds) - 1]  # a state of the last block (the 10-token limit: a 2-token block)
    blk = rec["blocks"][-1]
    assert s["state_ids"][-len(blk["fixed_point"]) + 1 :] == blk["states"][-2][:-1]
    assert s["target_ids"] == rec["prompt_ids"] + rec["answer_ids"][:-1]
    assert s["ar_ids"] == rec["prompt_ids"] + rec["answer_ids"]
    assert s["ar_labels"] == [-100] * len(rec["prompt_ids"]) + rec["answer_ids"]
    local = TrajectoryDataset([rec], "local", "all")
    assert local[0]["target_ids"][-3:] == rec["blocks"][0]["states"][1][:-1]
    short = TrajectoryDataset([rec], "global", "all", max_length=8)
    assert short.n_truncated == len(short) and all(len(short[i]["ar_ids"]) == 8 for i in range(len(short)))
    with pytest.raises(ValueError, match="shorter than a block"):
        TrajectoryDataset([rec], max_length=4)


def test_compute_loss_matches_unpadded_single_sequences(tmp_path, records):
    """The padded batch gives the losses computed by hand on each sequence: target = own logits on the fixed point."""
    trainer = _trainer(tmp_path, records, max_steps=1)
    model = trainer.model.eval()
    ds = trainer.train_dataset
    samples = [ds[0], ds[len(ds) - 1]]  # different lengths: left padding is exercised
    batch = trainer.data_collator(samples)
    with torch.no_grad():
        got = trainer.compute_loss(model, batch)
        cons_sum = cons_n = ar_sum = ar_n = 0.0
        for s in samples:
            k = len(s["consistency_mask"])
            mask = torch.tensor(s["consistency_mask"])[None]
            student = model(torch.tensor([s["state_ids"]])).logits[:, -k:]
            target = model(torch.tensor([s["target_ids"]])).logits[:, -k:]
            cons_sum += consistency_loss(student, target, mask).item() * mask.sum().item()
            cons_n += mask.sum().item()
            labels = torch.tensor([s["ar_labels"]])
            n = (labels[:, 1:] != -100).sum().item()
            ar_sum += ar_loss(model(torch.tensor([s["ar_ids"]])).logits, labels).item() * n
            ar_n += n
    assert cons_n > 0
    want = cons_sum / cons_n + 10.0 * ar_sum / ar_n
    assert got.item() == pytest.approx(want, rel=1e-4)

    # gradient accumulation: two micro-batches normalised by the window's counts sum to the big batch
    counts = torch.stack([batch["consistency_mask"].sum(), (batch["ar_labels"][:, 1:] != -100).sum()])
    with torch.no_grad():
        parts = [trainer.compute_loss(model, trainer.data_collator([s]), num_items_in_batch=counts) for s in samples]
        whole = trainer.compute_loss(model, batch, num_items_in_batch=counts)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-4)


@pytest.mark.parametrize("distance", ["fkl", "rkl", "jsd"])
@pytest.mark.parametrize("loss_type", ["global", "local"])
def test_two_steps_change_the_weights(tmp_path, records, loss_type, distance):
    trainer = _trainer(tmp_path, records, max_steps=2, loss_type=loss_type, distance=distance,
                       gradient_accumulation_steps=2 if distance == "jsd" else 1)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    after = trainer.model.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)  # every tensor is trained (full fine-tuning)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2
    assert all(h["consistency_loss"] > 0 and h["ar_loss"] > 0 and "learning_rate" in h for h in logs)


def test_lora_trains_only_the_adapter(tmp_path, records):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(tiny().model), LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                                                  target_modules=["q_proj", "v_proj"]))
    trainer = _trainer(tmp_path, records, model=model, max_steps=2, state_sampling="all")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.train()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(before[k], v)}
    assert any("lora_B" in k for k in changed) and all("lora_" in k for k in changed)


def test_consistency_mask_starts_after_the_first_wrong_token():
    """Up to and including the first wrong position d, state and target rows hold the same tokens before each block
    position, so their logits are equal there (checked on a model): the mask starts at d + 1."""
    rec = {"id": "x", "prompt_ids": [1, 2], "answer_ids": [10, 11, 12, 13],
           "blocks": [{"states": [[10, 5, 6, 7], [10, 11, 12, 7], [10, 11, 12, 13]], "fixed_point": [10, 11, 12, 13],
                       "augmented": [[10, 5, 12, 13]]}]}
    ds = TrajectoryDataset([rec], "global", "all")
    assert len(ds) == 3  # two visited states + one augmented copy (global loss only)
    assert [ds[i]["consistency_mask"] for i in range(3)] == [[False, False, True, True], [False] * 4,
                                                             [False, False, True, True]]
    assert ds[2]["state_ids"] == [1, 2, 10, 5, 12]
    assert len(TrajectoryDataset([rec], "local", "all")) == 2  # an augmented copy has no Jacobi successor
    model = tiny().model
    with torch.no_grad():
        for i in range(3):
            s = ds[i]
            student = model(torch.tensor([s["state_ids"]])).logits[0, -4:]
            target = model(torch.tensor([s["target_ids"]])).logits[0, -4:]
            same = [torch.equal(student[k], target[k]) for k in range(4)]
            assert all(same[k] for k in range(4) if not s["consistency_mask"][k])  # masked out: zero loss anyway
            assert not any(same[k] for k in range(4) if s["consistency_mask"][k])
