"""EAGLE-3 checkpoints in the published layouts (:mod:`pardec.models.eagle_formats`) and the export CLI
(:mod:`pardec.export`), on a tiny 4-layer target.

* checkpoints written here by hand, key by key, in each external layout (the original release: ``midlayer.*`` in a
  ``torch.save``'d ``pytorch_model.bin``, a LlamaConfig ``config.json``; ``speculators``: ``layers.0.*`` in
  ``model.safetensors``, a ``speculators_model_type`` config) load into a draft whose logits equal an independent
  reference forward of EAGLE-3's layer (written below from the release's ``cnets.py`` description) on the same
  weights;
* a pardec drafter exported to each layout loads back with the identical state dict and identical logits;
* the speculators config the export writes validates with ``speculators``' own config class (skipped unless that
  package imports);
* bad checkpoints and bad export command lines: one line naming the bad value, nothing written.
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from pardec.config import ConfigError
from pardec.export import main as export_main
from pardec.models.drafters import save_drafter
from pardec.models.eagle import Eagle3Draft, default_layers, new_eagle3
from pardec.models.eagle_formats import detect, load_eagle3
from pardec.models.vocab import DraftVocab
from tests.conftest import VOCAB, tiny

H, INTER, HEADS, KV, HD = 64, 128, 4, 2, 16  # the draft layer: tiny(layers=4)'s shape
V = VOCAB
KEPT = sorted({0, 1, 2, *range(5, V, 173)})  # a reduced draft vocabulary (EOS / specials first)
K = len(KEPT)


@pytest.fixture(scope="module")
def target():
    return tiny(0, layers=4)


def published_weights(seed: int, n_layers: int = 3, layer_prefix: str = "layers.0.") -> dict[str, torch.Tensor]:
    """Random weights under the published names (both layouts share all but the layer prefix), with d2t / t2d for
    :data:`KEPT`; norms random too, so a swapped norm shows."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale if scale is not None else 1 / math.sqrt(shape[-1]))

    w = {"fc.weight": r(H, n_layers * H), "norm.weight": 1 + 0.1 * r(H, scale=1), "lm_head.weight": r(K, H)}
    layer = {"input_layernorm.weight": 1 + 0.1 * r(H, scale=1), "hidden_norm.weight": 1 + 0.1 * r(H, scale=1),
             "post_attention_layernorm.weight": 1 + 0.1 * r(H, scale=1),
             "self_attn.q_proj.weight": r(HEADS * HD, 2 * H), "self_attn.k_proj.weight": r(KV * HD, 2 * H),
             "self_attn.v_proj.weight": r(KV * HD, 2 * H), "self_attn.o_proj.weight": r(H, HEADS * HD),
             "mlp.gate_proj.weight": r(INTER, H), "mlp.up_proj.weight": r(INTER, H), "mlp.down_proj.weight": r(H, INTER)}
    w.update({layer_prefix + k: v for k, v in layer.items()})
    ids = torch.tensor(KEPT)
    w["d2t"] = ids - torch.arange(K)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    w["t2d"] = t2d
    return w


def llama_fields(**over) -> dict:
    """The draft layer's LlamaConfig fields as the releases write them (transformers 4.x names)."""
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": 1,
            "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "hidden_act": "silu",
            "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "rope_theta": 10000.0, "rope_scaling": None,
            "vocab_size": V, "tie_word_embeddings": False, "torch_dtype": "float32", **over}


def write_eagle3(d, w: dict, **cfg_over):
    """The original release's layout: config.json a LlamaConfig + draft_vocab_size, pytorch_model.bin with
    ``midlayer.*`` (and, as its training saves, the draft's copy of the target embedding)."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(), "draft_vocab_size": K, **cfg_over}
    (d / "config.json").write_text(json.dumps(cfg))
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in w.items()}
    torch.save(state, d / "pytorch_model.bin")
    return d


def write_speculators(d, w: dict, layer_ids=None, **cfg_over):
    """speculators 0.9's saved layout: config.json (Eagle3SpeculatorConfig fields), model.safetensors."""
    d.mkdir(parents=True, exist_ok=True)
    cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
           "transformer_layer_config": llama_fields(), "draft_vocab_size": K, "norm_before_residual": False,
           "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": layer_ids,
           "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 5,
                                                        "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                                  "verifier": {"name_or_path": "tiny/target", "architectures": ["LlamaForCausalLM"]}},
           **cfg_over}
    (d / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in w.items()}, str(d / "model.safetensors"))
    return d


