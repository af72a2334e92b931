"""The cached-model seam against recomputation: truncate, keep, tree masks, padding."""

import pytest
import torch

from pardec.models.cached import CachedModel
from pardec.models.pseudo import run_upper
from tests.conftest import tiny


def _full_logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def test_prefill_and_forward_match_full_forward():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    ids = list(range(100, 120))
    full = _full_logits(lm.model, ids)
    last = cm.prefill(torch.tensor([ids[:12]]))
    torch.testing.assert_close(last[0], full[11], rtol=1e-4, atol=1e-5)
    step = cm.forward(torch.tensor([ids[12:20]])).logits[0]
    torch.testing.assert_close(step, full[12:20], rtol=1e-4, atol=1e-5)
    assert cm.length == 20


def test_truncate_equals_recomputation():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    ids = list(range(200, 230))
    cm.prefill(torch.tensor([ids[:10]]))
    cm.forward(torch.tensor([[5, 6, 7, 8, 9]]))  # a rejected draft
    cm.truncate(10)
    assert cm.length == 10
    got = cm.forward(torch.tensor([ids[10:15]])).logits[0]
    torch.testing.assert_close(got, _full_logits(lm.model, ids[:15])[10:15], rtol=1e-4, atol=1e-5)


def test_keep_subset_of_last_appended_equals_recomputation():
    lm = tiny(1)
    cm = CachedModel(lm.model)
    prefix = list(range(300, 310))
    cm.prefill(torch.tensor([prefix]))
    # tree: root a, children b (path a-b) and c (path a-c), grandchild d under c: keep path a, c, d
    a, b, c, d = 11, 12, 13, 14
    attend = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    pos = torch.tensor([10, 11, 11, 12])
    cm.forward(torch.tensor([[a, b, c, d]]), positions=pos, attend=attend)
    cm.keep([0, 2, 3])
    assert cm.length == 13
    nxt = cm.forward(torch.tensor([[15]])).logits[0, -1]
    ref = _full_logits(lm.model, prefix + [a, c, d, 15])[-1]
    torch.testing.assert_close(nxt, ref, rtol=1e-4, atol=1e-5)


