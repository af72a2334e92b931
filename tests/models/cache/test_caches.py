"""The preallocated KV cache (pardec.models.cache.preallocated) against transformers' DynamicCache: same logits through every
verb of the model seam, compaction that copies only the kept positions, rows leaving and joining a batch, growth,
and placement on (virtual) GPUs."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import DynamicCache

from pardec.config import KV_CACHES
from pardec.models.cache.preallocated import PreallocatedCache, PreallocatedLayer
from pardec.models.cached import CachedModel, NonFiniteLogitsError
from pardec.models.drafters import new_drafter
from pardec.models.pseudo import forward_pseudo, run_upper
from pardec.testing import VirtualCUDA
from tests.conftest import tiny


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _pair(model=None):
    model = model if model is not None else tiny(0).model
    return CachedModel(model), CachedModel(model, cache="dynamic")


class _Writes(TorchFunctionMode):
    """Counts the elements written into the given buffers (copy_, item assignment, fill_/zero_)."""

    def __init__(self, buffers):
        super().__init__()
        self.ptrs = {b.untyped_storage().data_ptr() for b in buffers}
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        dst = args[0] if args else None
        if (name in ("copy_", "__setitem__", "fill_", "zero_", "index_copy_") and isinstance(dst, torch.Tensor)
                and dst.untyped_storage().data_ptr() in self.ptrs):
            self.n += dst[args[1]].numel() if name == "__setitem__" else dst.numel()
        return func(*args, **(kwargs or {}))


def _buffers(cm):
    return [b for layer in cm.cache.layers for b in (layer.store.keys, layer.store.values)]


def _per_position(cm) -> int:
    """Elements one cached position of one row occupies over all layers (keys and values)."""
    return sum(layer.keys[:1, :, :1].numel() + layer.values[:1, :, :1].numel() for layer in cm.cache.layers)


def test_it_is_the_default_and_dynamic_can_be_chosen():
    lm = tiny(0)
    assert isinstance(CachedModel(lm.model).cache, PreallocatedCache)
    assert isinstance(CachedModel(lm.model, cache="dynamic").cache, DynamicCache)  # (transformers', with the verbs)
    with pytest.raises(ValueError, match="cache='static' is not valid; choose one of: preallocated, dynamic"):
        CachedModel(lm.model, cache="static")


def test_every_verb_gives_the_logits_of_the_dynamic_cache():
    lm = tiny(1)
    torch.manual_seed(0)
    drafter = new_drafter("firp", lm.model.config, layers=[0, 1])
    outs = []
    for cm in _pair(lm.model):
        o = [cm.prefill(torch.tensor([list(range(100, 130))]))]
        tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
        f = cm.forward(torch.tensor([[5, 6, 7, 8]]), positions=torch.tensor([30, 31, 31, 32]), attend=tree,
                       hidden_layer=1)
        o += [f.logits, f.hidden]
        cm.keep([0, 2, 3])
        o.append(cm.forward(torch.tensor([[9, 10, 11]]), logits_at=[0, 2]).logits)
        cm.truncate(cm.length - 2)
        o.append(run_upper(cm, f.hidden[:, :2], 1, positions=torch.tensor([cm.length, cm.length + 1])))
        with torch.no_grad():
            p = forward_pseudo(cm, torch.tensor([[12, 13]]), drafter, drafter.layers, anchors=[0, 1])
        o += [p.logits, p.pseudo]
        o.append(cm.forward(torch.tensor([[14]])).logits)
        o.append(torch.tensor(cm.tokens + [cm.length]))
        outs.append(o)
    for a, b in zip(*outs):
        _close(a, b)


def test_padded_forwards_cache_no_padding_rows():
    from pardec.models.cost import CostTable

    outs = []
    for cm in _pair():
        cm.cost = CostTable("tiny", "fp32", 0, {1: 1.0, **{t: 9.0 for t in range(2, 8)}, 8: 2.0}, machine={})
        cm.prefill(torch.tensor([[1, 2, 3, 4]]))
        o = [cm.forward(torch.tensor([[5, 6, 7]])).logits]
        assert cm.length == 7 and cm.padded_rows == 5
        o.append(cm.forward(torch.tensor([[8]])).logits)
        outs.append(o)
    for a, b in zip(*outs):
        _close(a, b)


def test_keep_copies_only_the_kept_positions_that_move():
    cm, dyn = _pair(tiny(2).model)
    prefix = list(range(300, 310))
    tree = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0],
                         [1, 0, 1, 1, 1, 0], [1, 1, 0, 0, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([10, 11, 11, 12, 13, 12])
    for m in (cm, dyn):
        m.prefill(torch.tensor([prefix]))
        m.forward(torch.tensor([[11, 12, 13, 14, 15, 16]]), positions=pos, attend=tree)
    bufs = _buffers(cm)
    ptrs = [b.data_ptr() for b in bufs]
    before = [layer.keys[:, :, :10].clone() for layer in cm.cache.layers]
    with _Writes(bufs) as w:
        cm.keep([0, 2, 3, 4])  # the path a-c-d-e: a is in place, c, d, e move one slot left
    dyn.keep([0, 2, 3, 4])
    assert w.n == 3 * _per_position(cm)
    assert [b.data_ptr() for b in _buffers(cm)] == ptrs
    for layer, old in zip(cm.cache.layers, before):
        assert torch.equal(layer.keys[:, :, :10], old)  # the prefix is never touched
    for a, b in zip(cm.cache.layers, dyn.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert cm.tokens == dyn.tokens == prefix + [11, 13, 14, 15]
    _close(cm.forward(torch.tensor([[17]])).logits, dyn.forward(torch.tensor([[17]])).logits)
    with _Writes(_buffers(cm)) as w:
        cm.keep([0])  # already in place: nothing to copy
    assert w.n == 0 and cm.length == 15


def test_dropping_leading_positions_moves_no_keys():
    cm, dyn = _pair()
    for m in (cm, dyn):
        m.prefill(torch.tensor([list(range(40, 60))]))
    with _Writes(_buffers(cm)) as w:
        cm.keep(list(range(5, 20)), start=0)  # what CLLM collection does to padding no row may see
    dyn.keep(list(range(5, 20)), start=0)
    assert w.n == 0 and all(layer.begin == 5 for layer in cm.cache.layers)
    assert cm.tokens == dyn.tokens == list(range(45, 60))
    ids, pos = torch.tensor([[7, 8]]), torch.tensor([20, 21])
    _close(cm.forward(ids, positions=pos).logits, dyn.forward(ids, positions=pos).logits)


def test_capacity_grows_by_doubling_and_shifts_when_that_suffices(monkeypatch):
    monkeypatch.setattr(PreallocatedLayer, "headroom", 0)
    cm, dyn = _pair()
    ids = torch.arange(100, 400)[None]
    for m in (cm, dyn):
        m.prefill(ids[:, :60])
    layer = cm.cache.layers[0]
    assert layer.store.capacity == 64
    store = layer.store
    for m in (cm, dyn):
        m.keep(list(range(3, 60)), start=0)  # begin 3, 57 positions
    pos = torch.arange(60, 65)
    _close(cm.forward(ids[:, 60:65], positions=pos).logits, dyn.forward(ids[:, 60:65], positions=pos).logits)
    assert layer.store is store and layer.begin == 0  # 62 positions fit: shifted to the start, no new buffer
    pos = torch.arange(65, 75)
    _close(cm.forward(ids[:, 65:75], positions=pos).logits, dyn.forward(ids[:, 65:75], positions=pos).logits)
    assert layer.store is not store and layer.store.capacity == 128 and cm.length == 72
    pos = torch.arange(75, 205)
    _close(cm.forward(ids[:, 75:205], positions=pos).logits, dyn.forward(ids[:, 75:205], positions=pos).logits)
    assert layer.store.capacity == 256
    for a, b in zip(cm.cache.layers, dyn.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _batch(cm, prompts):
    """Left-padded prefill of ``prompts`` (the padding masked, positions per row), as CLLM collection does."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        valid[i, width - len(p):] = True
    cm.forward(ids, positions=(valid.cumsum(-1) - 1).clamp(min=0), key_valid=valid, last_only=True)
    return valid