# ---------------------------------------------------------------------------------------------- reference forward
def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_logits(w: dict, features, emb, norm_before_residual=False, theta=10000.0) -> torch.Tensor:
    """EAGLE-3's draft step over T positions, written from the release's description (``cnets.py``: fc on the
    concatenated features; residual = hidden; cat(input_layernorm(emb), hidden_norm(hidden)) -> causal attention
    with rotary at positions 0..T-1 -> + mlp(post_attention_layernorm(.)); lm_head(norm(.))): [1, T, K]."""
    p = "layers.0."
    hidden = features @ w["fc.weight"].T
    normed = rms(hidden, w[p + "hidden_norm.weight"])
    residual = normed if norm_before_residual else hidden
    x = torch.cat([rms(emb, w[p + "input_layernorm.weight"]), normed], -1)
    t = x.shape[1]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(1, t, HEADS, HD).transpose(1, 2)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(1, t, KV, HD).transpose(1, 2)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(1, t, KV, HD).transpose(1, 2)
    rope = LlamaRotaryEmbedding(config=LlamaConfig(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=KV,
                                                   head_dim=HD, rope_theta=theta, max_position_embeddings=2048))
    cos, sin = rope(x, torch.arange(t)[None])
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = k.repeat_interleave(HEADS // KV, 1), v.repeat_interleave(HEADS // KV, 1)
    att = (q @ k.transpose(-1, -2)) / math.sqrt(HD)
    att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    o = (att @ v).transpose(1, 2).reshape(1, t, HEADS * HD) @ w[p + "self_attn.o_proj.weight"].T
    h = residual + o
    m = rms(h, w[p + "post_attention_layernorm.weight"])
    h = h + (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[
        p + "mlp.down_proj.weight"].T
    return rms(h, w["norm.weight"]) @ w["lm_head.weight"].T


def draft_logits(draft: Eagle3Draft, features, emb) -> torch.Tensor:
    with torch.no_grad():
        out, _ = draft(emb, draft.fuse(features), torch.arange(features.shape[1]))
        return draft.logits(out)


def inputs(seed: int = 1, t: int = 7, n_layers: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, t, n_layers * H, generator=g), torch.randn(1, t, H, generator=g)


# ---------------------------------------------------------------------------------------------- external layouts load
def test_original_release_layout_loads_and_matches_the_reference(target, tmp_path, caplog):
    w = published_weights(3)
    w_file = {**w, "embed_tokens.weight": torch.randn(V, H)}  # the release's training saves the target's copy
    d = write_eagle3(tmp_path / "ea3", w_file)
    assert detect(d) == "eagle3"
    with caplog.at_level(logging.INFO, logger="pardec.models.eagle_formats"):
        draft, meta = load_eagle3(str(d), target.model.config)
    assert any("ignoring embed_tokens.weight" in r.getMessage() for r in caplog.records)
    assert meta["source_format"] == "eagle3" and meta["ignored_keys"] == ["embed_tokens.weight"]
    assert meta["layer_ids"] == list(default_layers(4))  # not stored: the reference's choice for the target
    assert draft.config.draft_vocab_size == K and draft.vocab.ids.tolist() == KEPT
    assert draft.to_target(torch.arange(K)).tolist() == KEPT
    features, emb = inputs()
    torch.testing.assert_close(draft_logits(draft, features, emb), reference_logits(w, features, emb),
                               rtol=1e-5, atol=1e-5)


def test_speculators_layout_loads_and_matches_the_reference(target, tmp_path):
    w = published_weights(4)
    d = write_speculators(tmp_path / "spec", w, layer_ids=[1, 2, 3], norm_before_residual=True)
    assert detect(d) == "speculators"
    draft, meta = load_eagle3(d, target.model.config)
    assert meta["layer_ids"] == [1, 2, 3] and draft.config.layer_ids == [1, 2, 3]
    assert meta["speculative_tokens"] == 5 and meta["verifier"]["name_or_path"] == "tiny/target"
    assert draft.config.norm_before_residual
    features, emb = inputs(2)
    torch.testing.assert_close(draft_logits(draft, features, emb),
                               reference_logits(w, features, emb, norm_before_residual=True), rtol=1e-5, atol=1e-5)


def test_full_vocabulary_checkpoints_may_omit_the_maps(target, tmp_path):
    """The release deletes d2t / t2d when draft_vocab_size == vocab_size; speculators never registers them."""
    g = torch.Generator().manual_seed(5)
    w = {k: v for k, v in published_weights(5).items() if k not in ("d2t", "t2d")}
    w["lm_head.weight"] = torch.randn(V, H, generator=g) / 8
    d = write_eagle3(tmp_path / "full", w, draft_vocab_size=V, rope_theta=5e5)
    draft, _ = load_eagle3(d, target.model.config)
    assert not draft.vocab.reduced and draft.config.rope_theta == 5e5
    features, emb = inputs(3)
    torch.testing.assert_close(draft_logits(draft, features, emb), reference_logits(w, features, emb, theta=5e5),
                               rtol=1e-5, atol=1e-5)


def test_safetensors_variant_of_the_original_layout(target, tmp_path):
    w = published_weights(6)
    d = tmp_path / "ea3st"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **llama_fields(),
                                               "draft_vocab_size": K}))
    save_file({("midlayer." + k[9:] if k.startswith("layers.0.") else k): v for k, v in w.items()},
              str(d / "model.safetensors"))
    draft, _ = load_eagle3(d, target.model.config)
    features, emb = inputs(4)
    torch.testing.assert_close(draft_logits(draft, features, emb), reference_logits(w, features, emb),
                               rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------- bad checkpoints
@pytest.mark.parametrize("case, needle", [
    ("vocab", rf"made for a vocabulary of 1000 ids; the target has vocab_size {V}"),
    ("hidden", r"hidden_size 32 differs from the target's hidden_size 64"),
    ("layers", r"feature layers \[1, 2, 9\] are out of range: the target has layers 0..3"),
    ("maps", r"d2t and t2d disagree"),
    ("keys", r"missing layers\.0\.mlp\.up_proj\.weight; unexpected layers\.0\.self_attn\.q_norm\.weight"),
    ("shape", r"misshapen weights: fc\.weight \(64, 128\) \(expected \(64, 192\)\)"),
    ("flag", r"norm_before_fc=True, which pardec's EAGLE-3 draft does not implement"),
])
def test_bad_checkpoints_are_one_line(target, tmp_path, case, needle):
    w = published_weights(7)
    over, layer_ids = {}, [1, 2, 3]
    if case == "vocab":
        over = {"transformer_layer_config": llama_fields(vocab_size=1000)}
        w["t2d"] = w["t2d"][:1000]
    elif case == "hidden":
        over = {"transformer_layer_config": llama_fields(hidden_size=32)}
    elif case == "layers":
        layer_ids = [1, 2, 9]
    elif case == "maps":
        w["t2d"] = w["t2d"].clone()
        w["t2d"][3] = True
    elif case == "keys":
        w["layers.0.self_attn.q_norm.weight"] = torch.ones(HD)
        del w["layers.0.mlp.up_proj.weight"]
    elif case == "shape":
        w["fc.weight"] = w["fc.weight"][:, :128].contiguous()
    elif case == "flag":
        over = {"norm_before_fc": True}
    d = write_speculators(tmp_path / case, w, layer_ids=layer_ids, **over)
    with pytest.raises(ConfigError, match=needle) as e:
        load_eagle3(d, target.model.config, key="draft.path")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"draft.path={str(d)!r}")


