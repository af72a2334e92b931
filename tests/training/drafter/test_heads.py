"""Medusa / FIRP self-distillation on tiny random Llamas: the loss against a hand computation (alignment of head k
at t with the target at t + k + 1, padding, the head_decay weights, the accumulation normaliser), then
`+experiment=heads_medusa_tiny` / `heads_firp_tiny` end to end (generate -> train -> eval -> trees), resume, config errors."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from pardec.config import ConfigError, check_overrides
from pardec.decoding.tree_search import resolve_tree
from pardec.models.drafters import load_drafter, new_drafter
from pardec.train import run, validate
from pardec.training.completions import CompletionDataset
from pardec.training.drafter.batches import RightPadCollator, term_count
from pardec.training.drafter.trainer import (
    DrafterConfig,
    DrafterTrainer,
    _new_drafter,
    future_ranks,
)
from tests.conftest import tiny
from tests.training.test_train_app import _compose

RECORDS = [  # prompt + completion lengths 11 and 6: the second row is right-padded by 5
    {"prompt_ids": [700, 701, 702, 703, 704], "completion_ids": [10, 11, 12, 13, 14, 15]},
    {"prompt_ids": [800, 801, 802], "completion_ids": [20, 21, 22]},
]


def _perturbed(kind: str, model, seed: int = 0):
    drafter = (new_drafter("medusa", model.config, num_heads=3, lm_head=model.lm_head) if kind == "medusa"
               else new_drafter("firp", model.config, layers=[0, 1, 1]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return drafter


def _brute_pseudo(model, drafter, prefix: list[int], anchor: int, i: int) -> torch.Tensor:
    """FIRP's pseudo state of step ``i`` (0-based) of ``anchor`` as the paper trains it (§3.3): the real tokens
    ``prefix`` (up to the pseudo state's position - 1) run plainly causal, the state born entering layer
    ``layers[i]`` from the anchor's hidden state there, at position ``len(prefix)``, seeing all of them and itself.
    Returns its [V] logits."""
    inner = model.model
    h = inner.embed_tokens(torch.tensor([prefix]))
    pos = torch.arange(len(prefix) + 1)[None]
    for layer in range(len(inner.layers)):
        if layer == drafter.layers[i]:
            h = torch.cat([h, drafter(i, h[:, anchor : anchor + 1])], dim=1)
        m = h.shape[1]
        causal = torch.full((m, m), torch.finfo(h.dtype).min).triu(1)[None, None]
        rope = inner.rotary_emb(h, position_ids=pos[:, :m])
        h = inner.layers[layer](h, attention_mask=causal, position_embeddings=rope, position_ids=pos[:, :m])
    return model.lm_head(inner.norm(h))[0, -1]


def _hand(kind: str, model, drafter, decay: float) -> tuple[float, list[float], list[int]]:
    """(weighted KL sum, per-depth KL sums, per-depth term counts), one unpadded sequence at a time. Medusa:
    KL(p || q); FIRP: KL(q || p) (Eq. 4), each pseudo state run on its own over the real tokens before it."""
    k = drafter.k
    total, per, counts = 0.0, [0.0] * k, [0] * k
    with torch.no_grad():
        for r in RECORDS:
            seq = (r["prompt_ids"] + r["completion_ids"])[:-1]
            ids = torch.tensor([seq])
            teacher = model(ids).logits[0]  # [T, V]
            if kind == "medusa":
                student = drafter(model.model(input_ids=ids).last_hidden_state[0])  # [T, K, V]
            for t in range(len(seq)):
                for d in range(k):
                    j = t + d + 1  # the teacher position whose next token head d at t predicts
                    if j >= len(seq) or j < len(r["prompt_ids"]) - 1:  # past the end / predicts a prompt token
                        continue
                    logp = teacher[j].log_softmax(-1)
                    if kind == "medusa":
                        kl = float((logp.exp() * (logp - student[t, d].log_softmax(-1))).sum())
                    else:
                        logq = _brute_pseudo(model, drafter, seq[:j], t, d).log_softmax(-1)
                        kl = float((logq.exp() * (logq - logp)).sum())
                    w = decay**d if kind == "medusa" else 1.0
                    total += w * kl
                    per[d] += kl
                    counts[d] += 1
    return total, per, counts


@pytest.mark.parametrize("kind", ["medusa", "firp"])
def test_loss_matches_a_hand_computation(tmp_path, kind):
    lm = tiny(0)
    model = lm.model.requires_grad_(False)
    drafter = _perturbed(kind, model)
    ds = CompletionDataset(RECORDS, max_length=64)
    batch = RightPadCollator(0)([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 10) and batch["valid"][1].tolist() == [True] * 5 + [False] * 5
    assert not batch["loss_mask"][1, 5:].any()
    args = DrafterConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", head_decay=0.5)
    trainer = DrafterTrainer(model=drafter, args=args, train_dataset=ds, data_collator=RightPadCollator(0), base=model)
    total, per, counts = _hand(kind, model, drafter, 0.5)
    n = sum(counts)
    assert n == term_count(batch["loss_mask"], 3) and counts == [9, 9, 8]  # anchors may sit in the prompt
    drafter.train()
    loss = trainer.compute_loss(drafter, batch)
    assert abs(float(loss.detach()) - total / n) < 1e-4 * max(1.0, total / n)
    kl_sums, counted = trainer._log_sums[:3].tolist(), trainer._log_sums[6:].tolist()
    assert counted == counts
    torch.testing.assert_close(torch.tensor(kl_sums), torch.tensor(per), rtol=1e-4, atol=1e-5)
    window = trainer.compute_loss(drafter, batch, num_items_in_batch=torch.tensor(4 * n))  # a 4x window
    assert abs(float(window.detach()) - total / (4 * n)) < 1e-4 * max(1.0, total / n)
    window.backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert all(p.grad is None for p in model.parameters())
    logs = {"loss": float(loss.detach())}
    trainer.log(logs)
    assert {"kl_d1", "kl_d3", "top1_d1", "top1_d3", "kl", "top1"} <= set(logs)
    assert abs(logs["kl_d2"] - per[1] / counts[1]) < 1e-4  # both training calls summed: the same mean


def test_firp_kl_is_from_the_pseudo_distribution_to_the_targets(tmp_path):
    """Eq. 4: KL(P~ || P), P~ = the pseudo state's distribution, P = the target's. P = (1/2, 1/4, 1/4),
    P~ = (1/8, 1/8, 3/4):
    KL(P~ || P) = 1/8 ln(1/4) + 1/8 ln(1/2) + 3/4 ln 3 = 3/4 ln 3 - 3/8 ln 2 = 0.8239592 - 0.2599302 = 0.5640290;
    KL(P || P~) = 1/2 ln 4 + 1/4 ln 2 + 1/4 ln(1/3) = 5/4 ln 2 - 1/4 ln 3 = 0.8664340 - 0.2746531 = 0.5917809."""
    import math

    from pardec.training.drafter.trainer import depth_terms

    p, q = [1 / 2, 1 / 4, 1 / 4], [1 / 8, 1 / 8, 3 / 4]
    teacher = torch.tensor([[[0.0, 0.0, 0.0], [math.log(x) for x in p]]])  # [B=1, n=2, V=3]: position 1 is P
    student = torch.tensor([[[[math.log(x) for x in q]], [[0.0, 0.0, 0.0]]]])  # [1, 2, K=1, 3]: anchor 0 is P~
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert float(depth_terms(teacher, student, mask, 0, "rkl")[0]) == pytest.approx(0.5640290, abs=1e-6)
    assert float(depth_terms(teacher, student, mask, 0, "fkl")[0]) == pytest.approx(0.5917809, abs=1e-6)
    model = tiny(0).model
    args = DrafterConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    for kind, want in (("firp", "rkl"), ("medusa", "fkl")):  # the trainer's default per kind
        t = DrafterTrainer(model=_perturbed(kind, model), args=args, base=model, data_collator=RightPadCollator(0))
        assert t.distance == want


def test_future_ranks_use_the_recorded_tokens():
    lm = tiny(0)
    model = lm.model
    drafter = _perturbed("medusa", model)
    ranks, valid, extra = future_ranks(model, drafter, RECORDS)
    # anchors: record 0 t = 4..8 (5 rows), record 1 t = 2..3 (2 rows)
    assert ranks.shape == (7, 3) and extra["anchors"] == 7
    assert valid[:, 0].all() and valid.sum(0).tolist() == [7, 5, 3]
    seq = RECORDS[0]["prompt_ids"] + RECORDS[0]["completion_ids"]
    with torch.no_grad():
        logits = drafter(model.model(input_ids=torch.tensor([seq[:-1]])).last_hidden_state[0])
    t, d = 5, 1
    true = seq[t + d + 2]
    assert int(ranks[t - 4, d]) == int((logits[t, d] > logits[t, d, true]).sum())


def test_firp_future_ranks_in_figure_7s_two_views():
    """No masked (pseudo) and Masked (real) give step 1 the same ranks; a later step sees the earlier pseudo state
    only in the No masked view, so its ranks move."""
    model = tiny(0).model
    drafter = _perturbed("firp", model)
    pseudo, valid, _ = future_ranks(model, drafter, RECORDS, attention="pseudo")
    real, valid_real, _ = future_ranks(model, drafter, RECORDS, attention="real")
    default, _, _ = future_ranks(model, drafter, RECORDS)
    assert torch.equal(valid, valid_real) and torch.equal(default, pseudo)  # decoding's view is the default
    assert torch.equal(pseudo[:, 0], real[:, 0])
    assert not torch.equal(pseudo[:, 1:][valid[:, 1:]], real[:, 1:][valid[:, 1:]])


def _overrides(tmp_path, name: str, *extra: str) -> list[str]:
    return [f"+experiment={name}", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out", *extra]


@pytest.mark.parametrize("name", ["heads_medusa_tiny", "heads_firp_tiny"])
def test_tiny_end_to_end(tmp_path, name):
    run_dir = tmp_path / "out" / "run"
    summary = run(_compose(_overrides(tmp_path, name)), run_dir)
    assert summary["generate"]["complete"] and summary["train"]["samples"] == 6 and summary["train"]["steps"] == 2
    lm = tiny(0, layers=3)
    drafter, meta = load_drafter(run_dir / "final", lm.model.config, name.split("_")[1])
    assert meta["steps"] == 2 and meta["samples"] == 6 and meta["tokens"] > 0 and meta["train_seconds"] >= 0
    ev = json.loads((run_dir / "drafter_eval.json").read_text())
    if name == "heads_firp_tiny":
        assert (meta["attention"], meta["distance"], drafter.attention) == ("real", "rkl", "real")
        # trained on real states (§3.3), measured in both of Fig. 7's views; the main figures are decoding's view
        views = ev["attention_views"]
        assert ev["decoded_attention"] == "pseudo" and list(views) == ["pseudo", "real"]
        assert (views["pseudo"]["fig7_name"], views["real"]["fig7_name"]) == ("No masked", "Masked")
        assert views["pseudo"]["rank_accuracy"] == ev["overall"]["rank_accuracy"]
        # step 1 sees no earlier pseudo state in either view: identical; later steps are free to differ
        assert views["pseudo"]["rank_accuracy"][0] == views["real"]["rank_accuracy"][0]
    else:
        assert "attention_views" not in ev
    assert ev["positions"] > 0 and ev["parameters"] == meta["parameters"] and ev["k"] == drafter.k == 2
    top = ev["overall"]["topk_accuracy"]
    assert len(top) == 2 and len(top[0]) == 4 and all(a <= b + 1e-12 for row in top for a, b in zip(row, row[1:]))
    assert set(ev["per_dataset"]) == {"gsm8k"}
    for budget in (4, 8):
        got, paths = resolve_tree(f"T{budget}", [run_dir / "final" / "trees"], max_depth=2)
        assert got == f"T{budget}" and len(paths) == min(budget, 4 + 16)
        assert ev["trees"][f"T{budget}"]["expected_accept_length"] >= 1.0
    assert json.loads((run_dir / "train_summary.json").read_text())["eval"]["positions"] == ev["positions"]


def test_corpus_fraction_trains_on_the_first_share_of_the_corpus(tmp_path):
    run_dir = tmp_path / "out" / "run"
    summary = run(_compose(_overrides(tmp_path, "heads_medusa_tiny", "drafter.corpus_fraction=0.5")), run_dir)
    assert summary["generate"]["complete"] and summary["train"]["samples"] == 3  # of the 6 completions
    _, meta = load_drafter(run_dir / "final", tiny(0, layers=3).model.config, "medusa")
    assert meta["corpus_fraction"] == 0.5 and meta["samples"] == 3


@pytest.mark.slow  # two training runs
@pytest.mark.parametrize("name,kind,layers", [("heads_medusa_tiny", "medusa", 3), ("eagle3_tiny", "eagle3", 4),
                                             ("dflash_tiny", "dflash", 4)])
def test_resume_continues_from_the_checkpoint(tmp_path, name, kind, layers):
    """Three steps straight equal two steps, a stop, and a resumed third step (constant lr, same data order)."""
    gen = _overrides(tmp_path, name, "stage=generate")
    run(_compose(gen), tmp_path / "out" / "gen")
    base = _overrides(tmp_path, name, "stage=train", "trainer.save_strategy=steps", "trainer.save_steps=1",
                      "trainer.lr_scheduler_type=constant", "trainer.warmup_steps=0")
    straight, split = tmp_path / "out" / "straight", tmp_path / "out" / "split"
    run(_compose([*base, "trainer.max_steps=3"]), straight)
    run(_compose([*base, "trainer.max_steps=2"]), split)
    assert (split / "checkpoint-2").is_dir() and not (split / "checkpoint-3").exists()
    run(_compose([*base, "trainer.max_steps=3", "trainer.resume_from_checkpoint=true"]), split)
    state = json.loads((split / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    cfg = tiny(0, layers=layers).model.config
    a, _ = load_drafter(straight / "final", cfg, kind)
    b, meta = load_drafter(split / "final", cfg, kind)
    assert meta["steps"] == 3
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_config_errors(tmp_path):
    cases = [
        ("heads_medusa_tiny", ["drafter.type=eagle"], r"drafter.type='eagle' is not valid; choose one of: dflash, eagle3, firp, medusa"),
        ("heads_medusa_tiny", ["drafter.num_heads=0"], "drafter.num_heads=0 is out of range: it must be an integer >= 1"),
        ("heads_medusa_tiny", ["drafter.num_blocks=0"], "drafter.num_blocks=0 is out of range"),
        ("heads_medusa_tiny", ["drafter.head_decay=0"], r"drafter.head_decay=0\.0 is out of range: it must be a number in \(0, 1\]"),
        ("heads_firp_tiny", ["drafter.corpus_fraction=1.5"], r"drafter.corpus_fraction=1.5 is out of range: it must be in \(0, 1\]"),
        ("heads_medusa_tiny", ["+drafter.layers=[1]"],
         r"unknown key\(s\) \['layers'\] in drafter \(type medusa\); valid: type, num_heads, num_blocks, head_decay"),
        ("heads_firp_tiny", ["drafter.layers=[0,3]"], r"drafter.layers=\[0, 3\] is out of range: the target tiny_random "
                                                r"has layers 0..2"),
        ("heads_firp_tiny", ["drafter.layers=[2,1]"], r"drafter.layers=\[2, 1\] is not valid: the layers must be nondecreasing"),
        ("heads_firp_tiny", ["drafter.layers=[]"], "drafter.layers=.* is not valid: give a non-empty list"),
        ("heads_firp_tiny", ["+drafter.num_heads=3"],
         r"unknown key\(s\) \['num_heads'\] in drafter \(type firp\); valid: type, layers, attention, distance"),
        ("heads_firp_tiny", ["drafter.attention=causal"],
         r"drafter.attention='causal' is not valid; choose one of: real, pseudo"),
        ("heads_firp_tiny", ["drafter.distance=jsd"], r"drafter.distance='jsd' is not valid; choose one of: rkl, fkl"),
        ("heads_firp_tiny", ["eval.topk=0"], "eval.topk=0 is out of range"),
        ("heads_firp_tiny", ["eval.budgets=[0]"], r"eval.budgets=\[0\] is not valid"),
        ("heads_firp_tiny", ["+trainer.head_decay=0.5"], r"unknown key\(s\) \['head_decay'\] in trainer.*drafter.head_decay"),
        ("heads_firp_tiny", ["stage=collect"], "stage='collect' is not valid for a drafter experiment; choose one of: generate"),
    ]
    for name, ov, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            run(_compose(_overrides(tmp_path, name, *ov)), tmp_path / "out" / "bad")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "data").exists()  # nothing loaded or written
    with pytest.raises(ConfigError, match="kind='medusa' is not valid; choose one of: cllm, draft, drafter, sdsat"):
        check_overrides(_overrides(tmp_path, "heads_firp_tiny", "kind=medusa"), "train")
    spec = validate(_compose(_overrides(tmp_path, "heads_firp_smollm2")))
    assert spec.drafter == {"type": "firp", "layers": [14, 19, 23], "attention": "real", "distance": "rkl"}
    assert spec.budgets == [16, 32, 63]
    assert spec.gen.out_dir.endswith("completions/draft_smollm2/train")
    bare = validate(_compose(_overrides(tmp_path, "heads_firp_tiny", "~drafter.attention", "~drafter.distance")))
    assert bare.drafter == {"type": "firp", "layers": [1, 2], "attention": "real", "distance": "rkl"}  # the paper's
    lm = tiny(0, layers=3)
    assert _new_drafter(bare, lm.model)[0].attention == "real"


def test_right_padding_never_changes_real_logits():
    model = tiny(0).model
    ds = CompletionDataset(RECORDS, max_length=64)
    b = RightPadCollator(0)([ds[0], ds[1]])
    with torch.no_grad():
        padded = model(b["input_ids"]).logits[1, :5]
        alone = model(torch.tensor([ds[1]["input_ids"]])).logits[0]
    torch.testing.assert_close(F.log_softmax(padded, -1), F.log_softmax(alone, -1), rtol=1e-4, atol=1e-5)


@pytest.mark.slow  # two training runs
def test_firp_gradient_checkpointing_recomputes_the_upper_layers_and_trains_the_same(tmp_path, monkeypatch):
    """trainer.gradient_checkpointing=true: FIRP's upper target layers over the pseudo states are checkpointed
    (the Trainer itself is not asked to checkpoint the drafter, which it cannot), and training ends where it ends
    without checkpointing."""
    import torch.utils.checkpoint as ckpt

    calls = [0]
    real = ckpt.checkpoint

    def counting(*a, **kw):
        calls[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(ckpt, "checkpoint", counting)
    run(_compose(_overrides(tmp_path, "heads_firp_tiny", "stage=generate")), tmp_path / "out" / "gen")
    finals = []
    for on in (False, True):
        calls[0] = 0
        out = tmp_path / "out" / f"ckpt_{on}"
        run(_compose(_overrides(tmp_path, "heads_firp_tiny", "stage=train", f"trainer.gradient_checkpointing={on}")),
            out)
        assert (calls[0] > 0) == on
        finals.append(load_drafter(out / "final", tiny(0, layers=3).model.config, "firp")[0])
    for (name, x), y in zip(finals[0].state_dict().items(), finals[1].state_dict().values()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)
