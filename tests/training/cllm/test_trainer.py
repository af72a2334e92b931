"""CLLMTrainer on a tiny random Llama: samples, the loss it computes, a few training steps per variant."""

from __future__ import annotations

import copy

import pytest
import torch

from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.training.cllm.data import CLLMCollator, TrajectoryDataset, ar_answer
from pardec.training.cllm.trainer import (
    CLLMConfig,
    CLLMTrainer,
    DecodingProxy,
    fast_forward_proxy,
    packed_forward,
)
from pardec.training.losses import ar_loss, consistency_loss
from tests.conftest import tiny
from tests.training.cllm.helpers import jacobi_trajectories

TEXTS = ["Tom has 3 apples and buys 5 more.", "def add(a, b):", "Hi", "A box holds 12 pens. How many in 4 boxes?"]


@pytest.fixture(scope="module")
def records() -> list[dict]:
    lm = tiny()
    prompts = [lm.tokenizer(t)["input_ids"] for t in TEXTS]
    eos = {lm.tokenizer("Hi")["input_ids"][0]}  # unlikely; answers run to the limit
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = jacobi_trajectories(CachedModel(lm.model), prompts, 4, 10, eos, gens)
    return [{"id": str(i), "prompt_ids": p, **r} for i, (p, r) in enumerate(zip(prompts, out))]


@pytest.fixture(scope="module")
def whole_records(records) -> list[dict]:
    """The same records with whole answers (``ar_answer_ids``): their greedy answers run on to 16 tokens, past the
    10 collected, one of them ending with an EOS there."""
    lm = tiny()
    ar = build_decoder("ar", CachedModel(lm.model), None)
    full = ar.generate(records[0]["prompt_ids"], 16, Stopper(eos_ids=set())).tokens
    eos = {next(t for k, t in enumerate(full) if k >= 12 and t not in full[:k])}  # record 0 ends at 13..16
    out = []
    for rec in records:
        whole = ar.generate(rec["prompt_ids"], 16, Stopper(eos_ids=eos)).tokens
        assert whole[: len(rec["answer_ids"])] == rec["answer_ids"] and len(whole) > len(rec["answer_ids"])
        out.append({**rec, "ar_answer_ids": whole})
    assert out[0]["ar_answer_ids"][-1] in eos
    return out


def _trainer(tmp_path, records, model=None, **kw) -> CLLMTrainer:
    lm = tiny()
    kw = {"per_device_train_batch_size": 2, **kw}
    args = CLLMConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                      logging_steps=1, learning_rate=1e-3, **kw)
    ds = TrajectoryDataset(records, args.loss_type, args.state_sampling, args.max_length, args.seed,
                           args.states_per_sample)
    return CLLMTrainer(model=model or copy.deepcopy(lm.model), args=args, train_dataset=ds,
                       data_collator=CLLMCollator(lm.tokenizer.pad_token_id))


def _block(rec: dict, b: int) -> tuple[list[int], dict, int]:
    """(prefix = prompt + answer before block b, the block, its positions within the answer)."""
    start = sum(len(x["fixed_point"]) for x in rec["blocks"][:b])
    blk = rec["blocks"][b]
    return rec["prompt_ids"] + rec["answer_ids"][:start], blk, min(len(blk["fixed_point"]),
                                                                  len(rec["answer_ids"]) - start)


def _by_hand(model, ds: TrajectoryDataset, i: int):
    """Per counted block position of sample i: (student logits, target logits) from separate unpacked forwards
    (prefix + state[:-1] and prefix + target[:-1], as CLLM computes them), plus the AR logits and labels."""
    r, b = ds.items[i]
    rec = ds.records[r]
    prefix, blk, n_valid = _block(rec, b)
    n = len(blk["fixed_point"])
    out = []
    for j in ds.states_of(i):
        state = blk["states"][j] if j >= 0 else blk["augmented"][-j - 1]
        target = blk["fixed_point"] if ds.loss_type == "global" else blk["states"][j + 1]
        d = next((k for k in range(n) if state[k] != target[k]), n)
        st = model(torch.tensor([prefix + state[:-1]])).logits[0, -n:]
        tg = model(torch.tensor([prefix + target[:-1]])).logits[0, -n:]
        out += [(st[k], tg[k]) for k in range(d + 1, n_valid)]
    ar = model(torch.tensor([rec["prompt_ids"] + ar_answer(rec)])).logits
    labels = torch.tensor([[-100] * len(rec["prompt_ids"]) + ar_answer(rec)])
    return out, ar, labels


