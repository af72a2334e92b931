"""DFlash's block loss (``drafter.type: dflash``, :mod:`pardec.training.drafter.dflash`): the anchors (which positions,
how many, deterministic per sequence and epoch), the block attention mask, the labels and what counts, the paper's
decay and D-PACE's weights against a hand computation, the loss against a plain per-block reference, then
``+experiment=dflash_tiny`` end to end (generate -> train -> eval) and config errors (resume: ``test_heads.py``)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from pardec.config import ConfigError
from pardec.decoding import build_decoder
from pardec.decoding.base import Stopper
from pardec.decoding.tree_search import load_tree
from pardec.models.cached import CachedModel
from pardec.models.drafters import load_drafter, new_drafter
from pardec.models.vocab import DraftVocab
from pardec.train import run, validate
from pardec.training.completions import load_completions
from pardec.training.drafter.dflash import (
    DFlashCollator,
    anchor_candidates,
    block_mask,
    block_outputs,
    block_terms,
    label_grid,
    position_weights,
    sample_anchors,
)
from pardec.training.drafter.target import TargetPass
from tests.conftest import tiny
from tests.training.test_train_app import _compose


def test_anchors_are_completion_positions_drawn_per_sequence_and_epoch():
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 1, 0], dtype=torch.bool)  # x_3 .. x_7 are completion tokens
    assert anchor_candidates(mask).tolist() == [3, 4, 5, 6]  # x_a and x_{a+1} both completion tokens
    assert sample_anchors(mask, 10, 0).tolist() == [3, 4, 5, 6]
    a = sample_anchors(mask, 2, 1)
    assert len(a) == 2 and a.tolist() == sorted(a.tolist()) and set(a.tolist()) <= {3, 4, 5, 6}
    assert torch.equal(a, sample_anchors(mask, 2, 1))
    col = DFlashCollator(pad_id=0, num_anchors=2, seed=3)
    samples = [{"input_ids": list(range(10, 22)), "loss_mask": [0] * 4 + [1] * 8},
               {"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}]
    b1, b2 = col(samples), col(samples)
    assert torch.equal(b1["anchors"], b2["anchors"])  # a resumed run draws the same anchors
    assert b1["anchor_valid"].tolist() == [[True, True], [True, False]]
    draws = set()
    for epoch in range(6):
        col.epoch = epoch
        draws.add(tuple(col(samples)["anchors"][0].tolist()))
    assert len(draws) > 1  # a fresh draw per epoch


def test_the_block_mask_sees_the_context_before_the_anchor_and_its_own_block():
    m = block_mask(torch.tensor([[2, 4]]), t=6, block=3)[0]  # [6 queries, 6 context + 6 block keys]
    assert m.shape == (6, 12)
    assert m[:3, :6].tolist() == [[True, True, False, False, False, False]] * 3  # anchor 2: positions 0, 1
    assert m[3:, :6].tolist() == [[True] * 4 + [False] * 2] * 3
    assert m[:3, 6:9].all() and not m[:3, 9:].any() and m[3:, 9:].all() and not m[3:, 6:9].any()


def test_labels_count_completion_tokens_inside_the_sequence():
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]], dtype=torch.bool)  # x_2 .. x_5 completion tokens (x_6 not in ids)
    labels, counted = label_grid(ids, mask, torch.tensor([[2, 4]]), torch.tensor([[True, True]]), 4)
    assert labels.tolist() == [[[13, 14, 15], [15, 15, 15]]]
    assert counted.tolist() == [[[True, True, True], [True, False, False]]]


def test_decay_and_dpace_weights_against_a_hand_computation():
    counted = torch.tensor([[[True, True, True, False]]])
    w = position_weights("decay", torch.zeros(1, 1, 4), counted, gamma=7.0, alpha=0.5)
    assert w[0, 0].tolist() == pytest.approx([1.0, math.exp(-1 / 7), math.exp(-2 / 7), 0.0])
    ce = torch.tensor([[[0.0, math.log(2), math.log(4), 1.0]]])  # q = 1, 1/2, 1/4 (the last slot not counted)
    w = position_weights("dpace", ce, counted, gamma=7.0, alpha=0.5)
    s = [1.0, 0.75, 0.625]  # (1 - a) q + a
    p = [1.0, 0.75, 0.75 * 0.625]  # prefix products
    want = [sum(p[0:]), sum(p[1:]), sum(p[2:]), 0.0]  # w_k = sum_{j >= k} P_j
    assert s[0] * s[1] == pytest.approx(p[1]) and w[0, 0].tolist() == pytest.approx(want)


def test_the_loss_equals_a_plain_per_block_reference():
    """block_terms over two anchors at once = the draft run on each block alone (its context cut at the anchor),
    CE to the labels weighted exp(-(k - 1) / gamma)."""
    lm = tiny(0, layers=4)
    torch.manual_seed(0)
    d = new_drafter("dflash", lm.model.config, embed=lm.model.model.embed_tokens, lm_head=lm.model.lm_head,
                    dflash={"num_layers": 2, "block_size": 3})
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    feats = torch.randn(1, 8, 2 * d.config.hidden_size)
    tp = TargetPass(feats, None, None)
    embed, head = lm.model.model.embed_tokens, lm.model.lm_head
    anchors, valid = torch.tensor([[2, 5]]), torch.tensor([[True, True]])
    terms = block_terms(d, tp, embed, head, ids, mask, anchors, valid, 3, gamma=7.0)
    want = 0.0
    for a in (2, 5):
        ctx = d.context_kv(feats[:, :a], torch.arange(a))
        out = d(d.block_inputs(embed, ids[:, a], 3), torch.arange(a, a + 3), ctx)
        logp = d.logits(out[0, 1:], head).log_softmax(-1)
        for k in (1, 2):
            want += -logp[k - 1, ids[0, a + k]] * math.exp(-(k - 1) / 7)
    torch.testing.assert_close(terms.total, torch.as_tensor(want, dtype=terms.total.dtype), rtol=1e-4, atol=1e-4)
    assert terms.count.tolist() == [2, 2]


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_a_reduced_head_trains_over_its_own_ids(loss):
    """drafter.draft_vocab_size: an own head over K ids, started from the target head's rows; block_terms = the
    per-block reference over those K logits (kl: the target's distribution restricted to them); a label outside
    them adds no term, stays counted, and is a miss in the top-1."""
    lm = tiny(0, layers=4)
    embed, head = lm.model.model.embed_tokens, lm.model.lm_head
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
    keep = [0, 1, 2, 4, 7, 8, 9, 15, 16, 23]  # 42 (slot 1's label at anchor 4) is not a draft id
    vocab = DraftVocab(keep, lm.model.config.vocab_size)
    torch.manual_seed(0)
    d = new_drafter("dflash", lm.model.config, embed=embed, lm_head=head, vocab=vocab,
                    dflash={"num_layers": 2, "block_size": 3})
    assert d.config.reduced and d.config.draft_vocab_size == len(keep)
    assert torch.equal(d.lm_head.weight, head.weight[vocab.ids]) and d.lm_head.weight.requires_grad
    feats = torch.randn(1, 8, 2 * d.config.hidden_size)
    target_logits = torch.randn(1, 8, lm.model.config.vocab_size)
    tp = TargetPass(feats, target_logits, None)
    anchors, valid = torch.tensor([[2, 4]]), torch.tensor([[True, True]])
    mask = torch.ones_like(ids, dtype=torch.bool)
    terms = block_terms(d, tp, embed, head, ids, mask, anchors, valid, 3, gamma=7.0, loss=loss)
    want, agree = 0.0, [0, 0]
    for a in (2, 4):
        ctx = d.context_kv(feats[:, :a], torch.arange(a))
        out = d(d.block_inputs(embed, ids[:, a], 3), torch.arange(a, a + 3), ctx)
        logq = d.logits(out[0, 1:], head).log_softmax(-1)  # [2, K]
        assert logq.shape[-1] == len(keep)
        for k in (1, 2):
            label = int(ids[0, a + k])
            agree[k - 1] += keep[int(logq[k - 1].argmax())] == label
            if loss == "kl":
                logp = target_logits[0, a + k - 1, keep].log_softmax(-1)
                want += (logp.exp() * (logp - logq[k - 1])).sum() * math.exp(-(k - 1) / 7)
            elif label in keep:
                want += -logq[k - 1, keep.index(label)] * math.exp(-(k - 1) / 7)
    torch.testing.assert_close(terms.total, torch.as_tensor(want, dtype=terms.total.dtype), rtol=1e-4, atol=1e-4)
    assert terms.count.tolist() == [2, 2] and terms.agree.tolist() == agree


def test_a_reduced_head_grows_on_a_whole_vocabulary_drafter(tmp_path):
    """drafter.init_from a whole-vocabulary drafter with drafter.draft_vocab_size: every trained tensor is the
    prior's, the head the target's rows at the counted ids; the drafter saves and loads reduced, records the vocabulary
    it was made with, and decodes exactly as ar (greedy, fp32)."""
    first = tmp_path / "out" / "first"
    summary = run(_compose(_overrides(tmp_path)), first)
    assert summary["train"]["steps"] == 2
    second = tmp_path / "out" / "second"
    summary = run(_compose(_overrides(tmp_path, f"+drafter.init_from={first}/final", "+drafter.draft_vocab_size=64")),
                  second)
    lm = tiny(0, layers=4)
    prior, _ = load_drafter(first / "final", lm.model.config, "dflash")
    d, meta = load_drafter(second / "final", lm.model.config, "dflash")
    assert d.config.reduced and d.config.draft_vocab_size == 64 and meta["draft_vocab_size"] == 64
    assert 0 < meta["draft_vocab_coverage"] <= 1 and meta["total_steps"] == 4
    assert set(lm.eos_ids) <= set(d.vocab.ids.tolist())
    state = prior.state_dict()
    for k, v in d.state_dict().items():  # every tensor but the new head's is the prior's, trained on
        assert k in ("lm_head.weight", "d2t", "t2d") or v.shape == state[k].shape
    ev = json.loads((second / "drafter_eval.json").read_text())
    assert ev["positions"] > 0 and len(ev["overall"]["conditional_acceptance"]) == 3
    cm = CachedModel(lm.model, forward_impl="lean")
    ar = build_decoder("ar", cm)
    for prompt in ([3, 1, 4, 1, 5], [9, 2, 6]):
        assert build_decoder("dflash", cm, None, d).generate(prompt, 20).tokens == ar.generate(prompt, 20).tokens


def _overrides(tmp_path, *extra: str) -> list[str]:
    return ["+experiment=dflash_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out", *extra]


def test_tiny_end_to_end(tmp_path):
    run_dir = tmp_path / "out" / "run"
    summary = run(_compose(_overrides(tmp_path)), run_dir)
    assert summary["generate"]["complete"] and summary["train"]["samples"] == 6 and summary["train"]["steps"] == 2
    lm = tiny(0, layers=4)
    drafter, meta = load_drafter(run_dir / "final", lm.model.config, "dflash")
    c = drafter.config
    assert (c.num_hidden_layers, c.block_size, c.layer_ids, c.mask_token_id) == (2, 4, [0, 3], None)
    assert (meta["num_anchors"], meta["gamma"], meta["loss"], meta["weighting"]) == (8, 7.0, "ce", "decay")
    ev = json.loads((run_dir / "drafter_eval.json").read_text())
    o = ev["overall"]
    assert ev["kind"] == "dflash" and ev["block_size"] == 4 and ev["steps"] == 3 and ev["positions"] > 0
    assert len(o["conditional_acceptance"]) == 3
    assert o["expected_tokens_per_forward"] == pytest.approx(1 + sum(o["chain_acceptance"]))
    # each slot's rank accuracies (rank 0: its top-1 agreement), pooled over the sources, and the trees searched
    # from them into final/trees, which method.tree loads
    ranks = o["rank_accuracy"]
    assert len(ranks) == 3 and all(len(r) == ev["topk"] for r in ranks)
    assert [r[0] for r in ranks] == pytest.approx(o["top1_agreement"])
    assert [sum(r) for r in ranks] == pytest.approx(o["topk_containment"])
    parts = list(ev["per_dataset"].values())
    assert o["counts"]["rank"] == [[sum(p["counts"]["rank"][d][r] for p in parts) for r in range(ev["topk"])]
                                   for d in range(3)]
    for b in (16, 32, 63):
        tree = load_tree(run_dir / "final" / "trees" / f"T{b}.json", 3)
        assert 1 <= len(tree.paths) <= b and ev["trees"][f"T{b}"]["nodes"] == len(tree.paths)
    assert ev["trees"]["chain"]["expected_accept_length"] <= ev["trees"]["T63"]["expected_accept_length"]
    # the held-out walk is what greedy decoding of the eval prompts makes: the same tokens per target forward
    records = load_completions(tmp_path / "data" / "completions" / "dflash_tiny" / "eval" / "gsm8k")
    dec = build_decoder("dflash", CachedModel(lm.model), None, drafter)
    made = [dec.generate(r["prompt_ids"], 8, Stopper(eos_ids=lm.eos_ids)) for r in records]
    assert [m.tokens for m in made] == [r["completion_ids"] for r in records]
    tokens, forwards = sum(len(m.tokens) for m in made), sum(m.target_forwards for m in made)
    assert forwards < tokens and o["decoding_tokens_per_forward"] == pytest.approx(tokens / forwards)  # drafts taken
    # the logged per-slot loss is the cross-entropy to the label, named so (the other types log a KL)
    logged = [h for h in json.loads((run_dir / "log_history.json").read_text()) if "top1" in h]
    assert logged and all({"ce", "ce_d1", "ce_d3", "top1_d3"} <= set(h) and "kl" not in h and "kl_d1" not in h
                          for h in logged)


def test_config_errors(tmp_path):
    cases = [
        (["drafter.block_size=1"], "drafter.block_size=1 is out of range: it must be an integer >= 2"),
        (["drafter.num_layers=0"], "drafter.num_layers=0 is out of range: it must be an integer >= 1"),
        (["drafter.num_anchors=0"], "drafter.num_anchors=0 is out of range"),
        (["drafter.gamma=0"], r"drafter.gamma=0\.0 is out of range"),
        (["+drafter.loss=mse"], r"drafter.loss='mse' is not valid; choose one of: ce, kl"),
        (["+drafter.weighting=flat"], r"drafter.weighting='flat' is not valid; choose one of: decay, dpace"),
        (["+drafter.fusion=mix"], r"drafter.fusion='mix' is not valid; choose one of: concat, layerwise"),
        (["+drafter.dpace_alpha=0"], r"drafter.dpace_alpha=0\.0 is out of range"),
        (["+drafter.layers=[0,4]"], r"drafter.layers=\[0, 4\] is out of range: the target tiny_random has layers 0..3"),
        (["+drafter.draft_vocab_size=1"], r"drafter.draft_vocab_size=1 is out of range: it must be an integer >= 2"),
        (["+drafter.layer_init=copy"], r"drafter.layer_init='copy' is not valid; choose one of: random, target"),
        (["+drafter.layer_init=target"], r"drafter.layer_init=target needs drafter.fusion=layerwise"),
        (["+drafter.layer_init=target", "+drafter.fusion=layerwise", "+drafter.layers=[0,1,2]"],
         r"drafter.layers=\[0, 1, 2\] is not valid with drafter.layer_init=target: give one target layer per draft layer"),
    ]
    for ov, pattern in cases:
        with pytest.raises(ConfigError, match=pattern) as e:
            run(_compose(_overrides(tmp_path, *ov)), tmp_path / "out" / "bad")
        assert "\n" not in str(e.value)
    assert not (tmp_path / "out").exists()
    spec = validate(_compose(["+experiment=dflash_smollm2", f"paths.data_dir={tmp_path}/data",
                              f"paths.output_dir={tmp_path}/out"]))
    assert spec.drafter == {"type": "dflash", "num_layers": 5, "layers": None, "block_size": 16, "num_anchors": 32,
                          "gamma": 7.0, "loss": "ce", "weighting": "decay", "dpace_alpha": 0.5, "fusion": "concat",
                          "mask_token_id": None, "layer_init": "random", "draft_vocab_size": None}
    assert spec.trainer["learning_rate"] == 6e-4 and spec.trainer["lr_scheduler_type"] == "cosine"


@pytest.mark.parametrize("fusion", ["concat", "layerwise"])
def test_slot_one_reads_the_context_before_its_anchor_and_the_anchor_token(fusion):
    """The training path's slot-1 logits of a block at anchor a change when only the target features of a context
    position before a change, and when only the anchor token changes; they do not change when features at or after
    a change (the block sees the context keys < a) or when another block's anchor token changes."""
    lm = tiny(0, layers=4)
    torch.manual_seed(0)
    d = new_drafter("dflash", lm.model.config, embed=lm.model.model.embed_tokens, lm_head=lm.model.lm_head,
                    dflash={"num_layers": 2, "block_size": 3, "fusion": fusion})
    embed, head = lm.model.model.embed_tokens, lm.model.lm_head
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])
    feats = torch.randn(1, 8, 2 * d.config.hidden_size)
    anchors = torch.tensor([[2, 5]])

    def slot1(ids, feats):  # [A, V]: each block's slot-1 logits
        return d.logits(block_outputs(d, TargetPass(feats, None, None), embed, ids, anchors, 3)[0, :, 1], head)

    base = slot1(ids, feats)
    for pos in (0, 1, 4):  # a context position before the second anchor (5); 0 and 1 also before the first (2)
        f = feats.clone()
        f[0, pos] += torch.randn(f.shape[-1])
        changed = (slot1(ids, f) - base).abs().amax(-1) > 1e-5
        assert changed.tolist() == [pos < 2, True], pos
    for pos in (2, 6):  # at an anchor or after it: unseen by the block
        f = feats.clone()
        f[0, pos] += torch.randn(f.shape[-1])
        changed = (slot1(ids, f) - base).abs().amax(-1) > 1e-5
        assert changed.tolist() == [False, pos < 5], pos
    other = ids.clone()
    other[0, 5] = 11  # the second block's anchor token only
    changed = (slot1(other, feats) - base).abs().amax(-1) > 1e-5
    assert changed.tolist() == [False, True]


