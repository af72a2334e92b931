"""forward_impl=compiled: the one-token step compiled as one graph over the preallocated buffers computes what the
lean forward computes, through every forward argument (the script of test_lean), in fp32 and with int8 linears;
one compile serves prompts of other lengths and a grown cache; lossless methods keep `ar`'s tokens; clear refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pardec.config import ModelConfig
from pardec.models.cached import CachedModel
from pardec.models.forward import compiled
from tests.conftest import tiny
from tests.models.forward.test_lean import _close, _script, assert_lossless_under

#: the marks of a test that compiles with TorchInductor: it generates C++ on the CPU (without a compiler the feature
#: refuses, tested below, and these cannot run), and compiling takes tens of seconds a test (the heavy tier)
COMPILES = (pytest.mark.heavy,
            pytest.mark.skipif(not any(compiled.shutil.which(c) for c in ("c++", "g++", "clang++")),
                               reason="no C++ compiler on PATH: forward_impl=compiled refuses to run here"))


def needs_compiler(test):
    for mark in COMPILES:
        test = mark(test)
    return test


@needs_compiler
def test_compiled_gives_the_logits_of_the_lean_forward():
    m = tiny(1).model
    for a, b in zip(_script(CachedModel(m, forward_impl="lean")), _script(CachedModel(m, forward_impl="compiled"))):
        _close(a, b)


@needs_compiler
@pytest.mark.parametrize("scheme", ["per_channel", "per_token"])
def test_compiled_runs_int8_linears_as_an_opaque_op(scheme):
    """fbgemm's dynamic linears run whole as an opaque op; a per-token linear's GEMM alone (its scaling traced)."""
    from pardec.models.forward.compiled import _OPAQUE_LINEARS, _Gemm
    from pardec.models.loading import load_model

    m = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu", dtype="int8",
                               int8_weights=scheme, int8_smooth=None, int8_skip=[])).model
    for a, b in zip(_script(CachedModel(m, forward_impl="lean")), _script(CachedModel(m, forward_impl="compiled"))):
        _close(a, b)
    opaque = _OPAQUE_LINEARS[m.lm_head._opaque[0]]
    assert isinstance(opaque, _Gemm) == (scheme == "per_token")


@needs_compiler
def test_one_compile_serves_other_prompt_lengths_a_grown_cache_and_its_steps_write_in_place():
    from torch._dynamo.utils import counters

    m = tiny(2).model
    lean, comp = CachedModel(m, forward_impl="lean"), CachedModel(m, forward_impl="compiled")
    comp.prefill(torch.tensor([[3, 4, 5]]))
    comp.forward(torch.tensor([[6]]))  # compiles (or reuses an earlier test's graph)
    before = counters["stats"]["unique_graphs"]
    for prompt_len in (7, 70, 300):  # capacities 320, 384, 576: another buffer shape each time
        prompt = torch.tensor([[(7 * i) % 90 + 1 for i in range(prompt_len)]])
        want, got = lean.prefill(prompt), comp.prefill(prompt)
        buffer = comp.cache.layers[0].store.keys
        for _ in range(300 if prompt_len == 300 else 3):  # the last prompt grows past its capacity
            _close(got, want)
            token = torch.tensor([[int(want.argmax()) % 90 + 1]])
            want, got = lean.forward(token).logits[:, -1], comp.forward(token).logits[:, -1]
        assert comp.length == lean.length == prompt_len + (300 if prompt_len == 300 else 3)
        for a, b in zip(lean.cache.layers, comp.cache.layers):
            _close(a.keys, b.keys)
        if prompt_len < 300:
            assert comp.cache.layers[0].store.keys is buffer  # written in place
    assert comp.cache.layers[0].store.capacity > 576  # it grew
    assert counters["stats"]["unique_graphs"] - before <= 1  # at most the one dynamic-capacity recompile


@needs_compiler
def test_models_of_the_same_shape_never_share_a_graph():
    # the guards on a model's modules are skipped (compiled._step_fn): each model must run its own graph, even where
    # its shapes are another's but its modules differ (int8 linears in place of nn.Linear)
    from pardec.models.loading import load_model

    a = tiny(3).model
    b = load_model(ModelConfig(name="tiny_random", source="tiny_random", seed=3, device="cpu", dtype="int8")).model
    prompt, token = torch.tensor([list(range(20, 40))]), torch.tensor([[7]])
    got = {}
    for name, m in (("a", a), ("b", b), ("a again", a)):
        comp, lean = CachedModel(m, forward_impl="compiled"), CachedModel(m, forward_impl="lean")
        comp.prefill(prompt)
        lean.prefill(prompt)
        got[name] = comp.forward(token).logits
        _close(got[name], lean.forward(token).logits)
    assert not torch.allclose(got["a"], got["b"])
    assert compiled._step_fn(a) is compiled._step_fn(a) and compiled._step_fn(a) is not compiled._step_fn(b)


@needs_compiler
def test_every_lossless_method_on_the_compiled_step_reproduces_ar():
    """(their multi-row forwards run the compiled rows function, hidden-state captures included: Medusa, FIRP,
    SDSAT)"""
    from tests.decoding.test_lossless import LOSSLESS

    assert_lossless_under("compiled", LOSSLESS, ("noisy",))


def test_refusals_name_the_value_and_the_choices(monkeypatch):
    m = tiny(0).model
    with pytest.raises(ValueError, match="forward_impl=compiled needs cache='preallocated'.*cache='dynamic'"):
        CachedModel(m, cache="dynamic", forward_impl="compiled")
    with pytest.raises(ValueError, match="choose one of: auto, hf, lean, compiled"):
        CachedModel(m, forward_impl="fast")
    monkeypatch.setattr(compiled.shutil, "which", lambda _name: None)
    with pytest.raises(ValueError, match="forward_impl=compiled cannot run model .*C\\+\\+ compiler.*forward_impl=hf"):
        CachedModel(m, forward_impl="compiled")


def test_cudagraph_refuses_a_model_off_cuda_and_names_compiled():
    """``forward_impl=cudagraph`` replays CUDA graphs: on the CPU it says so and points at ``compiled`` (the graph
    capture itself runs only on a GPU: ``python -m pardec.bench gpu-smoke`` and ``python -m pardec.bench gpu-speed`` check it there)."""
    m = tiny(0).model
    with pytest.raises(ValueError, match="forward_impl=cudagraph .*needs a model on a CUDA device.*is on cpu.*"
                                         "forward_impl=compiled"):
        CachedModel(m, forward_impl="cudagraph")
    with pytest.raises(ValueError, match="choose one of: auto, hf, lean, compiled, cudagraph"):
        CachedModel(m, forward_impl="graphs")



def test_an_opaque_linear_carries_its_width_in_the_graph_and_later_registrations_do_not_recompile():
    """Inductor caches compiled graphs on disk by their text, and another process may have registered another
    linear at the same index: the op's output width is an argument in the graph (so in the cache key), not read
    from the registry while tracing (a DFlash round with a 8,192-row head once loaded a graph compiled for the
    49,152-row head at that index). Nor does a graph read the registry's size: linears registered after it was
    compiled (another role's drafter) do not compile it again. A copy of a registered linear gets its own index."""
    import copy

    from torch._dynamo.utils import counters
    from torch.fx.experimental.proxy_tensor import make_fx

    from pardec.models.forward.compiled import _OPAQUE_LINEARS, graph_linear, register_opaque
    from pardec.models.quant.int8 import PerTokenLinear

    lin = PerTokenLinear.of(nn.Linear(8, 24))
    register_opaque(lin)
    gm = make_fx(lambda x: graph_linear(lin, x))(torch.randn(3, 8))
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.pardec.opaque_linear.default]
    assert len(calls) == 1 and calls[0].args[2] == 24

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda x: graph_linear(lin, x * 2.0), fullgraph=True)
    x = torch.randn(3, 8)
    torch.testing.assert_close(f(x), lin(x * 2.0))
    twin = copy.deepcopy(lin)
    register_opaque(twin)
    register_opaque(PerTokenLinear.of(nn.Linear(8, 16)))
    assert twin._opaque[0] != lin._opaque[0] and _OPAQUE_LINEARS[twin._opaque[0]].gemm.__self__ is twin
    torch.testing.assert_close(f(x), lin(x * 2.0))
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()