@pytest.mark.parametrize("answers", ["collected", "whole"])
@pytest.mark.parametrize("loss_type", ["global", "local"])
def test_packed_logits_equal_separate_forwards(tmp_path, records, whole_records, loss_type, answers):
    """One packed forward (AR row + state segments + local target segments, 4D block-causal mask, right padding)
    gives, at every counted position, the logits of the separate forwards CLLM runs (with AR rows of the collected
    answers, and of whole answers running past the collected blocks)."""
    records = whole_records if answers == "whole" else records
    trainer = _trainer(tmp_path, records, max_steps=1, loss_type=loss_type, state_sampling="all")
    model, ds = trainer.model.eval(), trainer.train_dataset
    assert len(ds) == sum(len(b["states"]) > 1 for r in records for b in r["blocks"])  # one sample per block
    idx = [0, len(ds) - 1, 2]  # different lengths: padding is exercised
    batch = trainer.data_collator([ds[i] for i in idx])
    with torch.no_grad():
        logits = packed_forward(model, batch, torch.arange(batch["input_ids"].shape[1]))
        got = [(logits[r, s], logits[r, t]) for r, s, t in batch["pairs"].tolist()]
        want = [p for i in idx for p in _by_hand(model, ds, i)[0]]
    assert len(got) == len(want) > 0
    for (gs, gt), (ws, wt) in zip(got, want):
        torch.testing.assert_close(gs, ws, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gt, wt, rtol=1e-4, atol=1e-4)


def test_samples_layout_and_truncation(records):
    rec = records[0]
    ds = TrajectoryDataset([rec], "global", "all")
    s = ds[0]
    n_ar = len(rec["prompt_ids"]) + len(rec["answer_ids"])
    assert s["ids"][:n_ar] == rec["prompt_ids"] + rec["answer_ids"] and set(s["segment"][:n_ar]) == {0}
    assert s["ar_targets"][: n_ar - 1] == [-100] * (len(rec["prompt_ids"]) - 1) + rec["answer_ids"]
    blk = rec["blocks"][0]
    assert len(s["segments"]) == len(blk["states"]) - 1 + len(blk.get("augmented") or [])
    f = s["segments"][0]
    assert s["ids"][f : f + 3] == blk["states"][0][:-1] and s["positions"][f] == s["context"] == len(rec["prompt_ids"])
    short = TrajectoryDataset([rec], "global", "all", max_length=8)
    assert short.n_truncated == len(short)
    for i in range(len(short)):  # cut on the left, never past the block's prefix
        x = short[i]
        assert x["segment"].count(0) <= 8 and x["context"] >= 1
    with pytest.raises(ValueError, match="shorter than a block"):
        TrajectoryDataset([rec], max_length=4)


