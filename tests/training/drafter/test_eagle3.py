"""EAGLE-3's training-time test (``drafter.type: eagle3``, :mod:`pardec.training.drafter.eagle`): the unrolled steps
against a step-by-step reference run as a decoder would run the draft, the loss against a hand computation (the
draft-vocabulary restriction, the position mask, the 0.8^i weights, an all-masked batch), the vocabulary's
determinism, then ``+experiment=eagle3_tiny`` end to end (generate -> train -> eval), resume, config errors."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from transformers import LlamaConfig

from pardec.config import ConfigError
from pardec.models.drafters import load_drafter, new_drafter
from pardec.models.eagle import default_layers, new_eagle3
from pardec.models.vocab import DraftVocab
from pardec.train import run, validate
from pardec.training.completions import CompletionDataset
from pardec.training.drafter.batches import RightPadCollator, term_count
from pardec.training.drafter.eagle import acceptance, ttt_mask, ttt_terms, ttt_unroll
from pardec.training.drafter.heldout import walk, walk_figures
from pardec.training.drafter.target import TargetPass, target_pass
from pardec.training.drafter.trainer import (
    DrafterConfig,
    DrafterTrainer,
)
from pardec.training.drafter.vocab import corpus_vocab
from tests.conftest import tiny
from tests.training.test_train_app import _compose

SMALL = LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
KEPT = [0, 2, 5, 7, 9, 11]  # the draft vocabulary of the small drafter


def _small(seed: int = 0):
    torch.manual_seed(seed)
    drafter = new_eagle3(SMALL, DraftVocab(KEPT, 16), lm_head=torch.randn(16, 32))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape) * 0.05)  # the norms away from 1
    return drafter.eval()


def _reference_outputs(drafter, fused: torch.Tensor, emb: torch.Tensor, steps: int) -> dict[tuple[int, int, int], torch.Tensor]:
    """The draft as a decoder runs it, one anchor at a time: step 0 over the stable prefix 0..t (target features,
    plainly causal, no mask given), then steps 1.. one entry each after explicit past keys (the prefix's step-0 keys
    and the anchor's earlier steps), fed the previous step's output and the true next token's embedding, at
    position t + i. {(b, t, i): output [H]} for every entry whose token lies in the sequence."""
    bsz, t_len, _ = fused.shape
    out = {}
    with torch.no_grad():
        for b in range(bsz):
            for t in range(t_len - 1):
                o, (k, v) = drafter(emb[b : b + 1, 1 : t + 2], fused[b : b + 1, : t + 1], torch.arange(t + 1))
                keys, values, h = k, v, o[:, -1:]
                out[b, t, 0] = h[0, 0]
                for i in range(1, steps):
                    if t + 1 + i >= t_len:
                        break
                    h, (k, v) = drafter(emb[b : b + 1, t + 1 + i : t + 2 + i], h, torch.tensor([t + i]),
                                        past=(keys, values))
                    keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
                    out[b, t, i] = h[0, 0]
    return out


def test_ttt_mask_is_causal_then_diagonal():
    m = ttt_mask(3, 2)
    assert m.shape == (3, 9)
    assert m[:, :3].tolist() == [[True, False, False], [True, True, False], [True, True, True]]
    assert torch.equal(m[:, 3:6], torch.eye(3, dtype=torch.bool)) and torch.equal(m[:, 6:], torch.eye(3, dtype=torch.bool))
    assert torch.equal(ttt_mask(3, 0), m[:, :3])


def test_unrolled_steps_equal_a_step_by_step_decoder_run():
    drafter = _small()
    g = torch.Generator().manual_seed(1)
    fused = torch.randn(2, 7, 32, generator=g)
    emb = torch.randn(2, 7, 32, generator=g)
    steps = 4
    with torch.no_grad():
        outs = ttt_unroll(drafter, fused, emb, steps)
    ref = _reference_outputs(drafter, fused, emb, steps)
    assert len(ref) == 2 * (6 + 5 + 4 + 3)
    for (b, t, i), want in ref.items():
        torch.testing.assert_close(outs[i][b, t], want, rtol=1e-5, atol=1e-5, msg=f"row {b} anchor {t} step {i}")


def _hand_loss(drafter, tp: TargetPass, mask: torch.Tensor, steps: int, decay: float):
    """(weighted soft-CE sum, counted terms per step) by the reference's formula, one entry at a time."""
    outs = ttt_unroll(drafter, drafter.fuse(tp.features), tp.emb, steps)
    total, counts = 0.0, [0] * steps
    bsz, t_len = mask.shape
    with torch.no_grad():
        for i in range(steps):
            for b in range(bsz):
                for t in range(t_len):
                    j = t + 1 + i
                    if j >= t_len or not mask[b, j] or int(tp.logits[b, j].argmax()) not in KEPT:
                        continue
                    p = tp.logits[b, j, KEPT].softmax(-1)
                    logq = drafter.logits(outs[i][b, t]).log_softmax(-1)
                    total += decay**i * float(-(p * logq).sum())
                    counts[i] += 1
    return total, counts


def _target(seed: int = 2, t_len: int = 8) -> TargetPass:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, t_len, 16, generator=g) * 3
    return TargetPass(torch.randn(2, t_len, 96, generator=g), logits, torch.randn(2, t_len, 32, generator=g))


