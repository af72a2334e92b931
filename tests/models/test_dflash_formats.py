"""DFlash checkpoints in the published layouts (:mod:`pardec.models.dflash_formats`) and their export
(:mod:`pardec.export`), on a tiny 4-layer target.

* checkpoints written here by hand, key by key, in each external layout (z-lab's release: a Qwen3Config
  ``config.json`` with ``DFlashDraftModel``, ``block_size`` and ``dflash_config`` whose target layer ids count layer
  outputs from 0; ``speculators``: ``speculators_model_type: dflash`` with ``aux_hidden_state_layer_ids``) load
  into a draft whose block logits equal an independent reference forward written below from the reference's
  description, and decode exactly (greedy equals ``ar``);
* a pardec drafter exported to each layout loads back with the identical state dict and decodes identically; one
  over a reduced draft vocabulary (its own head and EAGLE-3's id maps) exports to ``speculators``' layout, loads
  back and decodes exactly, and is refused by z-lab's, which has none;
* bad checkpoints and bad export input: one line naming the bad value, nothing written.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from pardec.config import ConfigError
from pardec.decoding import build_decoder
from pardec.export import main as export_main
from pardec.models.cached import CachedModel
from pardec.models.dflash import restrict_vocab
from pardec.models.dflash_formats import detect, load_dflash
from pardec.models.drafters import new_drafter, save_drafter
from pardec.models.vocab import DraftVocab
from tests.conftest import VOCAB, tiny

H, INTER, HEADS, KV, HD = 64, 128, 4, 2, 16  # tiny(layers=4)'s shape, which the draft layers share
V, N_LAYERS, BLOCK, MASK_ID = VOCAB, 2, 4, 11
ZLAB_IDS = [0, 2]  # z-lab's convention (layer outputs); pardec's: [1, 3]


@pytest.fixture(scope="module")
def target():
    return tiny(0, layers=4)


def published_weights(seed: int, n_feat: int = 2) -> dict[str, torch.Tensor]:
    """Random weights under the published names; norms random too, so a swapped norm shows."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(shape[-1]))

    def norm(n):
        return 1 + 0.1 * r(n, scale=1)

    w = {"fc.weight": r(H, n_feat * H), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
    for i in range(N_LAYERS):
        p = f"layers.{i}."
        w.update({p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "self_attn.q_proj.weight": r(HEADS * HD, H), p + "self_attn.k_proj.weight": r(KV * HD, H),
                  p + "self_attn.v_proj.weight": r(KV * HD, H), p + "self_attn.o_proj.weight": r(H, HEADS * HD),
                  p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD),
                  p + "mlp.gate_proj.weight": r(INTER, H), p + "mlp.up_proj.weight": r(INTER, H),
                  p + "mlp.down_proj.weight": r(H, INTER)})
    return w


def qwen3_fields(**over) -> dict:
    return {"model_type": "qwen3", "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": N_LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None,
            "vocab_size": V, "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32", **over}


def write_zlab(d, w: dict, **over):
    """z-lab's layout (config.json as the released Qwen3 drafters: block_size at the top, dflash_config)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           **qwen3_fields(), "num_target_layers": 4, "block_size": BLOCK,
           "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": ZLAB_IDS}, **over}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    return d


def write_speculators(d, w: dict, **over):
    """speculators 0.9's dflash layout (DFlashSpeculatorConfig fields; hidden_states indices)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
           "transformer_layer_config": qwen3_fields(), "draft_vocab_size": V, "block_size": BLOCK,
           "target_hidden_size": H, "aux_hidden_state_layer_ids": [i + 1 for i in ZLAB_IDS],
           "mask_token_id": MASK_ID, "sliding_window_non_causal": False, "sample_from_anchor": False,
           "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": BLOCK - 1}],
                                  "verifier": {"name_or_path": "tiny/target", "architectures": ["LlamaForCausalLM"]}},
           **over}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    return d