def test_detect_names_the_directory_and_what_it_holds(tmp_path):
    (tmp_path / "README.md").write_text("x")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"is not an EAGLE-3 checkpoint: found README\.md, config\.json, "
                                          r"model\.safetensors \(config\.json has no draft_vocab_size.*expected "
                                          r"drafter\.json \(pardec\)") as e:
        detect(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(ConfigError, match="neither a local directory nor a Hub id"):
        load_eagle3(str(tmp_path / "no such dir"), None)


# ---------------------------------------------------------------------------------------------- export round trip
def trained_like(target, dtype=torch.float32) -> Eagle3Draft:
    """new_eagle3 on the target with a reduced vocabulary, its norms perturbed (a trained draft's are not ones)."""
    torch.manual_seed(11)
    d = new_eagle3(target.model.config, DraftVocab(KEPT, V), lm_head=target.model.lm_head.weight)
    with torch.no_grad():
        for name, p in d.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    return d.to(dtype)


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_export_round_trip(target, tmp_path, fmt, capsys):
    cfg = target.model.config
    draft = trained_like(target)
    src = save_drafter(draft, tmp_path / "trained", cfg, "tiny_random")
    out = tmp_path / "out"
    assert export_main([str(src), "--format", fmt, "--out", str(out), "--speculative-tokens", "4"]) == 0
    assert "vllm serve" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert detect(out) == fmt
    keys = set(load_file(str(out / "model.safetensors")))
    assert ("midlayer.self_attn.q_proj.weight" in keys) == (fmt == "eagle3") and "embed_tokens.weight" not in keys
    loaded, meta = load_eagle3(out, cfg)
    assert meta["layer_ids"] == draft.config.layer_ids
    want, got = draft.state_dict(), loaded.state_dict()
    assert set(want) == set(got) and all(torch.equal(want[k], got[k]) for k in want)
    features, emb = inputs(5)
    assert torch.equal(draft_logits(loaded, features, emb), draft_logits(draft, features, emb))
    c = json.loads((out / "config.json").read_text())
    assert c["torch_dtype"] == "float32" and c["eagle_aux_hidden_state_layer_ids"] == draft.config.layer_ids
    if fmt == "speculators":
        assert c["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
        assert c["transformer_layer_config"]["vocab_size"] == V and c["draft_vocab_size"] == K
    else:
        assert c["architectures"] == ["LlamaForCausalLMEagle3"] and c["draft_vocab_size"] == K


def test_export_keeps_the_drafter_dtype_and_pardec_dirs_load_too(target, tmp_path):
    cfg = target.model.config
    draft = trained_like(target, torch.bfloat16)
    src = save_drafter(draft, tmp_path / "trained", cfg, "tiny_random")
    loaded, meta = load_eagle3(src, cfg)
    assert meta["source_format"] == "pardec" and detect(src) == "pardec"
    assert export_main([str(src), "--format", "speculators", "--out", str(tmp_path / "o")]) == 0
    state = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert state["lm_head.weight"].dtype == torch.bfloat16 and state["d2t"].dtype == torch.long
    assert json.loads((tmp_path / "o" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    back, meta = load_eagle3(tmp_path / "o", cfg)
    assert meta["dtype"] == "bfloat16"
    assert all(torch.equal(v.float(), back.state_dict()[k].float()) for k, v in draft.state_dict().items())


def test_export_with_embeddings_and_verifier(target, tmp_path, caplog):
    cfg = target.model.config
    tdir = tmp_path / "target"
    target.model.save_pretrained(tdir)
    src = save_drafter(trained_like(target), tmp_path / "trained", cfg, "tiny_random")
    out = tmp_path / "out"
    assert export_main([str(src), "--format", "speculators", "--out", str(out), "--verifier", str(tdir),
                        "--with-embeddings", str(tdir)]) == 0
    state = load_file(str(out / "model.safetensors"))
    assert torch.equal(state["embed_tokens.weight"], target.model.get_input_embeddings().weight.detach())
    verifier = json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tdir), "architectures": ["LlamaForCausalLM"]}
    with caplog.at_level(logging.INFO, logger="pardec.models.eagle_formats"):
        _, meta = load_eagle3(out, cfg)
    assert meta["ignored_keys"] == ["embed_tokens.weight"]
    assert any("ignoring embed_tokens.weight" in r.getMessage() for r in caplog.records)


def test_exported_speculators_config_loads_with_speculators(target, tmp_path):
    pytest.importorskip("speculators")
    from speculators import SpeculatorModelConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig

    src = save_drafter(trained_like(target), tmp_path / "trained", target.model.config, "tiny_random")
    assert export_main([str(src), "--format", "speculators", "--out", str(tmp_path / "o"),
                        "--speculative-tokens", "2"]) == 0
    c = SpeculatorModelConfig.from_pretrained(str(tmp_path / "o"))
    assert isinstance(c, Eagle3SpeculatorConfig)
    assert c.draft_vocab_size == K and c.target_vocab_size == V and c.norm_before_residual is False
    assert c.eagle_aux_hidden_state_layer_ids == list(default_layers(4))
    assert c.transformer_layer_config.hidden_size == H and c.transformer_layer_config.num_hidden_layers == 1
    assert c.speculators_config.proposal_methods[0].speculative_tokens == 2


# ---------------------------------------------------------------------------------------------- bad export input
@pytest.mark.parametrize("case, needle", [
    ("format", r"argument --format: invalid choice: 'hf' \(choose from '?dflash'?, '?eagle3'?, '?speculators'?\)"),
    ("missing", r"drafter='.*nowhere' is not a directory; expected a pardec EAGLE-3 or DFlash drafter directory"),
    ("empty", r"drafter='.*empty' has no drafter\.json; expected a pardec EAGLE-3 or DFlash drafter directory"),
    ("medusa", r"drafter='.*medusa' holds a 'medusa' drafter; only kinds 'dflash', 'eagle3' export"),
    ("kind", r"--format='dflash' is not a layout of eagle3 drafters; they export to: eagle3, speculators"),
    ("external", r"drafter='.*external' has no drafter\.json"),
    ("out", r"--out='.*busy' exists and is not an empty directory; choose a new or empty one"),
    ("tokens", r"--speculative-tokens=0 is out of range: it must be an integer >= 1"),
    ("embeddings", r"--with-embeddings='.*empty' holds no model\.safetensors"),
    ("verifier", r"--verifier='.*other' has hidden_size 32; the drafter was trained for 'tiny_random' with "
                 r"hidden_size 64"),
])
def test_export_bad_input_is_one_line_and_writes_nothing(target, tmp_path, capsys, case, needle):
    cfg = target.model.config
    good = save_drafter(trained_like(target), tmp_path / "trained", cfg, "tiny_random")
    (tmp_path / "empty").mkdir()
    out = tmp_path / "out"
    drafter, fmt, extra = str(good), "eagle3", []
    if case == "format":
        fmt = "hf"
    elif case == "kind":
        fmt = "dflash"
    elif case == "missing":
        drafter = str(tmp_path / "nowhere")
    elif case == "empty":
        drafter = str(tmp_path / "empty")
    elif case == "medusa":
        from pardec.models.drafters import new_drafter
        drafter = str(save_drafter(new_drafter("medusa", cfg, num_heads=1), tmp_path / "medusa", cfg, "tiny_random"))
    elif case == "external":
        drafter = str(write_speculators(tmp_path / "external", published_weights(8)))
    elif case == "out":
        out = tmp_path / "busy"
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "tokens":
        extra = ["--speculative-tokens", "0"]
    elif case == "embeddings":
        extra = ["--with-embeddings", str(tmp_path / "empty")]
    elif case == "verifier":
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / "config.json").write_text(json.dumps({"hidden_size": 32, "vocab_size": V}))
        extra = ["--verifier", str(tmp_path / "other")]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SystemExit) as e:
        export_main([drafter, "--format", fmt, "--out", str(out), *extra])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("python -m pardec.export: error: "), err
    assert __import__("re").search(needle, err), err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_export_help(capsys):
    with pytest.raises(SystemExit) as e:
        export_main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    assert "--format {dflash,eagle3,speculators}" in text and "--speculative-config" in text


def test_hub_ids_resolve_through_snapshot_download(target, tmp_path, monkeypatch):
    """Users name Hub repositories; the tests stand a local directory in for the download."""

    local = write_speculators(tmp_path / "snap", published_weights(9), layer_ids=[1, 2, 3])
    calls = []

    def fake(repo_id, **kw):
        calls.append((repo_id, kw))
        if repo_id == "someone/missing":
            raise OSError("404 Client Error: Repository Not Found\nmore detail")
        return str(local)

    monkeypatch.setattr("pardec.models.checkpoints.snapshot_download", fake)
    draft, meta = load_eagle3("someone/eagle3-draft", target.model.config)
    assert calls[0][0] == "someone/eagle3-draft" and "*.safetensors" in calls[0][1]["allow_patterns"]
    assert meta["path"] == str(local) and draft.config.layer_ids == [1, 2, 3]
    with pytest.raises(ConfigError, match=r"^draft\.path='someone/missing' is not a local directory and its Hub "
                                          r"download failed \(OSError: 404 Client Error: Repository Not Found\)$"):
        load_eagle3("someone/missing", target.model.config)
