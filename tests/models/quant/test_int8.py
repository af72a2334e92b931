"""dtype=int8: int8 linears on the CPU (pardec.models.quant.int8): loading, the weight cache, refusals, and what it does to
exactness (weight-only int8 is batch-invariant, so lossless methods keep int8 `ar`'s tokens; fbgemm's per-tensor
activation scale is not)."""

from __future__ import annotations

import copy

import pytest
import torch

import pardec.models.quant.int8 as int8
import pardec.models.quant.smooth as sq
from pardec.config import INT8_WEIGHTS, ConfigError, ModelConfig, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.models.loading import load_model


def _tiny(dtype: str, seed: int = 0) -> ModelConfig:
    return ModelConfig(name="tiny_random", source="tiny_random", seed=seed, dtype=dtype, device="cpu")


@pytest.fixture
def local_dir(tmp_path):
    """A tiny model saved as a local directory (the source a trained drafter has)."""
    lm = load_model(_tiny("fp32"))
    d = tmp_path / "model"
    lm.model.save_pretrained(d)
    lm.tokenizer.save_pretrained(d)
    return d


def test_int8_replaces_every_linear_and_stays_close_to_fp32():
    fp = load_model(_tiny("fp32")).model
    q = load_model(_tiny("int8")).model
    assert int8.is_int8(q) and not int8.is_int8(fp)
    assert not any(type(m) is torch.nn.Linear for m in q.modules())  # the default: every linear, the LM head too
    assert isinstance(q.lm_head, int8.PerTokenLinear)
    skipping = _tiny("int8")
    skipping.int8_weights, skipping.int8_skip = "per_channel", ["down_proj"]
    fp32_left = {n for n, m in load_model(skipping).model.named_modules() if type(m) is torch.nn.Linear}
    assert fp32_left == {f"model.layers.{i}.mlp.down_proj" for i in range(2)}  # skipped: left fp32
    plain = _tiny("int8")
    plain.int8_weights, plain.int8_skip, plain.int8_smooth = "per_channel", [], None
    assert not any(type(m) is torch.nn.Linear for m in load_model(plain).model.modules())
    plain.int8_weights = "weight_only"
    wo = load_model(plain).model
    assert not any(type(m) is torch.nn.Linear for m in wo.modules()) and isinstance(wo.lm_head, int8.WeightOnlyLinear)
    assert q.dtype == torch.float32  # activations, embeddings and norms stay fp32
    ids = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        a, b = fp(input_ids=ids).logits, q(input_ids=ids).logits
    rel = ((a - b).norm() / a.norm()).item()
    assert 0 < rel < 0.05, rel  # quantized (not the same weights), and close