def test_layer_init_target_copies_the_target_layers_reading_their_own_states():
    """layer_init='target': draft layer i is target layer layers[i] (its input norm folded into q/k/v), its layer
    mix on its own target state, so the context values are the target's own at that layer and the context keys
    point the target's way (k_norm rescales each head's key by one calibrated constant over its RMS)."""
    from pardec.models.dflash import init_from_target
    from pardec.models.rotary import rotate

    lm = tiny(0, layers=4)
    base = lm.model
    torch.manual_seed(0)
    d = new_drafter("dflash", base.config, layers=[1, 2], embed=base.model.embed_tokens,
                    dflash={"num_layers": 2, "block_size": 3, "fusion": "layerwise"})
    samples = [torch.tensor([4, 8, 15, 16, 23, 42, 7, 9]), torch.tensor([3, 5, 7, 11, 13])]
    init_from_target(d, base, samples)
    assert (d.layer_mix.softmax(-1).diagonal() > 1 - 1e-4).all()
    assert torch.equal(d.hidden_norm.weight, torch.ones_like(d.hidden_norm.weight))
    ids = samples[0][None]
    states = base(ids, output_hidden_states=True).hidden_states
    feats = torch.cat([states[1], states[2]], -1)
    context = d.context_kv(feats, torch.arange(ids.shape[1]))
    cos, sin = d.rotary_tables(states[1], torch.arange(ids.shape[1]))
    for i, j in enumerate([1, 2]):
        mine, theirs = d.layers[i], base.model.layers[j]
        assert torch.equal(mine.mlp.down_proj.weight, theirs.mlp.down_proj.weight)
        assert torch.equal(mine.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight)
        assert torch.allclose(mine.self_attn.q_proj.weight,
                              theirs.self_attn.q_proj.weight * theirs.input_layernorm.weight)
        h = theirs.input_layernorm(states[j])
        a = mine.self_attn
        v = theirs.self_attn.v_proj(h).view(1, -1, a.kv_heads, a.head_dim).transpose(1, 2)
        assert torch.allclose(context[i][1], v, atol=1e-4)
        k = rotate(theirs.self_attn.k_proj(h).view(1, -1, a.kv_heads, a.head_dim).transpose(1, 2), cos, sin)
        assert (F.cosine_similarity(context[i][0], k, dim=-1) > 0.9999).all()
        want = torch.cat([theirs.self_attn.k_proj(theirs.input_layernorm(s[j][0])).view(-1, a.kv_heads, a.head_dim)
                          .pow(2).mean(-1).sqrt().flatten()
                          for s in (base(x[None], output_hidden_states=True).hidden_states for x in samples)]).mean()
        assert torch.allclose(a.k_norm.weight, want.expand_as(a.k_norm.weight), rtol=1e-4)
    with pytest.raises(ConfigError, match="needs fusion='layerwise'"):
        init_from_target(new_drafter("dflash", base.config, layers=[1, 2], dflash={"num_layers": 2}), base, samples)


