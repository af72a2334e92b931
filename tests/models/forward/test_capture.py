"""Hidden-state capture of several chosen layers (EAGLE-3's low/mid/high features) on every forward implementation:
prefill, one-token steps, a tree verification and a last-only forward give the states transformers'
``output_hidden_states`` gives for the same positions, concatenated in the order asked; bad layers are refused."""

from __future__ import annotations

import pytest
import torch

from pardec.models.cached import CachedModel
from pardec.testing.graphs import cpu_graphs
from tests.conftest import tiny
from tests.models.forward.test_lean import _close

# (compiled: the same rows function as cpu_graphs, under torch.compile: test_compiled checks that it computes the same)
IMPLS = ["hf", "lean", "cpu_graphs"]


def _reference(model, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """[T, len(layers) * H]: transformers' hidden_states (index i enters layer i; the last is after the final norm)."""
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in layers], dim=-1)


@pytest.mark.parametrize("impl", IMPLS)
def test_several_layers_are_captured_on_every_forward(impl):
    m = tiny(2, layers=4).model
    n = m.config.num_hidden_layers
    layers = (1, n - 1, 0, n)  # any order, the embeddings and after the final norm included
    cm = CachedModel(m, forward_impl=cpu_graphs() if impl == "cpu_graphs" else impl)
    prompt = list(range(30, 50))
    out = cm.forward(torch.tensor([prompt]), hidden_layer=layers)
    h = m.config.hidden_size
    assert out.hidden.shape == (1, len(prompt), len(layers) * h)
    _close(out.hidden[0], _reference(m, prompt, layers))
    step = cm.forward(torch.tensor([[7]]), hidden_layer=layers)  # one token
    _close(step.hidden[0], _reference(m, prompt + [7], layers)[-1:])
    verify = cm.forward(torch.tensor([[8, 9, 10]]), hidden_layer=layers, logits_at=[2])  # rows (padded to 4 graphed)
    assert verify.hidden.shape == (1, 3, len(layers) * h)
    _close(verify.hidden[0], _reference(m, prompt + [7, 8, 9, 10], layers)[-3:])
    # a tree: node 2 sees the root and itself only, at the root's child position
    tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    base = cm.length
    t = cm.forward(torch.tensor([[11, 12, 13]]), positions=torch.tensor([base, base + 1, base + 1]), attend=tree,
                   hidden_layer=layers)
    seq = prompt + [7, 8, 9, 10, 11]
    _close(t.hidden[0, 1], _reference(m, seq + [12], layers)[-1])
    _close(t.hidden[0, 2], _reference(m, seq + [13], layers)[-1])
    last = cm.forward(torch.tensor([[14, 15]]), last_only=True, hidden_layer=(2,))  # every row's states
    assert last.logits.shape[1] == 1 and last.hidden.shape == (1, 2, h)


def test_one_layer_keeps_its_shape_and_bad_layers_are_refused():
    m = tiny(1).model
    cm = CachedModel(m, forward_impl="lean")
    n = cm.num_layers
    assert cm.forward(torch.tensor([[1, 2, 3]]), hidden_layer=1).hidden.shape == (1, 3, m.config.hidden_size)
    for bad in (n + 1, -1, (0, n + 3)):
        with pytest.raises(ValueError, match=rf"hidden_layer=(-1|{n + 1}|{n + 3}) is out of range: choose 0"):
            cm.forward(torch.tensor([[4]]), hidden_layer=bad)
    with pytest.raises(ValueError, match="name at least one layer"):
        cm.forward(torch.tensor([[4]]), hidden_layer=())
    assert cm.length == 3  # refused before anything ran
