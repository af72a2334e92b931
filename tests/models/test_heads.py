"""FIRP's pseudo-state forward against a brute force that runs each anchor's pseudo states on their own, and the
drafters' save / load checks."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding.tree import Tree
from pardec.models.cached import CachedModel
from pardec.models.drafters import load_drafter, new_drafter, save_drafter
from pardec.models.heads import FirpProjections, MedusaHeads
from pardec.models.pseudo import forward_pseudo
from tests.conftest import tiny


def _random_projections(hidden: int, layers: list[int], seed: int = 0) -> FirpProjections:
    proj = FirpProjections(hidden, 0, layers)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in proj.proj:
            p.weight.add_(torch.randn(p.weight.shape, generator=g) * 0.2)
            p.bias.copy_(torch.randn(p.bias.shape, generator=g) * 0.1)
    return proj


def _brute(model, seq: list[int], positions: list[int], proj: FirpProjections, attention: str = "pseudo",
           anchor: int | None = None) -> torch.Tensor:
    """The pseudo states of token ``anchor`` of ``seq`` (default: its last) alone, no cache, plainly causal over
    ``seq`` (its real tokens up to the pseudo state's position - 1 come first), pseudo state i joining entering layer
    ``layers[i]`` at position ``positions[anchor] + i + 1``. ``pseudo``: the K states together, each seeing ``seq``,
    the earlier pseudo states and itself; ``real`` (FIRP §3.3): each state on its own, seeing the real tokens of
    ``seq`` before its position (``seq[: anchor + i + 1]``) and itself. Returns [K, V] logits."""
    a = len(seq) - 1 if anchor is None else anchor
    if attention == "real":
        return torch.stack([_brute_steps(model, seq[: a + i + 1], positions[: a + i + 1], proj, [i], a)[0]
                            for i in range(proj.k)])
    return _brute_steps(model, seq[: a + 1], positions[: a + 1], proj, list(range(proj.k)), a)


def _brute_steps(model, seq, positions, proj, steps: list[int], a: int) -> torch.Tensor:
    """``seq`` then pseudo steps ``steps`` of token ``a``, all plainly causal; [len(steps), V] logits."""
    inner = model.model
    h = inner.embed_tokens(torch.tensor([seq]))
    n = len(seq)
    pos = torch.tensor([positions + [positions[a] + i + 1 for i in steps]])
    todo = list(steps)
    for layer in range(len(inner.layers)):
        while todo and proj.layers[todo[0]] == layer:
            h = torch.cat([h, proj(todo.pop(0), h[:, a : a + 1])], dim=1)
        m = h.shape[1]
        causal = torch.full((m, m), torch.finfo(h.dtype).min).triu(1)[None, None]
        rope = inner.rotary_emb(h, position_ids=pos[:, :m])
        h = inner.layers[layer](h, attention_mask=causal, position_embeddings=rope, position_ids=pos[:, :m])
    return model.lm_head(inner.norm(h))[0, n:]


@pytest.mark.parametrize("attention", ["real", "pseudo"])
@pytest.mark.parametrize("layers", [[0, 1, 2], [1, 1], [2]])
def test_pseudo_forward_over_a_tree_equals_brute_force_per_anchor(layers, attention):
    lm = tiny(1, layers=3)
    model = lm.model
    proj = _random_projections(model.config.hidden_size, layers)
    cm = CachedModel(model)
    prompt = list(range(700, 706))
    cm.prefill(torch.tensor([prompt]))
    tree = Tree.from_parents([-1, 0, 0, 1, 3], [-1, 11, 12, 13, 14])
    toks = tree.tokens(42)
    with torch.no_grad():
        out = forward_pseudo(cm, toks[None], proj, layers, positions=tree.positions(6), attend=tree.attend,
                                attention=attention)
        assert cm.length == 6 + len(tree)  # the tree is appended, the pseudo states are not
        assert cm.tokens == prompt + toks.tolist()
        plain = CachedModel(model)
        plain.prefill(torch.tensor([prompt]))
        ref_logits = plain.forward(toks[None], positions=tree.positions(6), attend=tree.attend).logits[0]
        torch.testing.assert_close(out.logits[0], ref_logits, rtol=1e-4, atol=1e-5)
        for node in range(len(tree)):
            path = tree.path_to(node)
            seq = prompt + [int(toks[i]) for i in path]
            want = _brute(model, seq, list(range(6)) + [6 + int(tree.depth[i]) for i in path], proj, attention)
            got = cm.lm_head(out.pseudo[0, node])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # the cache still serves later forwards exactly
        nxt = cm.forward(torch.tensor([[99]]), positions=torch.tensor([6 + len(tree)])).logits[0, -1]
        plain.forward(torch.tensor([[99]]), positions=torch.tensor([6 + len(tree)]))
        assert nxt.shape[-1] == model.config.vocab_size


@pytest.mark.parametrize("layers", [[0, 1, 2], [1, 1, 2]])
def test_teacher_forced_pseudo_states_see_the_real_tokens_before_them(layers):
    """FIRP §3.3 in training: on a known sequence, the pseudo state of position j + i (anchor j, step i) sees the
    real tokens up to j + i - 1 and itself, in the one-pass and the split forward alike."""
    model = tiny(1, layers=3).model
    proj = _random_projections(model.config.hidden_size, layers, seed=3)
    seq = list(range(300, 310))
    anchors = [2, 5, 6, 9]  # 9: the last token, no real token after it (a state past the end sees what exists)
    with torch.no_grad():
        for split in (False, True):
            cm = CachedModel(model)
            out = forward_pseudo(cm, torch.tensor([seq]), proj, layers, anchors=anchors, split=split,
                                    teacher_forced=True)
            for n, a in enumerate(anchors):
                want = _brute(model, seq, list(range(len(seq))), proj, "real", anchor=a)
                torch.testing.assert_close(cm.lm_head(out.pseudo[0, n]), want, rtol=1e-4, atol=1e-4)
            # without teacher forcing (decoding's view) step i >= 1 sees only the anchor's prefix: other logits
            plain = forward_pseudo(CachedModel(model), torch.tensor([seq]), proj, layers, anchors=[2])
            torch.testing.assert_close(plain.pseudo[0, 0, 0], out.pseudo[0, 0, 0], rtol=1e-4, atol=1e-5)
            assert not torch.allclose(plain.pseudo[0, 0, 1], out.pseudo[0, 0, 1], atol=1e-3)
    cm = CachedModel(model)
    with pytest.raises(ValueError, match="teacher_forced needs attention='real'"):
        forward_pseudo(cm, torch.tensor([seq]), proj, layers, attention="pseudo", teacher_forced=True)
    with pytest.raises(ValueError, match="pseudo attention='all' is not valid; choose one of: real, pseudo"):
        forward_pseudo(cm, torch.tensor([seq]), proj, layers, attention="all")


@pytest.mark.parametrize("attention", ["real", "pseudo"])
def test_real_attention_trains_each_projection_on_its_own(attention):
    """With ``real`` the loss of step i reaches projection i alone (the paper trains each projection separately);
    with ``pseudo`` a later step's loss also reaches the earlier projections through attention."""
    import copy

    model = copy.deepcopy(tiny(1, layers=3).model).requires_grad_(False)
    proj = _random_projections(model.config.hidden_size, [0, 1, 2])
    ids = torch.tensor([list(range(300, 310))])
    for step in range(3):
        proj.zero_grad()
        out = forward_pseudo(CachedModel(model), ids, proj, proj.layers, anchors=[3, 5], split=True,
                                                attention=attention, teacher_forced=attention == "real")
        CachedModel(model).lm_head(out.pseudo[:, :, step]).logsumexp(-1).sum().backward()
        reached = [p.weight.grad is not None and float(p.weight.grad.abs().sum()) > 0 for p in proj.proj]
        want = [i == step for i in range(3)] if attention == "real" else [i <= step for i in range(3)]
        assert reached == want


@pytest.mark.parametrize("layers", [[1, 2], [0, 0, 2]])
def test_pseudo_forward_trains_only_the_projections_and_split_gives_the_same(layers):
    import copy

    model = copy.deepcopy(tiny(1, layers=3).model).requires_grad_(False)
    proj = _random_projections(model.config.hidden_size, layers)
    cm = CachedModel(model)
    ids = torch.tensor([list(range(300, 310))])
    grads, outs = [], []
    for split in (False, True):
        cm.reset()
        proj.zero_grad()
        out = forward_pseudo(cm, ids, proj, proj.layers, anchors=[3, 5, 9], split=split, logits_at=[2, 3])
        assert cm.length == 10
        loss = cm.lm_head(out.pseudo).logsumexp(-1).mean()
        loss.backward()
        assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in proj.parameters())
        grads.append([p.grad.clone() for p in proj.parameters()])
        outs.append((out.logits.detach(), out.pseudo.detach()))
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