# ---------------------------------------------------------------------------------------------- reference forward
def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta=10000.0):
    inv = 1.0 / theta ** (torch.arange(0, HD, 2).float() / HD)
    ang = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    return x * cos + torch.cat([-x[..., HD // 2:], x[..., : HD // 2]], -1) * sin


def reference_block_logits(w: dict, features, block_emb, start: int, head) -> torch.Tensor:
    """DFlash's draft over a block, from the reference's description (z-lab ``model.py``): ctx = hidden_norm(fc(f));
    per layer: context k = rope(k_norm(k_proj(ctx))), v = v_proj(ctx) at positions 0..S-1; block h =
    input_layernorm(x), q/k with q_norm/k_norm and rope at start.., attention of every block slot over context +
    the whole block (non-causal), + o_proj, + mlp(post_attention_layernorm); head(norm(.)). [B, V]."""
    s, b = features.shape[0], block_emb.shape[0]
    ctx = rms(features @ w["fc.weight"].T, w["hidden_norm.weight"])
    cpos, bpos = torch.arange(s), torch.arange(start, start + b)
    x = block_emb
    for i in range(N_LAYERS):
        p = f"layers.{i}."

        def heads(t, name, n, pos, normed=True, p=p):
            y = (t @ w[p + f"self_attn.{name}_proj.weight"].T).view(-1, n, HD)
            if normed:
                y = rms(y, w[p + f"self_attn.{name}_norm.weight"])
            return y.transpose(0, 1) if not normed else rope(y.transpose(0, 1), pos)

        h = rms(x, w[p + "input_layernorm.weight"])
        q = heads(h, "q", HEADS, bpos)
        k = torch.cat([heads(ctx, "k", KV, cpos), heads(h, "k", KV, bpos)], 1)
        v = torch.cat([heads(ctx, "v", KV, cpos, normed=False), heads(h, "v", KV, bpos, normed=False)], 1)
        k, v = k.repeat_interleave(HEADS // KV, 0), v.repeat_interleave(HEADS // KV, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(HD), -1) @ v  # no mask: context + whole block
        x = x + att.transpose(0, 1).reshape(b, -1) @ w[p + "self_attn.o_proj.weight"].T
        hh = rms(x, w[p + "post_attention_layernorm.weight"])
        x = x + (F.silu(hh @ w[p + "mlp.gate_proj.weight"].T) * (hh @ w[p + "mlp.up_proj.weight"].T)) @ \
            w[p + "mlp.down_proj.weight"].T
    return head(rms(x, w["norm.weight"]))


@pytest.mark.parametrize("layout", ["dflash", "speculators"])
def test_a_published_checkpoint_loads_matches_the_reference_and_decodes_exactly(target, tmp_path, layout):
    w = published_weights(1)
    d = (write_zlab if layout == "dflash" else write_speculators)(tmp_path / layout, w)
    assert detect(d) == layout
    drafter, meta = load_dflash(str(d), target.model.config)
    assert meta["source_format"] == layout and meta["layer_ids"] == [1, 3]  # z-lab's ids + 1
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.num_hidden_layers, c.fusion) == (BLOCK, MASK_ID, N_LAYERS, "concat")
    cm = CachedModel(target.model, forward_impl="lean")
    prompt = [3, 17, 256, 1812, 9, 40]
    with torch.inference_mode():
        feats = cm.forward(torch.tensor([prompt]), hidden_layer=tuple(c.layer_ids)).hidden[0]
        embed = target.model.model.embed_tokens
        x = drafter.block_inputs(embed, torch.tensor([prompt[-1]]), BLOCK)
        got = drafter.logits(drafter(x, torch.arange(5, 5 + BLOCK), drafter.context_kv(feats[None, :5],
                                                                                      torch.arange(5)))[0],
                             target.model.lm_head)
        emb = torch.cat([embed(torch.tensor([prompt[-1]])), embed(torch.tensor([MASK_ID])).expand(BLOCK - 1, -1)])
        want = reference_block_logits(w, feats[:5], emb, 5, target.model.lm_head)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    ref = build_decoder("ar", cm).generate(prompt, 16).tokens
    assert build_decoder("dflash", cm, None, None, path=str(d)).generate(prompt, 16).tokens == ref


@pytest.mark.parametrize("fmt", ["dflash", "speculators"])
@pytest.mark.parametrize("options", [{}, {"mask_token_id": MASK_ID}, {"fusion": "layerwise"}])
def test_an_export_loads_back_identically(target, tmp_path, capsys, fmt, options):
    cfg = target.model.config
    torch.manual_seed(0)
    d = new_drafter("dflash", cfg, embed=target.model.model.embed_tokens,
                    dflash={"num_layers": 2, "block_size": BLOCK, **options})
    src = save_drafter(d, tmp_path / "pardec", cfg, "tiny_random")
    out = tmp_path / "out"
    assert export_main([str(src), "--format", fmt, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert '"method": "dflash"' in printed and "--speculative-algorithm DFLASH" in printed
    assert ("learned embedding" in printed) == ("mask_token_id" not in options)
    back, meta = load_dflash(str(out), cfg)
    assert meta["source_format"] == fmt and back.config.layer_ids == d.config.layer_ids
    state = load_file(str(out / "model.safetensors"))
    for k, v in d.state_dict().items():
        torch.testing.assert_close(state[k], v)
        torch.testing.assert_close(back.state_dict()[k], v)
    c = json.loads((out / "config.json").read_text())
    if fmt == "dflash":
        assert c["architectures"] == ["DFlashDraftModel"] and c["num_target_layers"] == 4
        assert c["dflash_config"]["target_layer_ids"] == [i - 1 for i in d.config.layer_ids]
    else:
        assert c["speculators_model_type"] == "dflash" and c["aux_hidden_state_layer_ids"] == d.config.layer_ids
    cm = CachedModel(target.model, forward_impl="lean")
    prompt = [5, 6, 7, 8]
    assert (build_decoder("dflash", cm, None, back).generate(prompt, 12).tokens
            == build_decoder("dflash", cm, None, d).generate(prompt, 12).tokens)


@pytest.mark.parametrize("case, needle", [
    ("layers", r"the drafter was made for a target of 6 layers \(num_target_layers\); the target has 4"),
    ("hidden", r"the draft's hidden_size 32 differs from the target's hidden_size 64"),
    ("sliding", r"the drafter has sliding-window layers \(\['sliding_attention'\]\)"),
    ("missing", r"model\.safetensors does not fit a DFlash draft of 2 layers: missing layers\.1\.mlp\.up_proj\.weight"),
    ("fc", r"fc\.weight reads 192 features; 2 target layers \[1, 3\] of width 64 give 128"),
    ("vocab", rf"draft_vocab_size 4096 of {V} needs the draft's own head and id map; the weights lack lm_head\.weight, "
              r"d2t"),
    ("eagle", r"holds a speculators 'eagle3' checkpoint; only 'dflash' loads here"),
    ("nothing", r"is not a DFlash checkpoint: found notes\.txt"),
])
def test_bad_checkpoints_are_one_line(target, tmp_path, case, needle):
    w = published_weights(2)
    d = tmp_path / case
    if case == "layers":
        write_zlab(d, w, num_target_layers=6)
    elif case == "hidden":
        write_zlab(d, w, hidden_size=32)
    elif case == "sliding":
        write_zlab(d, w, layer_types=["full_attention", "sliding_attention"])
    elif case == "missing":
        del w["layers.1.mlp.up_proj.weight"]
        write_zlab(d, w)
    elif case == "fc":
        write_zlab(d, published_weights(2, n_feat=3))
    elif case == "vocab":
        write_speculators(d, w, draft_vocab_size=4096)
    elif case == "eagle":
        write_speculators(d, w, speculators_model_type="eagle3")
    else:
        d.mkdir()
        (d / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match=needle):
        load_dflash(str(d), target.model.config)


def test_export_refuses_what_does_not_fit(target, tmp_path, capsys):
    cfg = target.model.config
    src = save_drafter(new_drafter("dflash", cfg, dflash={"num_layers": 1, "block_size": BLOCK}), tmp_path / "p", cfg,
                       "tiny_random")
    for argv, needle in ((["--format", "eagle3"], "--format='eagle3' is not a layout of dflash drafters; they export "
                                                  "to: dflash, speculators"),
                         (["--format", "dflash", "--speculative-tokens", "4"],
                          "--speculative-tokens=4 is out of range: a block of 4 proposes at most 3"),
                         (["--format", "dflash", "--with-embeddings", str(tmp_path)],
                          "--with-embeddings applies to EAGLE-3 only")):
        out = tmp_path / "o"
        with pytest.raises(SystemExit) as e:
            export_main([str(src), *argv, "--out", str(out)])
        assert e.value.code == 2 and needle in capsys.readouterr().err and not out.exists()


def test_a_reduced_draft_vocabulary_exports_to_speculators_and_loads_back(target, tmp_path, capsys):
    cfg = target.model.config
    torch.manual_seed(3)
    whole = new_drafter("dflash", cfg, embed=target.model.model.embed_tokens,
                        dflash={"num_layers": 2, "block_size": BLOCK, "mask_token_id": MASK_ID})
    ids = sorted(set(range(0, V, 5)) | set(range(40)))
    d = restrict_vocab(whole, DraftVocab(ids, V), target.model.lm_head)
    assert d.config.reduced and d.lm_head.weight.shape == (len(ids), H) and not whole.config.reduced
    src = save_drafter(d, tmp_path / "pardec", cfg, "tiny_random")
    mine, _ = load_dflash(str(src), cfg)
    assert mine.vocab.ids.tolist() == ids
    out = tmp_path / "out"
    assert export_main([str(src), "--format", "speculators", "--out", str(out)]) == 0
    c = json.loads((out / "config.json").read_text())
    assert c["draft_vocab_size"] == len(ids)
    state = load_file(str(out / "model.safetensors"))
    assert {"lm_head.weight", "d2t", "t2d"} <= set(state) and state["d2t"].dtype == torch.long
    back, meta = load_dflash(str(out), cfg)
    assert meta["source_format"] == "speculators" and back.config.draft_vocab_size == len(ids)
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k].to(v.dtype), v), k
    cm = CachedModel(target.model, forward_impl="lean")
    prompt = [5, 6, 7, 8]
    ref = build_decoder("ar", cm).generate(prompt, 12).tokens
    res = build_decoder("dflash", cm, None, back).generate(prompt, 12)
    assert res.tokens == ref and res.extras["draft_vocab_size"] == len(ids)
    assert res.tokens == build_decoder("dflash", cm, None, d).generate(prompt, 12).tokens
    bad = tmp_path / "bad"
    with pytest.raises(SystemExit) as e:
        export_main([str(src), "--format", "dflash", "--out", str(bad)])
    assert e.value.code == 2 and "the z-lab layout has none; export --format speculators" in capsys.readouterr().err
    assert not bad.exists()
    state["d2t"] = state["d2t"][:-1].contiguous()
    del state["t2d"]  # (t2d is optional: without it, d2t alone says the ids)
    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"d2t maps \d+ ids; config.json says draft_vocab_size"):
        load_dflash(str(out), cfg)