def _total(drafter, tp, mask) -> float:
    return float(ttt_terms(drafter, tp, mask, 3, 0.8).total.detach())


def test_loss_is_the_restricted_soft_cross_entropy_on_counted_positions():
    drafter = _small()
    tp = _target()
    tp.logits[0, 3, 4] = 100.0  # the target's argmax at position 3 of row 0 is id 4, outside the draft vocabulary
    tp.logits[1, 5] = 0.0
    tp.logits[1, 5, 7] = 3.0  # in it
    mask = torch.ones(2, 8, dtype=torch.bool)
    mask[1, :2] = False  # a prompt
    mask[0, 6:] = False  # a pad
    decay = 0.8
    terms = ttt_terms(drafter, tp, mask, 3, decay)
    total, counts = _hand_loss(drafter, tp, mask, 3, decay)
    assert terms.count.tolist() == counts
    assert float(terms.total.detach()) == pytest.approx(total, rel=1e-5)
    assert terms.covered.tolist() == [float(mask[:, i + 1 :].sum()) for i in range(3)]  # the normaliser's share
    assert sum(terms.covered.tolist()) == term_count(mask, 3)
    # position (0, 3) never counts (argmax outside the vocabulary): its logits elsewhere change nothing
    tp.logits[0, 3, KEPT] += torch.randn(len(KEPT))
    assert _total(drafter, tp, mask) == pytest.approx(float(terms.total.detach()), rel=1e-6)
    # the masked positions (pads, prompt) neither
    tp.logits[0, 6:] = torch.randn(2, 16)
    assert _total(drafter, tp, mask) == pytest.approx(float(terms.total.detach()), rel=1e-6)
    # a counted position does: the restricted distribution moves the loss
    tp.logits[1, 5, KEPT[:3]] += 1.0
    assert _total(drafter, tp, mask) != pytest.approx(float(terms.total.detach()), rel=1e-6)
    # ids outside the draft vocabulary are not in the softmax: raising one (still below the argmax) changes nothing
    before = _total(drafter, tp, mask)
    tp.logits[1, 5, 4] = 2.5
    assert _total(drafter, tp, mask) == pytest.approx(before, rel=1e-6)


def test_all_masked_batch_gives_zero_loss_and_zero_gradients():
    drafter = _small().train()
    tp = _target()
    terms = ttt_terms(drafter, tp, torch.zeros(2, 8, dtype=torch.bool), 3, 0.8)
    assert float(terms.total.detach()) == 0.0 and terms.count.sum() == 0
    terms.total.backward()
    grads = [p.grad for p in drafter.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and not g.any() for g in grads)


