"""forward_impl=cudagraph's graphed forwards, run on the CPU with the graph capture replaced by an eager stand-in
that keeps the graph's contract (inputs copied into buffers fixed at capture, the captured function replayed over
them, one capture per model, kind, shapes and cache buffers). What this checks here: the multi-row (verification)
forward padded to a power of two rows, its mask over the whole buffer, its hidden-state capture and the graph
bookkeeping, against the lean and transformers' forwards, and every lossless method's tokens against `ar`'s. The
capture itself needs a GPU (``python -m pardec.bench gpu-smoke --forward-impls cudagraph``)."""

from __future__ import annotations

import pytest
import torch

from pardec.models.cached import CachedModel
from pardec.models.forward import compiled
from pardec.testing.graphs import EagerGraph
from pardec.testing.graphs import cpu_graphs as make_cpu_graphs
from tests.conftest import tiny
from tests.models.forward.test_compiled import needs_compiler
from tests.models.forward.test_lean import _close, _script, assert_lossless_under


@pytest.fixture
def cpu_graphs():  # (the fixture: captures counted from 0)
    EagerGraph.captures = 0
    return make_cpu_graphs()


def test_graph_rows_are_powers_of_two_up_to_the_limit():
    assert [compiled.graph_rows(t) for t in (2, 3, 4, 5, 8, 9, 64, 65, 128)] == [2, 4, 4, 8, 8, 16, 64, 128, 128]
    assert compiled.graph_rows(compiled.MAX_GRAPHED_ROWS + 1) == compiled.MAX_GRAPHED_ROWS + 1  # (lean, unpadded)


def test_forwards_wider_than_the_graphed_limit_run_the_lean_forward(cpu_graphs):
    m = tiny(1).model
    lean, graphed = CachedModel(m, forward_impl="lean"), CachedModel(m, forward_impl=make_cpu_graphs(max_rows=4))
    for cm in (lean, graphed):
        cm.prefill(torch.tensor([list(range(100, 130))]))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    _close(graphed.forward(ids).logits, lean.forward(ids).logits)
    assert graphed.graphed_forwards == 0 and graphed.padded_rows == 0 and EagerGraph.captures == 0


def test_graphed_forwards_give_the_logits_of_the_lean_forward(cpu_graphs):
    m = tiny(1).model
    graphed = CachedModel(m, forward_impl=cpu_graphs)
    for a, b in zip(_script(CachedModel(m, forward_impl="lean")), _script(graphed)):
        _close(a, b)
    # the script's 3-row forwards ran padded to 4 rows; its tree (4 rows) unpadded; prefill and last_only unpadded
    assert graphed.padded_rows == 2 and graphed.graphed_forwards == 3  # (3-row, tree and logits_at forwards)
    assert EagerGraph.captures >= 2  # one-token steps and 4-row forwards


def test_graphed_rows_capture_once_per_row_count_and_write_the_cache_in_place(cpu_graphs):
    m = tiny(2).model
    lean, graphed = CachedModel(m, forward_impl="lean"), CachedModel(m, forward_impl=cpu_graphs)
    prompt = torch.tensor([list(range(10, 50))])
    lean.prefill(prompt)
    graphed.prefill(prompt)
    buffer = graphed.cache.layers[0].store.keys
    captures = None
    for step, block in enumerate(([1, 2, 3], [4, 5], [6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17, 18, 19])):
        ids = torch.tensor([block])
        _close(graphed.forward(ids).logits, lean.forward(ids).logits)
        graphed.truncate(graphed.length - 1)  # a rejected tail, as after a verification
        lean.truncate(lean.length - 1)
        if step == 2:
            captures = EagerGraph.captures  # row counts 4, 2 and 8 captured
    assert EagerGraph.captures == captures  # 3 rows -> 4 and 6 rows -> 8 replayed the graphs already captured
    assert graphed.length == lean.length and graphed.tokens == lean.tokens
    for a, b in zip(lean.cache.layers, graphed.cache.layers):
        _close(a.keys, b.keys)
        _close(a.values, b.values)
    assert graphed.cache.layers[0].store.keys is buffer  # written in place


def test_a_cache_that_grows_gets_new_graphs_and_drops_the_old_buffers_ones(cpu_graphs):
    m = tiny(2).model
    lean, graphed = CachedModel(m, forward_impl="lean"), CachedModel(m, forward_impl=cpu_graphs)
    prompt = torch.tensor([[(7 * i) % 90 + 1 for i in range(300)]])
    lean.prefill(prompt)
    graphed.prefill(prompt)
    first = graphed.cache.layers[0].store
    for i in range(110):  # past the first buffer's capacity (300 + 256, rounded up)
        ids = torch.tensor([[i % 90 + 1, (i + 3) % 90 + 1, (i + 5) % 90 + 1]])
        _close(graphed.forward(ids).logits, lean.forward(ids).logits)
    assert graphed.cache.layers[0].store is not first
    assert graphed.tokens == lean.tokens
    assert len(cpu_graphs.graphs.by_model[m][1]) <= compiled.MAX_BUFFER_SETS