def test_pseudo_layers_and_anchors_are_checked():
    cm = CachedModel(tiny(1, layers=3).model)
    ident = FirpProjections(64, 0, [0])
    with pytest.raises(ValueError, match="out of range"):
        forward_pseudo(cm, torch.tensor([[1, 2]]), ident, [3])
    with pytest.raises(ValueError, match="nondecreasing"):
        forward_pseudo(cm, torch.tensor([[1, 2]]), ident, [2, 1])
    with pytest.raises(ValueError, match="anchors"):
        forward_pseudo(cm, torch.tensor([[1, 2]]), ident, [1], anchors=[5])
    assert cm.length == 0


def test_final_hidden_is_the_lm_head_input():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    with torch.inference_mode():
        out = cm.forward(torch.tensor([[5, 6, 7]]), hidden_layer=lm.model.config.num_hidden_layers)
        torch.testing.assert_close(cm.lm_head(out.hidden), out.logits, rtol=1e-5, atol=1e-5)


def test_untrained_medusa_heads_repeat_the_lm_head():
    lm = tiny(0)
    heads = new_drafter("medusa", lm.model.config, num_heads=2, lm_head=lm.model.lm_head)
    h = torch.randn(3, lm.model.config.hidden_size)
    out = heads(h)
    assert out.shape == (3, 2, lm.model.config.vocab_size)
    torch.testing.assert_close(out[:, 1], lm.model.lm_head(h))


