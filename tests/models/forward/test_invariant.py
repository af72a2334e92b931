"""attn_implementation=invariant (pardec.models.forward.invariant): with per-token int8 linears a forward of several new
rows gives bitwise the logits of one-row steps, so `tokens` methods equal `ar` by construction; it is SDPA's
attention up to rounding; bad masks and the forwards that run their own attention are refused."""

from __future__ import annotations

import pytest
import torch

from pardec.config import ModelConfig
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.models.forward import invariant
from pardec.models.loading import load_model


def _cfg(attn: str, dtype: str = "fp32", layers: int = 2, hidden: int = 128) -> ModelConfig:
    extra = {"int8_weights": "per_token", "int8_smooth": None, "int8_skip": []} if dtype == "int8" else {}
    return ModelConfig(name="tiny_random", source="tiny_random", seed=1, dtype=dtype, device="cpu", layers=layers,
                       hidden=hidden, attn_implementation=attn, **extra)


def _rows_and_steps(lm, prompt: list[int], new: list[int]):
    rows, steps = CachedModel(lm.model), CachedModel(lm.model)
    rows.prefill(torch.tensor([prompt]))
    steps.prefill(torch.tensor([prompt]))
    together = rows.forward(torch.tensor([new])).logits[0]
    alone = torch.cat([steps.forward(torch.tensor([[t]])).logits[0] for t in new])
    return together, alone


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_rows_equal_one_row_steps_bitwise_with_per_token_int8_and_equal_sdpa_up_to_rounding(dtype):
    """With per-token int8 linears every op of a layer is row by row: bitwise. fp32's linears are small-M GEMMs
    (not batch-invariant), so there only the closeness to SDPA is checked."""
    lm = load_model(_cfg("invariant", dtype))
    prompt, new = [(7 * i) % 90 + 3 for i in range(37)], [5, 17, 29, 41, 53, 8]
    together, alone = _rows_and_steps(lm, prompt, new)
    if dtype == "int8":
        assert torch.equal(together, alone)
    ref, _ = _rows_and_steps(load_model(_cfg("sdpa", dtype)), prompt, new)  # same seed: the same weights
    assert torch.allclose(together, ref, atol=1e-3 if dtype == "int8" else 1e-5, rtol=0)


@pytest.mark.slow
def test_every_lossless_method_equals_int8_ar_bitwise():
    """Trees included (Medusa, lookahead, FIRP: a node attends to the prefix and its ancestors, gathered in cache
    order, the keys its one-row step would see)."""
    from tests.decoding.test_lossless import LOSSLESS, _build

    lm = load_model(_cfg("invariant", "int8"))
    tok = lm.tokenizer
    ids = tok("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n")["input_ids"]
    stop = Stopper(tok, eos_ids=[])
    want = build_decoder("ar", CachedModel(lm.model), tok).generate(ids, 24, stop).tokens
    for method in LOSSLESS:
        got = _build(method, CachedModel(lm.model), tok, draft="noisy").generate(ids, 24, stop).tokens
        assert got == want, method


def _alone(q, k, v, n):
    """Row ``q`` [1, Hq, 1, D] over the first ``n`` keys as the one-row step at that position attends."""
    plan = invariant.plan_rows(torch.ones(1, 1, n, dtype=torch.bool), q.shape[-1], "cpu")
    return invariant.attend(q, k[:, :, :n], v[:, :, :n], plan, None)[0, 0]


