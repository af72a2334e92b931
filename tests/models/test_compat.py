"""The KV cache is passed under the name each transformers class declares (``cache`` on 5.24+, where
``past_key_values`` is deprecated and goes in 5.40; ``past_key_values`` before): pardec's verbs and its draft model
never lean on the deprecated alias, and still work with a class that only knows the old name."""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

from pardec.models.cached import CachedModel
from pardec.models.compat import NEW, OLD, cache_kwarg, output_cache
from pardec.models.draft import build_draft
from pardec.models.drafters import new_drafter
from pardec.models.pseudo import forward_pseudo, run_upper
from tests.conftest import tiny


def _declared(module: torch.nn.Module) -> str:
    return NEW if NEW in inspect.signature(type(module).forward).parameters else OLD


def _record_cache_names(model: torch.nn.Module):
    """Forward pre-hooks on the model, its inner model and every decoder layer: (class, name the cache came as)."""
    seen, handles = [], []
    mods = [model, model.model, *model.model.layers]

    def hook(mod, args, kwargs):
        seen.extend((type(mod).__name__, k, _declared(mod)) for k in (NEW, OLD) if kwargs.get(k) is not None)

    for m in mods:
        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return seen, handles


def test_every_verb_passes_the_cache_under_the_declared_name():
    lm = tiny(1)
    torch.manual_seed(0)
    drafter = new_drafter("firp", lm.model.config, layers=[0, 1])
    seen, handles = _record_cache_names(lm.model)
    try:
        for kind in ("preallocated", "dynamic"):
            cm = CachedModel(lm.model, cache=kind)
            cm.prefill(torch.tensor([list(range(100, 120))]))
            f = cm.forward(torch.tensor([[5, 6, 7]]), hidden_layer=1)
            run_upper(cm, f.hidden[:, :2], 1, positions=torch.tensor([cm.length, cm.length + 1]))
            with torch.no_grad():
                forward_pseudo(cm, torch.tensor([[12, 13]]), drafter, drafter.layers, anchors=[0, 1])
                forward_pseudo(cm, torch.tensor([[14, 15]]), drafter, drafter.layers, anchors=[0, 1], split=True)
            assert cm.length == 27
    finally:
        for h in handles:
            h.remove()
    layers_seen = {c for c, _, _ in seen}
    assert {"LlamaForCausalLM", "LlamaDecoderLayer"} <= layers_seen  # the top call and the direct layer calls
    wrong = [(c, k, d) for c, k, d in seen if k != d]
    assert not wrong, f"cache passed under a name the class does not declare: {wrong}"


def test_the_draft_model_takes_either_name_and_returns_the_cache():
    t = tiny().model
    d = build_draft(t, [0], list(range(t.config.vocab_size)))
    ids = torch.tensor([[5, 17, 923, 44, 8]])
    outs = []
    for name in (NEW, OLD):
        cache = DynamicCache(config=d.config)
        d(ids[:, :3], use_cache=True, **{name: cache})
        out = d(ids[:, 3:], use_cache=True, **{name: cache})
        assert output_cache(out) is cache and cache.get_seq_length() == 5
        outs.append(out.logits)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    torch.testing.assert_close(outs[0], d(ids).logits[:, 3:], rtol=1e-4, atol=1e-5)
    cache = DynamicCache(config=d.config)
    try:
        d(ids, cache=cache, past_key_values=cache)
    except ValueError as e:
        assert "not both" in str(e)
    else:
        raise AssertionError("both names at once must raise")


def test_a_class_that_declares_only_the_old_name_gets_it():
    class Old(torch.nn.Module):
        def forward(self, x, past_key_values=None, use_cache=False):
            return x

    class New(torch.nn.Module):
        def forward(self, x, cache=None, use_cache=False):
            return x

    assert cache_kwarg(Old()) == OLD and cache_kwarg(New()) == NEW