@pytest.mark.parametrize("answers", ["collected", "whole"])
def test_compute_loss_matches_separate_forwards(tmp_path, records, whole_records, answers):
    """The packed batch gives the losses computed by hand from separate forwards: target = own logits on the fixed
    point, AR loss on the whole AR row's answer; gradient-accumulation micro-batches normalised by the window's
    counts sum to the whole batch."""
    records = whole_records if answers == "whole" else records
    trainer = _trainer(tmp_path, records, max_steps=1, states_per_sample=2)
    model = trainer.model.eval()
    ds = trainer.train_dataset
    idx = [0, len(ds) - 1]
    batch = trainer.data_collator([ds[i] for i in idx])
    with torch.no_grad():
        got = trainer.compute_loss(model, batch)
        cons, ar_sum, ar_n = [], 0.0, 0
        for i in idx:
            pairs, ar_logits, labels = _by_hand(model, ds, i)
            cons += [consistency_loss(s[None, None], t[None, None], torch.ones(1, 1, dtype=torch.bool)).item()
                     for s, t in pairs]
            n = (labels[:, 1:] != -100).sum().item()
            ar_sum += ar_loss(ar_logits, labels, label_smoothing=0.1).item() * n  # the official trainer's epsilon
            ar_n += n
    assert len(cons) == len(batch["pairs"]) > 0
    assert ar_n == (batch["ar_targets"] != -100).sum() == sum(len(ar_answer(ds.records[ds.items[i][0]])) for i in idx)
    assert got.item() == pytest.approx(sum(cons) / len(cons) + 10.0 * ar_sum / ar_n, rel=1e-4)

    counts = torch.stack([torch.tensor(len(batch["pairs"])), (batch["ar_targets"] != -100).sum()])
    with torch.no_grad():
        parts = [trainer.compute_loss(model, trainer.data_collator([ds[i]]), num_items_in_batch=counts) for i in idx]
        whole = trainer.compute_loss(model, batch, num_items_in_batch=counts)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), rel=1e-4)


def test_states_are_drawn_anew_each_epoch(tmp_path, records):
    ds = TrajectoryDataset(records, "global", "random", states_per_sample=2, seed=3)
    many = [i for i in range(len(ds)) if len(records[ds.items[i][0]]["blocks"][ds.items[i][1]]["states"]) > 3]
    assert many
    draws = []
    for epoch in (0, 1, 2, 0):
        ds.set_epoch(epoch)
        draws.append([ds.states_of(i) for i in many])
    assert draws[0] == draws[3]  # reproducible (a resumed run draws the same)
    assert draws[0] != draws[1] or draws[1] != draws[2]
    assert all(len(js) == 2 for js in draws[0])

    seen = []

    class Spy(TrajectoryDataset):
        def set_epoch(self, epoch):
            seen.append(epoch)
            super().set_epoch(epoch)
    trainer = _trainer(tmp_path, records, num_train_epochs=2, per_device_train_batch_size=4)
    trainer.train_dataset.__class__ = Spy
    trainer.train()
    assert [e for i, e in enumerate(seen) if i == 0 or seen[i - 1] != e] == [0, 1]  # every epoch, in order


def test_proxy_equals_the_trajectory_advance_for_the_collecting_model(records):
    """On trajectories the same model collected, one teacher-forced step from a state is the next state, so the
    proxy's gain per state is the trajectory's own advance."""
    lm = tiny()
    ds = TrajectoryDataset(records, "global", "all")
    got = fast_forward_proxy(lm.model, ds, CLLMCollator(lm.tokenizer.pad_token_id), batch_size=3)
    gains, init = [], []
    for rec in records:
        for b in range(len(rec["blocks"])):
            _, blk, n_valid = _block(rec, b)
            fp = blk["fixed_point"]
            lead = lambda x, fp=fp, n=n_valid: next((k for k in range(n) if x[k] != fp[k]), n)  # noqa: E731
            for j in range(len(blk["states"]) - 1):
                if lead(blk["states"][j]) < n_valid:
                    gains.append(lead(blk["states"][j + 1]) - lead(blk["states"][j]))
                    init += [gains[-1]] if j == 0 else []
    assert got["ff_proxy_states"] == len(gains) > 0
    assert got["ff_proxy"] == pytest.approx(sum(gains) / len(gains))
    assert got["ff_proxy_init"] == pytest.approx(sum(init) / len(init))
    assert got["ff_proxy_agree"] == 1.0  # the collecting model's greedy tokens are the collected ones

    other = copy.deepcopy(lm.model)  # another model: it leaves the trajectory at times, and is credited 1 there
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.05, alpha=1.0)
    moved = fast_forward_proxy(other, ds, CLLMCollator(lm.tokenizer.pad_token_id))
    assert moved["ff_proxy_agree"] < 1.0 and moved["ff_proxy"] >= 1.0 and moved["ff_proxy_states"] == len(gains)
    assert min(gains) >= 1  # greedy Jacobi: every step fixes at least one more token