def test_drafters_round_trip_and_refuse_another_model(tmp_path):
    small, other = tiny(0), tiny(1, layers=3)
    heads = new_drafter("medusa", small.model.config, num_heads=2, lm_head=small.model.lm_head)
    save_drafter(heads, tmp_path / "m", small.model.config, "tiny")
    back, meta = load_drafter(tmp_path / "m", small.model.config, "medusa")
    assert isinstance(back, MedusaHeads) and meta["k"] == 2 and meta["parameters"] > 0
    h = torch.randn(2, small.model.config.hidden_size)
    torch.testing.assert_close(back(h), heads(h))
    proj = new_drafter("firp", other.model.config, layers=[1, 2])
    save_drafter(proj, tmp_path / "f", other.model.config, "tiny3")
    assert load_drafter(tmp_path / "f", other.model.config, "firp")[0].layers == [1, 2]
    with pytest.raises(ConfigError, match="num_hidden_layers 3.*the target has num_hidden_layers 2"):
        load_drafter(tmp_path / "f", small.model.config, "firp")
    with pytest.raises(ConfigError, match="holds 'firp' weights; this method needs 'medusa'"):
        load_drafter(tmp_path / "f", other.model.config, "medusa")
    with pytest.raises(ConfigError, match="no trained drafter"):
        load_drafter(tmp_path / "nothing", small.model.config, "medusa")
    wide = tiny(0).model.config.__class__(**{**small.model.config.to_dict(), "hidden_size": 128})
    with pytest.raises(ConfigError, match="hidden_size 64.*the target has hidden_size 128"):
        load_drafter(tmp_path / "m", wide, "medusa")
    with pytest.raises(ConfigError, match="out of range"):
        new_drafter("firp", small.model.config, layers=[0, 2])
    with pytest.raises(ConfigError, match="nondecreasing"):
        new_drafter("firp", other.model.config, layers=[2, 1])


def test_low_rank_medusa_heads_train_only_their_update_and_save_it_merged(tmp_path):
    """``head_rank=r``: each head starts as the target's LM head, only the rank-r factors (and the ResBlocks)
    train, the target's head is shared and not saved, and the saved drafter (full heads, as decoders read it)
    gives the trained one's logits; its difference from the target's head has rank r."""
    lm = tiny(0)
    cfg, head = lm.model.config, lm.model.lm_head
    heads = new_drafter("medusa", cfg, num_heads=2, head_rank=3, lm_head=head)
    h = torch.randn(4, cfg.hidden_size)
    torch.testing.assert_close(heads(h)[:, 1], head(h))  # Medusa's initialisation
    trained = {n for n, p in heads.named_parameters() if p.requires_grad}
    assert trained == {f"heads.{i}.{n}" for i in range(2) for n in ("0.linear.weight", "0.linear.bias",
                                                                    "1.lora_a", "1.lora_b")}
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn(p.shape) * 0.05)
    assert heads.heads[0][1].base.data_ptr() == head.weight.data_ptr()  # shared, not copied
    save_drafter(heads, tmp_path / "r", cfg, "tiny")
    back, meta = load_drafter(tmp_path / "r", cfg, "medusa")
    assert meta["head_rank"] == 3 and not any("lora" in k for k in back.state_dict())
    torch.testing.assert_close(back(h), heads(h), rtol=1e-5, atol=1e-5)
    delta = back.heads[1][1].weight - head.weight
    assert torch.linalg.matrix_rank(delta).item() == 3
    with pytest.raises(ConfigError, match="drafter.head_rank=0 is out of range"):
        new_drafter("medusa", cfg, num_heads=2, head_rank=0, lm_head=head)


def test_firp_projections_record_their_attention(tmp_path):
    import json

    lm = tiny(0)
    cfg = lm.model.config
    assert new_drafter("firp", cfg, layers=[0, 1]).attention == "real"  # FIRP §3.3 by default
    out = save_drafter(new_drafter("firp", cfg, layers=[0, 1], attention="pseudo"), tmp_path / "p", cfg, "tiny")
    assert json.loads((out / "drafter.json").read_text())["attention"] == "pseudo"
    assert load_drafter(out, cfg, "firp")[0].attention == "pseudo"
    out = save_drafter(new_drafter("firp", cfg, layers=[0, 1]), tmp_path / "old", cfg, "tiny")
    meta = json.loads((out / "drafter.json").read_text())
    del meta["attention"]  # saved before the key existed: those were trained with the pseudo pattern
    (out / "drafter.json").write_text(json.dumps(meta))
    assert load_drafter(out, cfg, "firp")[0].attention == "pseudo"
    with pytest.raises(ConfigError, match=r"firp attention='both' is not valid; choose one of: real, pseudo"):
        new_drafter("firp", cfg, layers=[0], attention="both")