def _same_cache(a: CachedModel, b: CachedModel):
    assert a.rows == b.rows and a.length == b.length
    assert torch.equal(a._tokens.host(), b._tokens.host())
    for x, y in zip(a.cache.layers, b.cache.layers):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


def test_parked_rows_rejoin_without_a_copy_and_equal_the_dynamic_cache():
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    cm, dyn = _pair()
    for m in (cm, dyn):
        valid = _batch(m, prompts)
    parts = {}
    for name, m in (("pre", cm), ("dyn", dyn)):
        p1 = m.take_rows([1, 3])  # converged rows leave, the others go on
        p2 = m.take_rows([0])
        p3 = m.take_rows([0])
        assert m.rows == 0 and [p.rows for p in (p1, p2, p3)] == [2, 1, 1]
        parts[name] = (p1, p2, p3)
    for a, b in zip(parts["pre"], parts["dyn"]):
        _same_cache(a, b)
    store = cm.cache.layers[0].store
    assert all(p.cache.layers[0].store is store for p in parts["pre"])  # parked in the batch's own buffers
    with _Writes(_buffers(parts["pre"][0])) as w:
        for a, b in zip(parts["pre"], parts["dyn"]):
            assert cm.join_rows(a) == dyn.join_rows(b) == (0, 0)
    assert w.n == 0  # back in the order they left: no key or value moved
    _same_cache(cm, dyn)
    order = [1, 3, 0, 2]  # the rows' order after the joins
    ids = torch.tensor([[1], [2], [3], [4]])
    pos = torch.tensor([[len(prompts[i])] for i in order])
    valid = torch.cat([valid[order], torch.ones(4, 1, dtype=torch.bool)], dim=1)
    _close(cm.forward(ids, positions=pos, key_valid=valid).logits,
           dyn.forward(ids, positions=pos, key_valid=valid).logits)