def test_tiny_end_to_end_from_the_target_layers(tmp_path):
    run_dir = tmp_path / "out" / "run"
    summary = run(_compose(_overrides(tmp_path, "+drafter.fusion=layerwise", "+drafter.layer_init=target",
                                      "+drafter.layers=null")), run_dir)
    assert summary["train"]["steps"] == 2 and summary["train"]["layer_init"] == "target"
    drafter, meta = load_drafter(run_dir / "final", tiny(0, layers=4).model.config, "dflash")
    assert drafter.config.layer_ids == [0, 1] and meta["layer_init"] == "target"
    assert (run_dir / "drafter_eval.json").exists()


def test_a_pass_without_logits_stops_at_the_last_layer_the_draft_reads():
    """target_pass(logits=False): the same features as the full pass, no logits, and the layers after the last
    state the draft reads never run (what makes DFlash from the target's first layers cheap to train)."""
    from pardec.training.drafter.target import target_pass

    base = tiny(0, layers=4).model
    ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(base.model.layers)]
    try:
        full = target_pass(base, ids, [0, 2])
        assert ran == [0, 1, 2, 3] and full.logits is not None
        ran.clear()
        cut = target_pass(base, ids, [0, 2], logits=False)
        assert ran == [0, 1] and cut.logits is None
        assert torch.equal(cut.features, full.features) and torch.equal(cut.emb, full.emb)
    finally:
        for h in hooks:
            h.remove()