def test_int8_weights_have_one_scale_per_output_row():
    """``quantize_dynamic``'s default is one scale per matrix: a row of small weights beside a row of large ones
    then rounds to a few levels. Per-channel scales keep every row's relative error at the int8 level."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 8, bias=False)
    with torch.no_grad():
        lin.weight.mul_(torch.logspace(0, 3, 8)[:, None])  # rows 1x .. 1000x
    x = torch.randn(5, 64)
    want = lin(x)
    errs = {}
    for scheme in INT8_WEIGHTS:
        q = int8.quantize(torch.nn.Sequential(copy.deepcopy(lin)), scheme)
        assert int8.weight_scheme(q) == scheme
        with torch.no_grad():
            errs[scheme] = ((q(x) - want).norm(dim=0) / want.norm(dim=0)).max().item()  # worst output row
    assert max(errs["per_channel"], errs["weight_only"], errs["per_token"]) < 0.03 < 0.3 < errs["per_tensor"], errs
    assert int8.weight_scheme(load_model(_tiny("int8")).model) == "per_token"  # the default
    assert int8.weight_scheme(torch.nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match=r"'per_row' is not one of weight_only, per_channel, per_tensor"):
        int8.quantize(torch.nn.Linear(2, 2), "per_row")
    assert int8.cache_key({}, []) != int8.cache_key({}, [], "per_tensor")
    # the config knob (for comparisons): validated, part of an int8 model's identity only
    old = _tiny("int8")
    old.int8_weights = "per_tensor"
    assert int8.weight_scheme(load_model(old).model) == "per_tensor"
    assert old.identity()["int8_weights"] == "per_tensor" and "int8_weights" not in _tiny("fp32").identity()
    with pytest.raises(ConfigError, match=r"int8_weights.*'per_row'.*weight_only, per_channel, per_tensor"):
        ModelConfig(int8_weights="per_row")
    with pytest.raises(ConfigError, match=r"int8_smooth=0.5 applies to .*per_channel.*per_token.*int8_smooth=null"):
        ModelConfig(int8_weights="weight_only")  # it quantizes no activation: nothing to smooth
    with pytest.raises(ValueError, match="smoothing .* not to 'weight_only'"):
        int8.prepare(torch.nn.Linear(2, 2), "weight_only", smooth_alpha=0.5, calib=[[1, 2]])


def test_smoothing_calibrates_through_sdpa_whatever_the_runs_attention(monkeypatch, tmp_path):
    """The int8 cache key leaves the attention out, so the calibration must not depend on it: under
    ``attn_implementation=invariant`` (or eager) the calibration forwards run through SDPA, and the model's own
    attention is restored afterwards; the same smoothed weights either way."""
    seen = []
    smoothed = {}
    for attn in ("sdpa", "invariant", "eager"):
        lm = load_model(ModelConfig(name="tiny_random", source="tiny_random", seed=0, dtype="fp32", device="cpu",
                                    attn_implementation=attn))
        model = lm.model
        hook = model.register_forward_pre_hook(lambda m, a, kw: seen.append(m.config._attn_implementation),
                                               with_kwargs=True)
        with torch.no_grad():
            sq.smooth(model, 0.5, sq.calibration_ids(lm.tokenizer))
        hook.remove()
        assert model.config._attn_implementation == attn
        smoothed[attn] = model.state_dict()
    assert seen and set(seen) == {"sdpa"}
    for attn in ("invariant", "eager"):
        assert all(torch.equal(v, smoothed[attn][k]) for k, v in smoothed["sdpa"].items()), attn
    f = tmp_path / "w.safetensors"
    f.write_bytes(b"x")
    before = int8.cache_key({"name": "m"}, [f])
    monkeypatch.setattr(sq, "CALIBRATION_ATTENTION", "eager")  # caches calibrated another way are not reused
    assert int8.cache_key({"name": "m"}, [f]) != before


def test_smoothing_is_exact_in_fp32_and_rescues_int8_from_outlier_channels():
    """SmoothQuant moves per-channel activation scale from the activations into the weights: the fp32 model computes
    the same logits after it, and with outlier input channels int8 with smoothing is much closer to fp32 than
    without. The outliers are made without changing the fp32 function: a few channels of each smoothed input are
    scaled up upstream (norm weights, ``up_proj`` rows) and the reading weights' columns scaled down by as much."""
    lm = load_model(_tiny("fp32"))
    model = lm.model
    with torch.no_grad():
        for layer in model.model.layers:
            att, mlp = layer.self_attn, layer.mlp
            for norm, readers in ((layer.input_layernorm, (att.q_proj, att.k_proj, att.v_proj)),
                                  (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj))):
                norm.weight[:3] *= 100.0
                for lin in readers:
                    lin.weight[:, :3] /= 100.0
            mlp.up_proj.weight[:4] *= 100.0
            mlp.down_proj.weight[:, :4] /= 100.0
    ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 7, 12, 300]])
    calib = sq.calibration_ids(lm.tokenizer)
    assert len(calib) >= 3 and all(len(c) > 10 for c in calib)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        smoothed = copy.deepcopy(model)
        assert sq.smooth(smoothed, 0.8, calib) == 3 * len(model.model.layers)  # q/k/v, gate/up, down per layer
        torch.testing.assert_close(smoothed(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        assert not torch.equal(smoothed.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
        err = {}
        for label, alpha in (("plain", None), ("smooth", 0.8)):  # (the LM head, never smoothed, stays fp32 here)
            q = int8.prepare(copy.deepcopy(model), "per_channel", alpha, ("lm_head",), calib)
            err[label] = ((q(input_ids=ids).logits - want).norm() / want.norm()).item()
    assert err["smooth"] < 0.5 * err["plain"], err
    # skip: those linears stay fp32 (and are not smoothed); the others are int8
    q = int8.prepare(copy.deepcopy(model), "per_channel", 0.8, ("down_proj",), calib)
    kinds = {n.rsplit(".", 1)[-1]: type(m) for n, m in q.named_modules() if n.endswith("_proj")}
    assert kinds["down_proj"] is torch.nn.Linear and int8.is_int8(q) and kinds["up_proj"] is not torch.nn.Linear
    assert torch.equal(q.model.layers[0].mlp.down_proj.weight, model.model.layers[0].mlp.down_proj.weight)
    with pytest.raises(ValueError, match="calibration"):
        int8.prepare(copy.deepcopy(model), "per_channel", smooth_alpha=0.5)
    assert sq.smooth(torch.nn.Sequential(torch.nn.Linear(2, 2)), 0.5, calib) == 0  # not Llama-style: no-op


def test_int8_recipe_config_and_cache(local_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(int8, "DATA_DIR", tmp_path / "data")
    default = ModelConfig(name="local_tiny", source="local", path=str(local_dir), dtype="int8", device="cpu")
    assert (default.int8_weights, default.int8_smooth, default.int8_skip) == ("per_token", 0.5, [])  # the default
    cfg = ModelConfig(name="local_tiny", source="local", path=str(local_dir), dtype="int8", device="cpu",
                      int8_weights="per_channel", int8_smooth=0.8, int8_skip=["down_proj"])  # fbgemm's recipe
    first = load_model(cfg).model
    second = load_model(cfg).model  # from the cache: the skeleton keeps down_proj fp32, the norms come smoothed
    assert type(second.model.layers[0].mlp.down_proj) is torch.nn.Linear and int8.is_int8(second)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(first(input_ids=ids).logits, second(input_ids=ids).logits)
    wo = ModelConfig(name="local_tiny", source="local", path=str(local_dir), dtype="int8", device="cpu",
                     int8_weights="weight_only", int8_smooth=None, int8_skip=[])
    plain, cached = load_model(wo).model, load_model(wo).model  # the second from the cache
    assert len(list((tmp_path / "data" / "models" / "int8").glob("*.pt"))) == 2  # another recipe, another key
    pt, pt_cached = load_model(default).model, load_model(default).model  # per-token: packed again from the cache
    assert int8.weight_scheme(pt_cached) == "per_token" and len(list((tmp_path / "data" / "models" / "int8").glob("*.pt"))) == 3
    with torch.no_grad():
        assert torch.equal(pt(input_ids=ids).logits, pt_cached(input_ids=ids).logits)
    assert int8.weight_scheme(cached) == "weight_only"
    with torch.no_grad():
        assert not torch.equal(first(input_ids=ids).logits, plain(input_ids=ids).logits)
        assert torch.equal(plain(input_ids=ids).logits, cached(input_ids=ids).logits)
    assert cfg.identity()["int8_skip"] == ["down_proj"] and "int8_smooth" not in _tiny("fp32").identity()
    for bad in (0.0, 1.0, 1.5):
        with pytest.raises(ConfigError, match=rf"int8_smooth={bad!r} is out of range.*\(0, 1\)"):
            ModelConfig(int8_smooth=bad)


def test_int8_weights_are_cached_and_a_retrained_model_gets_a_new_cache(local_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(int8, "DATA_DIR", tmp_path / "data")
    cfg = ModelConfig(name="local_tiny", source="local", path=str(local_dir), dtype="int8", device="cpu")
    calls = []
    real = int8.quantize
    monkeypatch.setattr(int8, "quantize", lambda m, *a: calls.append(1) or real(m, *a))
    first = load_model(cfg).model
    files = list((tmp_path / "data" / "models" / "int8").glob("*.pt"))
    assert len(files) == 1 and calls == [1]
    second = load_model(cfg).model  # from the cache: no quantization
    assert calls == [1] and int8.is_int8(second) and int8.weight_scheme(second) == "per_token"
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        assert torch.equal(first(input_ids=ids).logits, second(input_ids=ids).logits)
    # the drafter is trained again: new weights, new key, quantized afresh
    lm = load_model(_tiny("fp32", seed=7))
    lm.model.save_pretrained(local_dir)
    third = load_model(cfg).model
    assert calls == [1, 1] and len(list((tmp_path / "data" / "models" / "int8").glob("*.pt"))) == 2
    with torch.no_grad():
        assert not torch.equal(first(input_ids=ids).logits, third(input_ids=ids).logits)


def test_an_unreadable_cache_is_rebuilt(local_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(int8, "DATA_DIR", tmp_path / "data")
    cfg = ModelConfig(name="local_tiny", source="local", path=str(local_dir), dtype="int8", device="cpu")
    load_model(cfg)
    (f,) = (tmp_path / "data" / "models" / "int8").glob("*.pt")
    f.write_bytes(b"truncated")
    assert int8.is_int8(load_model(cfg).model)
    assert f.stat().st_size > 1000  # written again


def test_int8_is_refused_on_gpus_and_in_training():
    with pytest.raises(ConfigError, match=r"dtype=int8 is a CPU mode.*model.device=cuda.*bf16"):
        ModelConfig(dtype="int8", device="cuda")
    with pytest.raises(ConfigError, match=r"dtype=int8 .*model.device_map=auto"):
        ModelConfig(dtype="int8", device_map="auto")
    with pytest.raises(ConfigError, match=r"model.dtype='int4'.*fp32, bf16, fp16, int8"):
        ModelConfig(dtype="int4")


def test_training_refuses_int8():
    from hydra import compose, initialize_config_dir

    from pardec import CONF_DIR
    from pardec.training.draft.trainer import DraftConfig
    from pardec.training.kinds import common_fields

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("train", overrides=["+experiment=draft_tiny", "dtype=int8"])
    with pytest.raises(ConfigError, match="dtype=int8 is an inference mode"):
        common_fields(cfg, "draft_tiny", DraftConfig)


def test_int8_linears_are_not_batch_invariant():
    """fbgemm's dynamic quantization scales the whole input of a linear at once (per tensor): a row's output
    depends on the rows beside it. This is why `tokens` methods match int8 `ar` only up to near-ties (documented
    in pardec.models.quant.int8); if torch moves to per-token scales this test fails and the documentation must change."""
    torch.manual_seed(0)
    lin = int8.quantize(torch.nn.Sequential(torch.nn.Linear(64, 32)), "per_channel")
    x = torch.randn(5, 64)
    x[3] *= 20  # one row with a large range sets the shared scale
    with torch.no_grad():
        alone, together = lin(x[:1]), lin(x)[:1]
    assert not torch.equal(alone, together)
    with torch.no_grad():  # rows of equal range: equal
        assert torch.equal(lin(x[:1].repeat(4, 1))[:1], lin(x[:1]))


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["weight_only", "per_token"])
def test_weight_only_and_per_token_int8_linears_are_batch_invariant(scheme):
    """weight_only quantizes no activation, per_token quantizes each row with its own scale: either way a linear's
    row is bitwise the same alone or among others, whatever their range. On the tiny model every lossless method
    then reproduces int8 `ar` token for token. (Not guaranteed on a real model: attention's small-M GEMMs are not
    batch-invariant in fp32 either, and rounding the linears' inputs (bf16, int8) magnifies their last-bit
    differences: SmolLM2's weight-only `pld`/`sps` left int8 `ar` at near-ties in 4 of 5 GSM8K prompts, README.)"""
    from tests.decoding.test_lossless import LOSSLESS, _build

    torch.manual_seed(0)
    lin = int8.quantize(torch.nn.Sequential(torch.nn.Linear(64, 48)), scheme)
    x = torch.randn(6, 64)
    x[3] *= 50
    with torch.no_grad():
        together = lin(x)
        assert all(torch.equal(lin(x[i : i + 1]), together[i : i + 1]) for i in range(6))
        assert torch.equal(lin(x[None])[0], together)  # [B, T, in] as [B*T, in]
    cfg = _tiny("int8")
    cfg.int8_weights, cfg.int8_smooth, cfg.int8_skip = scheme, None, []
    lm = load_model(cfg)
    assert int8.weight_scheme(lm.model) == scheme
    tok = lm.tokenizer
    ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    stop = Stopper(tok, eos_ids=[])
    want = build_decoder("ar", CachedModel(lm.model), tok).generate(ids, 24, stop).tokens
    for method in LOSSLESS:
        if method != "hf_generate":
            assert _build(method, CachedModel(lm.model), tok, draft="noisy").generate(ids, 24, stop).tokens == want, method


@pytest.mark.parametrize("scheme", ["fp32", "weight_only", "per_token", "per_channel"])
def test_a_linears_rows_give_its_outputs_at_those_rows(scheme):
    """linear_rows (a head over a draft vocabulary): pardec's int8 linears keep their int8 rows and scales, so each
    kept output is bitwise the whole linear's; an nn.Linear's rows and fbgemm's dequantized rows give the same
    outputs up to rounding."""
    torch.manual_seed(1)
    lin = torch.nn.Sequential(torch.nn.Linear(64, 48, bias=True))
    if scheme != "fp32":
        lin = int8.quantize(lin, scheme)
    ids = torch.tensor([0, 3, 4, 17, 47])
    rows = int8.linear_rows(lin[0], ids)
    x = torch.randn(5, 64)
    x[2] *= 30
    with torch.no_grad():
        want, got = lin(x)[:, ids], rows(x)
        if scheme == "per_channel":  # (its activation scale is the whole input's: compare with its weights' rows)
            q = lin[0]
            want = torch.nn.functional.linear(x, q.weight().dequantize()[ids], q.bias()[ids])
    assert got.shape == (5, 5)
    if scheme in ("weight_only", "per_token"):
        assert type(rows) is type(lin[0]) and rows.weight.dtype == torch.int8
        assert torch.equal(got, want)
    else:
        assert type(rows) is torch.nn.Linear
        torch.testing.assert_close(got, want)
    with pytest.raises(TypeError, match="LayerNorm is not a linear layer"):
        int8.linear_rows(torch.nn.LayerNorm(4), ids)


@pytest.mark.parametrize("flags", [["avx2", "fma"], ["avx2", "avx512f", "avx512_vnni"]])
def test_per_token_int8_is_the_integer_product_of_per_row_scales(monkeypatch, flags):
    """A per_token linear computes, for each row, (its int8 activations) x (the int8 weights) in integers, scaled by
    the row's magnitude and the weight row's scale: checked against that product done here in int64, with inputs
    at the ends of the range (where fbgemm's AVX2 int16 pair sums would saturate with 8-bit activations: 7-bit
    without VNNI, 8-bit with it). A 1000x outlier row leaves the others' error at the int8 level (the per-tensor
    scale's failure), and the per-row scales survive the int8 cache's state-dict round trip."""
    import pardec.models.host as host

    if "avx512_vnni" in flags and not int8._vnni():
        pytest.skip("8-bit activations are what pardec runs on CPUs with VNNI/AMX only (fbgemm's AVX2 kernels "
                    "saturate their int16 pair sums); this CPU has neither")
    monkeypatch.setattr(host, "cpu_flags", lambda: flags)
    torch.manual_seed(0)
    src = torch.nn.Linear(96, 40, bias=True)
    q = int8.PerTokenLinear.of(src)
    levels = 127 if "avx512_vnni" in flags else 63
    assert q.levels == levels and q.scales.dtype == torch.float32
    x = torch.randn(7, 96)
    x[2] *= 1000
    x[5] = x[5].abs().sign() * 3.0  # every activation at the top of the range
    with torch.no_grad():
        got = q(x)
        mag = x.abs().amax(1, keepdim=True)
        xq = torch.round(x / mag * levels).clamp(-levels, levels).long()
        want = (xq @ q.weight.long().T).double() * (mag.double() / levels) * q.scales.double() + src.bias.double()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    ref = src(x).detach()
    err = ((got - ref).norm(dim=1) / ref.norm(dim=1))
    assert err.max() < 0.03, err
    back = int8.PerTokenLinear(96, 40, bias=True)
    back.load_state_dict(q.state_dict())
    with torch.no_grad():
        assert torch.equal(back(x), got)


def test_weight_only_warns_on_a_cpu_without_native_bf16(monkeypatch, caplog):
    import pardec.models.host as host

    monkeypatch.setattr(host, "cpu_flags", lambda: ["avx2", "fma"])
    with caplog.at_level("WARNING", logger="pardec.models.quant.int8"):
        int8.quantize(torch.nn.Sequential(torch.nn.Linear(8, 8)), "weight_only")
    assert "without avx512_bf16/amx_bf16" in caplog.text and "int8_weights=per_channel" in caplog.text
    caplog.clear()
    monkeypatch.setattr(host, "cpu_flags", lambda: ["avx2", "avx512f", "avx512_bf16"])
    with caplog.at_level("WARNING", logger="pardec.models.quant.int8"):
        int8.quantize(torch.nn.Sequential(torch.nn.Linear(8, 8)), "weight_only")
    assert "avx512_bf16" not in caplog.text


def test_decoding_runs_on_an_int8_target_and_draft():
    target = CachedModel(load_model(_tiny("int8")).model)
    draft = CachedModel(load_model(_tiny("int8", seed=3)).model, name="draft")
    tok = load_model(_tiny("int8")).tokenizer
    ar = build_decoder("ar", target, tok, None).generate([1, 5, 9, 13], 12, Stopper(), SamplingConfig())
    sps = build_decoder("sps", CachedModel(load_model(_tiny("int8")).model), tok, draft, gamma=3).generate(
        [1, 5, 9, 13], 12, Stopper(), SamplingConfig())
    assert len(ar.tokens) == len(sps.tokens) == 12
    assert sps.drafted > 0


def test_processes_asking_at_once_quantize_once_and_read_the_same_weights(tmp_path, monkeypatch):
    """Two callers of quantize_cached at once with one key (ranks, test workers): one quantizes and writes the cache,
    the other waits and reads it; both get the same int8 weights."""
    import threading
    import time

    from tests.conftest import tiny

    real, calls = int8.prepare, []

    def slow_prepare(*a, **kw):
        calls.append(1)
        time.sleep(0.5)  # the second caller arrives while the first one quantizes
        return real(*a, **kw)

    monkeypatch.setattr(int8, "prepare", slow_prepare)
    models = [copy.deepcopy(tiny(0).model) for _ in range(2)]
    got = []

    def ask(m):
        got.append(int8.quantize_cached(m, "k", cache_dir=tmp_path))

    threads = [threading.Thread(target=ask, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 2
    a, b = (m.state_dict() for m in got)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if isinstance(a[k], torch.Tensor))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.lock", "k.pt"]