def test_rows_leave_and_join_with_padding_as_the_dynamic_cache_does():
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    cm, dyn = _pair()
    for m in (cm, dyn):
        _batch(m, prompts)
    with _Writes(_buffers(cm)) as w:
        done = cm.take_rows([1])  # [taken | kept]: rows 0 and 1 swap places, row 2 stays
    assert w.n == 2 * 4 * _per_position(cm)
    dyn_done = dyn.take_rows([1])
    _same_cache(done, dyn_done)
    _same_cache(cm, dyn)
    for m in (cm, dyn):
        m.forward(torch.tensor([[1, 2], [3, 4]]), positions=torch.tensor([[3, 4], [4, 5]]),
                  key_valid=torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool))
    del done, dyn_done  # finished: dropped
    fresh = [CachedModel(cm.model), CachedModel(cm.model, cache="dynamic")]
    for m in fresh:
        _batch(m, [[20, 21], [22]])
    assert cm.join_rows(fresh[0]) == dyn.join_rows(fresh[1]) == (0, 4)  # the newcomers are padded
    _same_cache(cm, dyn)
    assert fresh[0].rows == 1 and fresh[0].length == 0  # consumed
    short = [CachedModel(cm.model), CachedModel(cm.model, cache="dynamic")]
    for m in short:
        m.forward(torch.tensor([list(range(30, 40))]))
    assert cm.join_rows(short[0]) == dyn.join_rows(short[1]) == (4, 0)  # now this side is padded
    _same_cache(cm, dyn)
    ids = torch.tensor([[1], [2], [3], [4], [5]])
    _close(cm.forward(ids, positions=torch.full((5, 1), 10)).logits,
           dyn.forward(ids, positions=torch.full((5, 1), 10)).logits)


def test_rows_join_across_cache_kinds():
    prompts = [[5, 6, 7], [8, 9]]
    model = tiny(0).model
    ref, pre, dyn = CachedModel(model, cache="dynamic"), CachedModel(model), CachedModel(model, cache="dynamic")
    for m in (ref, pre, dyn):
        _batch(m, prompts)
    other = [CachedModel(model, cache="dynamic"), CachedModel(model, cache="dynamic"), CachedModel(model)]
    for m in other:
        m.forward(torch.tensor([[1, 2, 3, 4, 5]]))
    pads = [ref.join_rows(other[0]), pre.join_rows(other[1]), dyn.join_rows(other[2])]
    assert pads == [(2, 0)] * 3
    _same_cache(pre, ref)
    _same_cache(dyn, ref)


def test_grad_through_pseudo_states_equals_the_dynamic_cache():
    lm = tiny(0)  # shared (tests/conftest.py caches it): frozen here, as in FIRP training, and restored after, so
    # that no gradient is left on it for later tests (test_heads asserts the frozen base got none)
    before = [p.requires_grad for p in lm.model.parameters()]
    lm.model.requires_grad_(False)
    try:
        _grad_through_pseudo_states(lm)
    finally:
        for p, r in zip(lm.model.parameters(), before):
            p.requires_grad_(r)
            p.grad = None


def _grad_through_pseudo_states(lm):
    torch.manual_seed(0)
    drafter = new_drafter("firp", lm.model.config, layers=[0, 1])
    ids = torch.tensor([[1, 504, 1812, 30, 12, 99]])
    grads, outs = [], []
    for cm in _pair(lm.model):
        drafter.zero_grad()
        out = forward_pseudo(cm, ids, drafter, drafter.layers, anchors=[2, 3, 4], logits_at=[2, 3, 4], split=True,
                                teacher_forced=True)
        cm.lm_head(out.pseudo).logsumexp(-1).sum().backward()
        outs.append(out.pseudo.detach())
        grads.append([p.grad.clone() for p in drafter.parameters()])
        assert cm.length == ids.shape[1]
    _close(*outs)
    for a, b in zip(*grads):
        _close(a, b)
    pre = CachedModel(lm.model)
    forward_pseudo(pre, ids, drafter, drafter.layers, split=True)
    assert not any(b.requires_grad for b in _buffers(pre))