def test_decoding_proxy_is_the_benchmarks_jacobi_fast_forward_and_keeps_training_mode(records):
    """The decoded proxy: each held-out prompt decoded by the ``jacobi`` decoder the benchmark runs (block size,
    token budget and EOS as collected, default guesses), the mean of the per-prompt fast-forwards; the model being
    trained is left in training mode."""
    lm = tiny()
    model = copy.deepcopy(lm.model).train()
    prompts = [r["prompt_ids"] for r in records]
    eos = {records[0]["answer_ids"][5]}  # ends some answers early
    got = DecodingProxy(prompts, 4, 10, eos)(model)
    assert model.training
    jacobi = build_decoder("jacobi", CachedModel(lm.model), None, block_size=4)
    runs = [jacobi.generate(p, 10, Stopper(eos_ids=eos)) for p in prompts]
    assert any(r.stop_reason == "eos" for r in runs)
    assert got["ff_decode"] == pytest.approx(sum(r.extras["fast_forward"] for r in runs) / len(runs))
    assert got["ff_decode_tokens"] == sum(len(r.tokens) for r in runs)
    assert DecodingProxy([], 4, 10, eos)(model)["ff_decode_tokens"] == 0.0


@pytest.mark.parametrize("distance", ["fkl", "rkl", "jsd"])
@pytest.mark.parametrize("loss_type", ["global", "local"])
def test_two_steps_change_the_weights(tmp_path, records, loss_type, distance):
    trainer = _trainer(tmp_path, records, max_steps=2, loss_type=loss_type, distance=distance, states_per_sample=4,
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
    """Up to and including the first wrong position d, state and target see the same tokens before each block
    position, so their logits are equal there (checked on a model): the counted positions start at d + 1."""
    rec = {"id": "x", "prompt_ids": [1, 2], "answer_ids": [10, 11, 12, 13],
           "blocks": [{"states": [[10, 5, 6, 7], [10, 11, 12, 7], [10, 11, 12, 13]], "fixed_point": [10, 11, 12, 13],
                       "augmented": [[10, 5, 12, 13]]}]}
    ds = TrajectoryDataset([rec], "global", "all")
    s = ds[0]
    assert ds.states_of(0) == [0, 1, -1]  # two visited states + one augmented copy (global loss only)
    f = s["segments"]
    assert s["ids"][f[2] : f[2] + 3] == [10, 5, 12]
    # block position k of a segment starting at f is its token k - 1; the target is AR-row index context - 1 + k
    counted = sorted((p - f[g] + 1, g) for p, _ in s["pairs"] for g in range(3) if f[g] <= p < f[g] + 3)
    assert counted == [(2, 0), (2, 2), (3, 0), (3, 2)]  # state 1 differs only at its last position: none
    assert all(t == s["context"] - 1 + (p - f[g] + 1) for p, t in s["pairs"] for g in range(3) if f[g] <= p < f[g] + 3)
    assert TrajectoryDataset([rec], "local", "all").states_of(0) == [0, 1]  # an augmented copy has no successor
    model = tiny().model
    with torch.no_grad():
        for j, state in enumerate([[10, 5, 6, 7], [10, 11, 12, 7], [10, 5, 12, 13]]):
            student = model(torch.tensor([[1, 2] + state[:-1]])).logits[0, -4:]
            target = model(torch.tensor([[1, 2, 10, 11, 12]])).logits[0, -4:]
            same = [torch.equal(student[k], target[k]) for k in range(4)]
            included = {k for k, g in counted if g == j}
            assert all(same[k] for k in range(4) if k not in included)  # left out: zero loss anyway
            assert not any(same[k] for k in included)