@pytest.mark.parametrize("layer", [0, 1, "last"])
def test_graphed_rows_capture_the_hidden_states_transformers_forward_gives(cpu_graphs, layer):
    m = tiny(3).model
    hf, graphed = CachedModel(m), CachedModel(m, forward_impl=cpu_graphs)
    layer = hf.num_layers if layer == "last" else layer
    for cm in (hf, graphed):
        cm.prefill(torch.tensor([list(range(20, 45))]))
    ids = torch.tensor([[5, 6, 7]])
    want, got = hf.forward(ids, hidden_layer=layer), graphed.forward(ids, hidden_layer=layer, logits_at=[0, 2])
    assert got.hidden.shape == want.hidden.shape == (1, 3, m.config.hidden_size)
    _close(got.hidden, want.hidden)
    _close(got.logits, want.logits[:, [0, 2]])
    assert graphed.padded_rows == 1


def test_every_lossless_method_on_graphed_forwards_reproduces_ar(cpu_graphs):
    from tests.decoding.test_lossless import LOSSLESS

    assert_lossless_under(cpu_graphs, LOSSLESS, ("noisy",))
    assert EagerGraph.captures > 0


def test_the_buffers_and_their_graphs_serve_the_next_prompt(cpu_graphs):
    m = tiny(2).model
    lean, graphed = CachedModel(m, forward_impl="lean"), CachedModel(m, forward_impl=cpu_graphs)

    def run(prompt_len):
        prompt = torch.tensor([[(5 * i) % 90 + 1 for i in range(prompt_len)]])
        _close(graphed.prefill(prompt), lean.prefill(prompt))
        for block in ([1], [2, 3, 4], [5], [6, 7]):
            ids = torch.tensor([block])
            _close(graphed.forward(ids).logits, lean.forward(ids).logits)
        assert graphed.tokens == lean.tokens
        return graphed.cache.layers[0].store

    first = run(30)
    captures = EagerGraph.captures  # one-token step, 4 and 2 rows
    assert run(20) is first and run(30) is first  # shorter or as long: the same buffers, no new capture
    assert EagerGraph.captures == captures
    assert run(400) is not first  # too long for them: new buffers (and graphs)
    assert EagerGraph.captures > captures
    # other forwards take fresh buffers on every prompt, as before
    plain = CachedModel(m, forward_impl="lean")
    plain.prefill(torch.tensor([[1, 2, 3]]))
    store = plain.cache.layers[0].store
    plain.prefill(torch.tensor([[1, 2, 3]]))
    assert plain.cache.layers[0].store is not store


@needs_compiler
def test_the_compiled_rows_compute_what_the_eager_rows_compute_at_every_row_count():
    """One compile of the rows function (row count and capacity dynamic) serves 2, 4 and 8 rows and a capture
    layer; its logits, hidden states and cache writes equal the eager function's."""
    m = tiny(1).model
    fn, eager = compiled.Graphs(compile=True).rows_fn(m), compiled.Graphs(compile=False).rows_fn(m)
    g = torch.Generator().manual_seed(0)
    for width, capacity, capture in ((2, 64, None), (4, 64, None), (8, 96, None), (4, 64, (2,)), (4, 64, (1, 0, 2))):
        keys = [torch.randn(1, 2, capacity, 16, generator=g) for _ in m.model.layers]
        values = [torch.randn(1, 2, capacity, 16, generator=g) for _ in m.model.layers]
        ids = torch.randint(0, 100, (1, width), generator=g)
        positions = torch.arange(30, 30 + width)[None]
        at = torch.arange(30, 30 + width)
        allowed = torch.ones(width, capacity, dtype=torch.bool).tril(30)
        mask = torch.zeros(1, 1, width, capacity).masked_fill(~allowed, torch.finfo(torch.float32).min)
        for t, dims in ((ids, (1,)), (positions, (1,)), (at, (0,)), (mask, (2, 3)), *((b, (2,)) for b in keys + values)):
            for d in dims:
                torch._dynamo.maybe_mark_dynamic(t, d)
        k2, v2 = [k.clone() for k in keys], [v.clone() for v in values]
        want = eager(m, ids, positions, keys, values, at, mask, capture)
        got = fn(m, ids, positions, k2, v2, at, mask, capture)
        for a, b in zip(want if capture is not None else (want,), got if capture is not None else (got,)):
            _close(b, a)
        for a, b in zip(keys + values, k2 + v2):
            _close(b, a)