def test_trainer_loss_normalises_by_the_window_and_logs_per_step(tmp_path):
    lm = tiny(0, layers=4)
    model = lm.model.requires_grad_(False)
    records = [{"prompt_ids": [700, 701, 702, 703, 704], "completion_ids": [10, 11, 12, 13, 14, 15]},
               {"prompt_ids": [800, 801, 802], "completion_ids": [20, 21, 22]}]
    vocab = DraftVocab(sorted({0, 1, 2, *range(10, 16), 20, 21, 22, *range(100, 140)}), model.config.vocab_size)
    drafter = new_drafter("eagle3", model.config, lm_head=model.lm_head, vocab=vocab)
    assert drafter.config.layer_ids == list(default_layers(4))
    torch.testing.assert_close(drafter.lm_head.weight, model.lm_head.weight[vocab.ids])  # the target's rows
    ds = CompletionDataset(records, max_length=64)
    batch = RightPadCollator(0)([ds[0], ds[1]])
    args = DrafterConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    trainer = DrafterTrainer(model=drafter, args=args, train_dataset=ds, data_collator=RightPadCollator(0), base=model,
                           ttt_steps=3, step_decay=0.5)
    assert trainer.k == 3 and trainer.window_counts([batch]) == term_count(batch["loss_mask"], 3)
    drafter.train()
    loss = trainer.compute_loss(drafter, batch)
    tp = target_pass(model, batch["input_ids"], drafter.config.layer_ids)
    terms = ttt_terms(drafter, tp, batch["loss_mask"], 3, 0.5)
    n = term_count(batch["loss_mask"], 3)
    assert float(loss.detach()) == pytest.approx(float(terms.total.detach()) / n, rel=1e-5)
    window = trainer.compute_loss(drafter, batch, num_items_in_batch=torch.tensor(4 * n))
    assert float(window.detach()) == pytest.approx(float(terms.total.detach()) / (4 * n), rel=1e-5)
    window.backward()
    assert all(p.grad is not None for p in drafter.parameters()) and all(p.grad is None for p in model.parameters())
    logs = {"loss": float(loss.detach())}
    trainer.log(logs)
    assert {"kl_d1", "kl_d3", "top1_d1", "top1_d3", "kl", "top1"} <= set(logs)
    assert logs["kl_d1"] >= 0.0 and 0.0 <= logs["top1_d2"] <= 1.0


def test_acceptance_is_a_chain_of_the_greedy_tokens():
    lm = tiny(0, layers=4)
    model = lm.model
    records = [{"prompt_ids": [700, 701, 702, 703, 704], "completion_ids": [10, 11, 12, 13, 14, 15]}]
    vocab = DraftVocab(list(range(0, 2000)), model.config.vocab_size)
    drafter = new_drafter("eagle3", model.config, lm_head=model.lm_head, vocab=vocab)
    res = acceptance(model, drafter, records, 3, topk=5)
    # anchors t = 4..8 (t + 2 <= 10); depth d valid while t + 1 + d <= 10
    assert res["anchors"] == 5 and res["valid_per_depth"] == [5, 4, 3]
    c = res["counts"]
    assert all(a <= r for a, r in zip(c["accepted"], c["reached"]))
    assert res["expected_tokens_per_forward"] == pytest.approx(1 + sum(res["chain_acceptance"]))
    assert all(t1 <= tk for t1, tk in zip(res["top1_agreement"], res["topk_containment"]))
    # by hand at depth 1: the draft's greedy token at anchor t, step 0, against the record's token t + 2
    full = records[0]["prompt_ids"] + records[0]["completion_ids"]
    with torch.no_grad():
        tp = target_pass(model, torch.tensor([full[:-1]]), drafter.config.layer_ids)
        out0 = ttt_unroll(drafter, drafter.fuse(tp.features), tp.emb, 1)[0]
        greedy = vocab.to_target(drafter.logits(out0)[0].argmax(-1))
    hits = sum(int(greedy[t]) == full[t + 2] for t in range(4, 9))
    assert c["accepted"][0] == hits and c["top1"][0] == hits
    # decoding's walk over the record: its 6 completion tokens; the prefill, then a round per visited anchor
    assert c["walk_tokens"] == 6 and 3 <= c["walk_forwards"] <= 6  # runs of at most 3: at least two rounds
    assert res["decoding_tokens_per_forward"] == c["walk_tokens"] / c["walk_forwards"]


def test_the_decoding_walk_visits_the_anchor_after_each_rejection():
    # anchor 0 accepts 2 (the round commits 3 tokens: the next round drafts at anchor 3), anchor 3 none, anchor 4 one
    assert walk([2, 9, 9, 0, 1, 9]) == 1 + 3
    assert walk([0, 0, 0]) == 1 + 3 and walk([]) == 1  # every draft rejected: one token a round; prefill only
    counts = {"walk_tokens": 12, "walk_forwards": 4}
    assert walk_figures(counts) == {"decoding_tokens_per_forward": 3.0} and walk_figures({}) == {}