def test_tree_mask_forward_equals_separate_branch_forwards():
    lm = tiny(2)
    cm = CachedModel(lm.model)
    prefix = list(range(400, 408))
    cm.prefill(torch.tensor([prefix]))
    # two branches sharing a root: [r, x1, x2] and [r, y1]
    r, x1, x2, y1 = 21, 22, 23, 24
    attend = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    pos = torch.tensor([8, 9, 10, 9])
    tree = cm.forward(torch.tensor([[r, x1, x2, y1]]), positions=pos, attend=attend).logits[0]
    branch_x = _full_logits(lm.model, prefix + [r, x1, x2])[8:]
    branch_y = _full_logits(lm.model, prefix + [r, y1])[8:]
    torch.testing.assert_close(tree[:3], branch_x, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(tree[3], branch_y[1], rtol=1e-4, atol=1e-5)


def test_left_padded_batch_equals_unpadded_rows():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    rows = [list(range(500, 506)), list(range(600, 609))]
    T = max(map(len, rows))
    pad = 0
    ids = torch.tensor([[pad] * (T - len(r)) + r for r in rows])
    valid = torch.tensor([[False] * (T - len(r)) + [True] * len(r) for r in rows])
    pos = torch.stack([torch.clamp(torch.arange(T) - (T - len(r)), min=0) for r in rows])
    out = cm.forward(ids, positions=pos, key_valid=valid).logits
    for b, r in enumerate(rows):
        ref = _full_logits(lm.model, r)
        torch.testing.assert_close(out[b, T - len(r):], ref, rtol=1e-4, atol=1e-5)


def test_truncate_and_keep_reject_bad_arguments():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    cm.prefill(torch.tensor([[1, 2, 3]]))
    try:
        cm.truncate(5)
    except ValueError as e:
        assert "cannot truncate" in str(e)
    else:
        raise AssertionError("truncate past the end must raise")
    try:
        cm.keep([0, 7])
    except ValueError as e:
        assert "out of range" in str(e)
    else:
        raise AssertionError("keep out of range must raise")


def test_logits_at_chosen_positions_only():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    ids = list(range(700, 716))
    full = _full_logits(lm.model, ids)
    cm.prefill(torch.tensor([ids[:8]]))
    got = cm.forward(torch.tensor([ids[8:]]), logits_at=[0, 5, 7]).logits[0]
    assert got.shape[0] == 3
    torch.testing.assert_close(got, full[[8, 13, 15]], rtol=1e-4, atol=1e-5)
    assert cm.length == 16  # every new token is still cached


def test_hidden_states_of_a_chosen_layer_and_run_upper_from_them():
    lm = tiny(1, layers=3)
    cm = CachedModel(lm.model)
    ids = list(range(800, 812))
    full = _full_logits(lm.model, ids)
    ref_hidden = lm.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    cm.prefill(torch.tensor([ids[:6]]))
    for layer in range(3):
        cm.truncate(6)
        out = cm.forward(torch.tensor([ids[6:]]), hidden_layer=layer)
        torch.testing.assert_close(out.hidden[0], ref_hidden[layer][0, 6:], rtol=1e-4, atol=1e-5)
        # inject those states entering `layer` again, over the cache of the first 6 tokens only
        cm.truncate(6)
        up = run_upper(cm, out.hidden, layer, positions=torch.arange(6, 12))
        torch.testing.assert_close(up[0], full[6:], rtol=1e-4, atol=1e-5)
        assert cm.length == 6  # nothing appended by run_upper
    # a pseudo state that sees only part of the cache (positions 0..3) and itself equals the same state
    # run over a cache that holds only those positions
    cm.truncate(6)
    h = cm.forward(torch.tensor([[ids[6]]]), hidden_layer=1).hidden
    cm.truncate(6)
    see = torch.zeros(1, 7, dtype=torch.bool)
    see[0, :4] = True
    see[0, -1] = True
    up = run_upper(cm, h, 1, positions=torch.tensor([4]), attend=see)
    cm.truncate(4)
    torch.testing.assert_close(up[0, 0], run_upper(cm, h, 1, positions=torch.tensor([4]))[0, 0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="out of range"):
        run_upper(cm, h, 3, positions=torch.tensor([6]))


def test_cache_knows_its_tokens_and_syncs_with_a_committed_sequence():
    lm = tiny(0)
    cm = CachedModel(lm.model)
    cm.prefill(torch.tensor([[1, 2, 3, 4]]))
    cm.forward(torch.tensor([[5, 6, 7]]))
    assert cm.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert cm.sync([1, 2, 3, 4, 5, 9, 10]) == [9, 10]  # drafted 6, 7 rejected: cut to the common prefix
    assert cm.tokens == [1, 2, 3, 4, 5] and cm.length == 5
    assert cm.sync([1, 2, 3, 4, 5]) == [5]  # fully held: the last token is fed again for its logits
    assert cm.length == 4
    cm.truncate(2)
    assert cm.tokens == [1, 2]
    assert cm.sync([8]) == [8] and cm.length == 0
    # after catching up, logits equal a recomputation
    got = cm.forward(torch.tensor([[8, 9, 10]])).logits[0, -1]
    torch.testing.assert_close(got, _full_logits(lm.model, [8, 9, 10])[-1], rtol=1e-4, atol=1e-5)


def test_non_finite_logits_raise_naming_model_and_position():
    import copy

    from pardec.models.cached import NonFiniteLogitsError

    model = copy.deepcopy(tiny(0).model)
    with torch.no_grad():
        model.lm_head.weight[123] = float("nan")
    cm = CachedModel(model, name="nan-model")
    with pytest.raises(NonFiniteLogitsError, match=r"'nan-model'.*position 2"):
        cm.prefill(torch.tensor([[1, 2, 3]]))
    with pytest.raises(NonFiniteLogitsError, match="position 5"):
        cm.forward(torch.tensor([[4, 5, 6]]), logits_at=[2])
