"""forward_impl=lean against transformers' forward: the same logits and cache through every argument of
CachedModel.forward, both KV caches, the draft model's full-vocabulary logits, int8 linears, and clear refusals."""

from __future__ import annotations

import pytest
import torch

from pardec.config import KV_CACHES, ConfigError, ModelConfig, RunConfig
from pardec.models.cached import CachedModel
from pardec.models.draft import build_draft
from pardec.models.forward.lean import unsupported
from tests.conftest import tiny


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _script(cm: CachedModel) -> list[torch.Tensor]:
    """Every forward argument: prefill, one token, several (causal after a prefix), a tree (attend), logits_at,
    keep + truncate, a padded 2-row batch (key_valid)."""
    out = [cm.prefill(torch.tensor([list(range(100, 130))]))]
    out.append(cm.forward(torch.tensor([[5]])).logits)
    out.append(cm.forward(torch.tensor([[6, 7, 8]])).logits)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    f = cm.forward(torch.tensor([[9, 10, 11, 12]]), positions=torch.tensor([34, 35, 35, 36]), attend=tree)
    out.append(f.logits)
    cm.keep([0, 2, 3])
    out.append(cm.forward(torch.tensor([[13, 14, 15]]), logits_at=[0, 2]).logits)
    out.append(cm.forward(torch.tensor([[16, 17]]), last_only=True).logits)
    cm.truncate(cm.length - 3)
    out.append(cm.forward(torch.tensor([[18]])).logits)
    out.append(torch.tensor(cm.tokens + [cm.length]))
    cm.reset()
    ids = torch.tensor([[0, 0, 40, 41, 42], [50, 51, 52, 53, 54]])
    valid = ids != 0
    out.append(cm.forward(ids, positions=(valid.cumsum(-1) - 1).clamp(min=0), key_valid=valid).logits[valid])
    out.append(cm.forward(torch.tensor([[43], [55]]), positions=torch.tensor([[3], [5]]),
                          key_valid=torch.cat([valid, torch.ones(2, 1, dtype=torch.bool)], -1)).logits)
    return out


@pytest.mark.parametrize("kind", KV_CACHES)
def test_lean_gives_the_logits_of_the_hf_forward(kind):
    m = tiny(1).model
    for a, b in zip(_script(CachedModel(m, cache=kind)), _script(CachedModel(m, cache=kind, forward_impl="lean"))):
        _close(a, b)


def test_lean_runs_the_draft_model_and_a_hidden_capture_falls_back():
    t = tiny().model
    d = build_draft(t, [1], list(range(0, t.config.vocab_size, 2)))
    for a, b in zip(_script(CachedModel(d)), _script(CachedModel(d, forward_impl="lean"))):
        _close(a, b)
    ref, lean = CachedModel(t), CachedModel(t, forward_impl="lean")
    for cm in (ref, lean):
        cm.prefill(torch.tensor([[1, 2, 3, 4]]))
    a, b = ref.forward(torch.tensor([[5, 6]]), hidden_layer=1), lean.forward(torch.tensor([[5, 6]]), hidden_layer=1)
    _close(a.logits, b.logits)
    _close(a.hidden, b.hidden)


def test_lean_runs_int8_linears():
    from pardec.models.loading import load_model

    m = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu", dtype="int8")).model
    for a, b in zip(_script(CachedModel(m)), _script(CachedModel(m, forward_impl="lean"))):
        _close(a, b)


def test_unsupported_models_and_bad_values_are_refused_in_one_line():
    m = tiny(0).model
    assert unsupported(m) is None
    cfg = m.config
    saved = cfg.hidden_act
    cfg.hidden_act = "gelu"
    try:
        with pytest.raises(ValueError, match="forward_impl=lean cannot run model .*hidden_act='gelu'.*forward_impl=hf"):
            CachedModel(m, forward_impl="lean")
    finally:
        cfg.hidden_act = saved
    with pytest.raises(ValueError, match="forward_impl='fast' is not valid; choose one of: auto, hf, lean"):
        CachedModel(m, forward_impl="fast")
    with pytest.raises(ConfigError, match="forward_impl"):
        RunConfig(forward_impl="fast")


def assert_lossless_under(impl, methods, drafts) -> None:
    """Each of ``methods`` (with each kind of draft in ``drafts``) on forward ``impl`` (the target and the drafts the
    helpers build) produces the tokens of `ar` on transformers' forward, on the tiny model."""
    from pardec.decoding import Stopper, build_decoder
    from tests.decoding.test_lossless import _build

    lm = tiny(0)
    tok = lm.tokenizer
    ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    stop = Stopper(tok, eos_ids=[])
    want = build_decoder("ar", CachedModel(lm.model), tok).generate(ids, 24, stop).tokens
    saved = CachedModel.default_forward_impl
    CachedModel.default_forward_impl = impl  # the drafts built by the helpers too
    try:
        for method in methods:
            for draft in drafts:
                dec = _build(method, CachedModel(lm.model), tok, draft=draft)
                if method != "hf_generate":
                    assert dec.target.forward_impl == getattr(impl, "name", impl)
                assert dec.generate(ids, 24, stop).tokens == want, (method, draft)
    finally:
        CachedModel.default_forward_impl = saved


@pytest.mark.slow
def test_every_lossless_method_under_lean_reproduces_ar_and_hf_generate():
    """The decoders on the lean forward (target and draft): every lossless method's tokens equal lean `ar`'s,
    which equal transformers' own generate() and `ar` on the HF forward."""
    from tests.decoding.test_lossless import LOSSLESS

    assert_lossless_under("lean", LOSSLESS, ("self", "noisy"))


def test_auto_picks_the_fastest_exact_forward_where_the_model_runs():
    """``forward_impl=auto`` (evaluate's default): lean on the CPU, the graphed step on CUDA, hf where the others
    cannot run the model (split over devices, another MLP) or on transformers' DynamicCache."""
    from pardec.testing import VirtualCUDA

    m = tiny(0).model
    assert CachedModel(m, forward_impl="auto").forward_impl == "lean"
    assert CachedModel(m, cache="dynamic", forward_impl="auto").forward_impl == "hf"
    m.hf_device_map = {"model.layers.0": 0, "model.layers.1": 1}  # what accelerate sets on a split model
    assert CachedModel(m, forward_impl="auto").forward_impl == "hf"
    del m.hf_device_map
    m.config.hidden_act = "gelu"
    assert CachedModel(m, forward_impl="auto").forward_impl == "hf"
    m.config.hidden_act = "silu"
    with VirtualCUDA() as vc:
        assert CachedModel(vc.place(tiny(0).model), forward_impl="auto").forward_impl == "cudagraph"