def test_vocabulary_is_the_same_for_any_record_order():
    lm = tiny(0)
    g = random.Random(0)
    records = [{"completion_ids": [g.randrange(0, 3000) for _ in range(50)]} for _ in range(20)]
    vocab, facts = corpus_vocab(64, records, lm)
    vocab2, facts2 = corpus_vocab(64, records[::-1], lm)
    assert torch.equal(vocab.ids, vocab2.ids) and facts == facts2 and len(vocab) == 64
    assert set(lm.eos_ids) <= set(vocab.ids.tolist())
    assert 0.0 < facts["draft_vocab_coverage"] < 1.0 and facts["corpus_completion_tokens"] == 1000


def _overrides(tmp_path, *extra: str) -> list[str]:
    return ["+experiment=eagle3_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out", *extra]


def test_tiny_end_to_end(tmp_path):
    run_dir = tmp_path / "out" / "run"
    summary = run(_compose(_overrides(tmp_path)), run_dir)
    assert summary["generate"]["complete"] and summary["train"]["samples"] == 6 and summary["train"]["steps"] == 2
    lm = tiny(0, layers=4)
    drafter, meta = load_drafter(run_dir / "final", lm.model.config, "eagle3")
    assert (meta["ttt_steps"], meta["step_decay"], meta["draft_vocab_size"]) == (3, 0.8, 512)
    assert drafter.config.draft_vocab_size == 512 and drafter.config.layer_ids == [0, 2, 3]
    assert 0.0 < meta["draft_vocab_coverage"] <= 1.0 and meta["steps"] == 2
    ev = json.loads((run_dir / "drafter_eval.json").read_text())
    o = ev["overall"]
    assert ev["kind"] == "eagle3" and ev["steps"] == 3 and ev["positions"] > 0 and "trees" not in ev
    assert len(o["conditional_acceptance"]) == len(o["topk_containment"]) == 3
    assert all(b <= a for a, b in zip(o["chain_acceptance"], o["chain_acceptance"][1:]))
    assert o["expected_tokens_per_forward"] == pytest.approx(1 + sum(o["chain_acceptance"]))
    assert set(ev["per_dataset"]) == {"gsm8k"} and ev["per_dataset"]["gsm8k"]["counts"] == o["counts"]
    assert json.loads((run_dir / "train_summary.json").read_text())["eval"]["positions"] == ev["positions"]