def test_buffers_live_where_each_layer_runs():
    from tests.models.test_virtual_cuda import _split

    model = copy.deepcopy(tiny(0).model)
    on_cpu = CachedModel(model)
    ref = on_cpu.prefill(torch.tensor([[1, 2, 3]]))
    with VirtualCUDA(devices=2) as vc:
        _split(model, vc)
        cm = CachedModel(model)
        got = cm.prefill(torch.tensor([[1, 2, 3]]))
        assert [str(layer.store.keys.device) for layer in cm.cache.layers] == ["cuda:0", "cuda:1"]
        cm.forward(torch.tensor([[4, 5, 6]]))
        cm.keep([1])
        assert cm.tokens == [1, 2, 3, 5]
        got = got.cpu()
    _close(got, ref)


def test_non_finite_logits_on_a_gpu_raise_at_the_next_use_without_a_sync_in_the_forward():
    model = copy.deepcopy(tiny(0).model)
    with torch.no_grad():
        model.lm_head.weight[123] = float("nan")
    with VirtualCUDA() as vc:
        vc.place(model)
        cm = CachedModel(model, name="nan-model")
        before = sum(vc.syncs.values())
        cm.prefill(torch.tensor([[1, 2, 3]]))  # flagged, not read
        assert sum(vc.syncs.values()) - before <= 1  # the flag's asynchronous copy to the host
        with pytest.raises(NonFiniteLogitsError, match=r"'nan-model'.*position 2 .*earlier forward"):
            cm.forward(torch.tensor([[4]]))
        assert cm.length == 3  # the forward did not run
        cm.forward(torch.tensor([[4, 5, 6]]), logits_at=[2])
        with pytest.raises(NonFiniteLogitsError, match="position 5"):
            cm.check_finite()
        cm.check_finite()  # reported once


@pytest.mark.parametrize("kind", KV_CACHES)
def test_checkpointed_upper_layers_give_the_same_gradients_and_keep_fewer_activations(kind):
    """forward_pseudo(checkpoint=True): the upper layers over the pseudo states recompute in backward, after the call
    returned: same pseudo states and drafter gradients as without, the cache untouched by the recompute, and fewer
    saved activations."""
    lm = tiny(1)  # shared: frozen here (FIRP trains with a frozen target) and restored after
    before = [p.requires_grad for p in lm.model.parameters()]
    lm.model.requires_grad_(False)
    try:
        _checkpointed_pseudo(lm, kind)
    finally:
        for p, r in zip(lm.model.parameters(), before):
            p.requires_grad_(r)
            p.grad = None


def _checkpointed_pseudo(lm, kind):
    torch.manual_seed(0)
    drafter = new_drafter("firp", lm.model.config, layers=[0, 1])
    ids = torch.tensor([[1, 504, 1812, 30, 12, 99, 7, 8]])
    runs = []
    for ckpt in (False, True):
        drafter.zero_grad()
        cm = CachedModel(lm.model, cache=kind)
        saved = [0]

        def pack(x, saved=saved):
            saved[0] += x.numel()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = forward_pseudo(cm, ids, drafter, drafter.layers, anchors=[2, 3, 4, 5], logits_at=[2, 3, 4, 5],
                                    split=True, teacher_forced=True, checkpoint=ckpt)
            loss = cm.lm_head(out.pseudo).logsumexp(-1).sum()
        loss.backward()
        assert cm.length == ids.shape[1]
        after = cm.forward(torch.tensor([[42]])).logits  # the cache after backward: the real positions only
        runs.append((out.pseudo.detach(), [p.grad.clone() for p in drafter.parameters()], after, saved[0]))
    (p0, g0, a0, s0), (p1, g1, a1, s1) = runs
    _close(p0, p1)
    _close(a0, a1)
    for a, b in zip(g0, g1):
        _close(a, b)
    assert any(float(g.abs().sum()) > 0 for g in g1)
    assert s1 < s0, (s1, s0)
    with pytest.raises(ValueError, match="checkpoint needs split=True"):
        forward_pseudo(CachedModel(lm.model, cache=kind), ids, drafter, drafter.layers, checkpoint=True)


def test_taken_rows_keep_the_forward_and_its_cost_table():
    """Rows taken out run as the batch's rows did: a lean model's parked rows stay lean (not the hf forward), with
    the same forward-cost table."""
    cm = CachedModel(tiny(0).model, forward_impl="lean")
    cm.cost = object()  # any table: it is handed on, not read here
    _batch(cm, [[5, 6, 7], [8, 9]])
    taken = cm.take_rows([1])
    assert (taken.forward_impl, taken.cost, taken.cache_kind) == ("lean", cm.cost, cm.cache_kind)