def test_tree_rows_share_a_scratch_buffer_and_see_exactly_their_keys():
    """Gathered rows (tree nodes) reuse one buffer per forward and layer: each copies only what it lacks of its
    leading run of the cache and its tail keys. Rows with longer and shorter runs, a slice row and an empty row in
    one mask: every row's output is bitwise that of a one-row step over exactly its keys, gathered anew."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, s, 8, generator=g) for s in (6, 10, 10))
    keys = [[0, 1, 2, 3, 4, 7], [0, 1, 2, 3, 4, 6, 8], [0, 1, 2, 6], [0, 1, 2, 3, 4, 5, 6, 7], [], [0, 1, 2, 3, 4, 5, 9]]
    mask = torch.zeros(1, 1, 6, 10, dtype=torch.bool)
    for i, row in enumerate(keys):
        mask[0, 0, i, row] = True
    invariant._LAST.update(mask=None, key=None, plan=None)
    plan = invariant._plan(mask, 1, 6, 10, 8, "cpu", first=True)[0]
    assert [(i, n, p, tail.tolist()) for i, n, p, tail in plan.gathered] == [
        (0, 6, 5, [7]), (1, 7, 5, [6, 8]), (2, 4, 3, [6]), (5, 7, 6, [9])]
    calls = [(c.start, c.keys, c.rows.tolist(), c.seen) for c in plan.prefix.calls]
    assert calls == [(0, 22, [3], [8])] and plan.empty == [4]  # 22 + 2 + 8 keys: a multiple of 16
    out, _ = invariant.attention(torch.nn.Module(), q, k, v, mask)
    for i, row in enumerate(keys):
        if not row:
            assert not out[0, i].any()
            continue
        at = torch.tensor(row)
        ref = _alone(q[:, :, i : i + 1], k.index_select(2, at), v.index_select(2, at), len(row))
        assert torch.equal(out[0, i], ref), i


def test_buckets_make_every_thread_scratch_equally_aligned():
    """keys + 2 + head_dim a multiple of 16 floats; the longest shared bucket is at most the kernel's 512-key block."""
    assert invariant.chunk(64) == 510 and invariant.chunk(128) == 510 and invariant.chunk(8) == 502
    assert [invariant.bucket(n, 64) for n in (1, 14, 15, 30, 31, 509, 510)] == [14, 14, 30, 30, 46, 510, 510]
    for d in (8, 32, 64, 80, 128):
        for n in range(1, invariant.chunk(d) + 1):
            b = invariant.bucket(n, d)
            assert n <= b <= invariant.chunk(d) and (b + 2 + d) % 16 == 0


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 4, 32), (4, 2, 8)])
def test_a_row_of_a_many_row_forward_is_bitwise_its_one_row_step(threads, heads, kv_heads, dim, monkeypatch):
    """The property the mode exists for, on SDPA's CPU kernel over several threads: rows at every context (short,
    at a bucket's edge, at the shared chunk's edge, over two and three chunks, a forward whose rows cross from one
    chunk count to the next) computed in one forward of up to 40 rows equal, bit for bit, the one-row step at their
    position; and they are SDPA's attention up to rounding. Keys read past the cache's length (a bucket's masked
    tail) come from the spare slots of the buffer the cache view lies in, or from zeros where there are none. Rows
    over several chunks are merged a few at a time here (as a long prompt's are, 512 at a time)."""
    import torch.nn.functional as F

    monkeypatch.setattr(invariant, "_SLICE", 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(heads * dim)
        buf_k, buf_v = (torch.randn(1, kv_heads, 1200, dim, generator=g) for _ in range(2))
        for ctx, t in [(0, 1), (5, 11), (13, 3), (100, 40), (497, 17), (509, 3), (600, 5), (1000, 8), (1019, 4)]:
            k, v = buf_k[:, :, : ctx + t], buf_v[:, :, : ctx + t]  # a cache view with spare slots after it
            q = torch.randn(1, heads, t, dim, generator=g)
            rows, _ = invariant.attention(torch.nn.Module(), q, k, v, None)
            for i in range(t):
                n = ctx + i + 1
                tight = (k[:, :, :n].clone(), v[:, :, :n].clone())  # no spare slots: padded
                for kk, vv in ((k, v), tight):
                    assert torch.equal(rows[0, i], _alone(q[:, :, i : i + 1], kk, vv, n)), (ctx, t, i)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=heads != kv_heads,
                                                 attn_mask=invariant._allowed(None, 1, t, ctx + t, "cpu")[:, None])
            assert torch.allclose(rows, ref.transpose(1, 2), atol=1e-5, rtol=0)
    finally:
        torch.set_num_threads(before)


def test_the_allowed_keys_of_each_mask_form():
    causal = invariant._allowed(None, 1, 2, 4, "cpu")
    assert causal[0].tolist() == [[True, True, True, False], [True, True, True, True]]
    ninf = torch.finfo(torch.float32).min
    additive = torch.tensor([[[[0.0, ninf, 0.0], [ninf, 0.0, 0.0]]]])
    assert invariant._allowed(additive, 1, 2, 3, "cpu")[0].tolist() == [[True, False, True], [False, True, True]]
    assert invariant._allowed(additive == 0, 1, 2, 3, "cpu").equal(invariant._allowed(additive, 1, 2, 3, "cpu"))
    with pytest.raises(ValueError, match="carries a bias"):
        invariant._allowed(additive + 0.5, 1, 2, 3, "cpu")
    with pytest.raises(ValueError, match="differs between heads"):
        invariant._allowed(torch.cat([additive, additive.flip(-1)], 1), 1, 2, 3, "cpu")
    with pytest.raises(ValueError, match="4D attention mask"):
        invariant._allowed(torch.zeros(2, 3), 1, 2, 3, "cpu")
    q = torch.zeros(1, 2, 1, 4)
    with pytest.raises(ValueError, match="dropout 0.1"):
        invariant.attention(torch.nn.Module(), q, q, q, None, dropout=0.1)


def test_forwards_with_their_own_attention_refuse_it():
    m = load_model(_cfg("invariant")).model
    for impl in ("lean", "compiled"):
        with pytest.raises(Exception, match="attn_implementation='invariant'"):
            CachedModel(m, forward_impl=impl)


def test_a_forward_reads_its_mask_once_and_a_new_forward_reads_it_again(monkeypatch):
    lm = load_model(_cfg("invariant", "int8", layers=3))
    reads = []
    real = invariant._allowed
    monkeypatch.setattr(invariant, "_allowed", lambda *a: reads.append(1) or real(*a))
    cm = CachedModel(lm.model)
    cm.prefill(torch.tensor([[3, 4, 5, 6, 7]]))
    reads.clear()
    cm.forward(torch.tensor([[8, 9, 10]]))
    assert reads == [1]  # three layers, one read
    cm.forward(torch.tensor([[11]]))
    assert reads == [1, 1]  # the next forward: read anew