def test_config_errors(tmp_path):
    cases = [
        (["drafter.draft_vocab_size=1"], "drafter.draft_vocab_size=1 is out of range: it must be an integer >= 2"),
        (["drafter.ttt_steps=0"], "drafter.ttt_steps=0 is out of range: it must be an integer >= 1"),
        (["drafter.ttt_steps=1.5"], "drafter.ttt_steps=1.5 must be int"),
        (["drafter.step_decay=0"], r"drafter.step_decay=0\.0 is out of range: it must be a number in \(0, 1\]"),
        (["drafter.step_decay=1.5"], r"drafter.step_decay=1.5 is out of range: it must be a number in \(0, 1\]"),
        (["+drafter.layers=[0,4]"], r"drafter.layers=\[0, 4\] is out of range: the target tiny_random has layers 0..3"),
        (["+drafter.layers=[]"], r"drafter.layers=\[\] is not valid: give a non-empty list"),
        (["+drafter.num_heads=3"], r"unknown key\(s\) \['num_heads'\] in drafter \(type eagle3\); valid: type, "
                                 r"draft_vocab_size, ttt_steps, step_decay, layers"),
    ]
    for ov, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            run(_compose(_overrides(tmp_path, *ov)), tmp_path / "out" / "bad")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    bare = validate(_compose(_overrides(tmp_path, "~drafter.ttt_steps", "~drafter.step_decay", "~drafter.draft_vocab_size")))
    assert bare.drafter == {"type": "eagle3", "draft_vocab_size": 32000, "ttt_steps": 7, "step_decay": 0.8, "layers": None}
    spec = validate(_compose(["+experiment=eagle3_smollm2", f"paths.data_dir={tmp_path}/data",
                              f"paths.output_dir={tmp_path}/out"]))
    assert spec.drafter == {"type": "eagle3", "draft_vocab_size": 8192, "ttt_steps": 7, "step_decay": 0.8,
                          "layers": None}
    assert spec.gen.out_dir.endswith("completions/draft_smollm2/train")
    assert spec.trainer["adam_beta2"] == 0.95 and spec.trainer["max_grad_norm"] == 0.5 and spec.trainer["max_steps"] == 240
    # a vocabulary larger than the target's: refused before loading when the target's config is at hand (the
    # dequantized SmolLM2 cache), else by the train stage (the tiny random target builds its vocabulary on load)
    from pardec.models.preflight import read_config_json

    if read_config_json(spec.model) is not None:
        with pytest.raises(ConfigError, match=r"drafter.draft_vocab_size=60000 is out of range: it must be in "
                                              r"\[2, 49152\] \(the target smollm2_135m's vocabulary\)"):
            validate(_compose(["+experiment=eagle3_smollm2", "drafter.draft_vocab_size=60000",
                               f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out"]))


def test_the_target_pass_keeps_only_the_chosen_layers_states():
    """target_pass's features (hooks) equal transformers' hidden states of the chosen layers, concatenated in their
    order (the embeddings, a middle layer's input, after the final norm), and no hook outlives the pass."""
    lm = tiny(0, layers=4)
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])

    def hooks():
        return [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in lm.model.modules()]

    with torch.no_grad():
        want = lm.model(input_ids=ids, output_hidden_states=True)  # (transformers may add hooks of its own)
        before = hooks()
        for layers in ((0, 2, 4), (3, 1)):
            tp = target_pass(lm.model, ids, layers)
            assert torch.equal(tp.features, torch.cat([want.hidden_states[i] for i in layers], -1))
            assert torch.equal(tp.logits, want.logits)
    assert hooks() == before


@pytest.mark.slow  # two tiny trainings
def test_training_continues_from_a_kept_drafter(tmp_path, monkeypatch):
    """drafter.init_from: a second run starts from the first's drafter (a directory or zoo:<name>: verified), keeps its
    vocabulary, and its drafter.json counts the steps and data of both runs; a drafter shaped otherwise is refused."""
    from pardec import zoo

    first = tmp_path / "out" / "first"
    for stage in ("generate", "train"):
        run(_compose(_overrides(tmp_path, f"stage={stage}")), first)
    shutil.copytree(first / "final", tmp_path / "zoo" / "smollm2" / "e3")
    monkeypatch.setattr(zoo, "ZOO_DIR", tmp_path / "zoo")
    with pytest.raises(ConfigError, match=r"drafter.init_from: zoo:e3 is not in the zoo \(no "):
        validate(_compose(_overrides(tmp_path, "+drafter.init_from=zoo:e3")))
    zoo.seal(tmp_path / "zoo" / "smollm2" / "e3", {"name": "e3", "target": {"name": "tiny_random"}})
    second = tmp_path / "out" / "second"
    summary = run(_compose(_overrides(tmp_path, "stage=train", "+drafter.init_from=zoo:e3")), second)
    assert summary["train"]["total_steps"] == 4 and summary["train"]["init_from"] == str(tmp_path / "zoo/smollm2/e3")
    lm = tiny(0, layers=4)
    one, _ = load_drafter(first / "final", lm.model.config, "eagle3")
    two, meta = load_drafter(second / "final", lm.model.config, "eagle3")
    assert torch.equal(one.d2t, two.d2t) and meta["draft_vocab_coverage"] == json.loads(
        (first / "final" / "drafter.json").read_text())["draft_vocab_coverage"]
    assert [r["steps"] for r in meta["history"]] == [2, 2] and meta["total_sequences"] == 2 * sum(
        r["sequences_per_step"] for r in meta["history"])
    assert not torch.equal(one.fc.weight, two.fc.weight)  # it trained on
    with pytest.raises(ConfigError, match=r"drafter.init_from=.*: its drafter is not shaped like this experiment's"):
        run(_compose(_overrides(tmp_path, "stage=train", f"+drafter.init_from={first / 'final'}",
                                "drafter.draft_vocab_size=256")), tmp_path / "out" / "third")
    with pytest.raises(ConfigError, match=r"holds a 'eagle3' drafter; this experiment trains drafter.type='medusa'"):
        validate(_compose(["+experiment=heads_medusa_tiny", f"paths.data_dir={tmp_path}/data",
                           f"paths.output_dir={tmp_path}/out", f"+drafter.init_from={first / 'final'}"]))
