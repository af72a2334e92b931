"""Tree: structure from paths / parents / chains, masks and positions; tree forwards against per-branch
recomputation; KV compaction to the accepted path; branches left in the cache invisible to each other."""

from __future__ import annotations

import pytest
import torch

from pardec.decoding.tree import Tree
from pardec.models.cached import CachedModel
from tests.conftest import tiny


def _full_logits(model, ids):
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]


def test_trie_from_paths_merges_shared_prefixes():
    t = Tree.from_paths([[5, 6, 7], [5, 6, 8], [5, 9], [4]])
    # nodes: 0 root, 1:5, 2:6, 3:7, 4:8, 5:9, 6:4
    assert t.parents == [-1, 0, 1, 2, 2, 1, 0]
    assert t.labels[1:] == [5, 6, 7, 8, 9, 4]
    assert t.depth.tolist() == [0, 1, 2, 3, 3, 2, 1]
    assert t.positions(10).tolist() == [10, 11, 12, 13, 13, 12, 11]
    assert t.paths == [[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 5], [0, 6]]
    assert t.children[0] == [1, 6] and t.max_depth == 3
    assert t.tokens(99).tolist() == [99, 5, 6, 7, 8, 9, 4]
    want = torch.zeros(7, 7, dtype=torch.bool)
    for i in range(7):
        for j in t.path_to(i):
            want[i, j] = True
    assert torch.equal(t.attend, want)
    assert not t.attend[3, 4] and not t.attend[6, 1]  # siblings and cousins do not see each other


def test_chain_is_the_degenerate_tree():
    t = Tree.chain([3, 4, 5])
    assert t.parents == [-1, 0, 1, 2] and t.paths == [[0, 1, 2, 3]]
    assert torch.equal(t.attend, torch.ones(4, 4, dtype=torch.bool).tril())
    assert Tree.chain([]).paths == [] and len(Tree.chain([])) == 1


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="before their children"):
        Tree.from_parents([-1, 2, 0], [-1, 1, 2])
    with pytest.raises(ValueError, match="repeats label"):
        Tree.from_parents([-1, 0, 0], [-1, 5, 5])
    with pytest.raises(ValueError, match="root"):
        Tree.from_parents([0, 0], [-1, 1])


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_forward_equals_per_branch_recomputation_and_compaction(seed):
    lm = tiny(seed)
    cm = CachedModel(lm.model)
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(100, 2000, (9,), generator=g).tolist()
    paths = [torch.randint(100, 2000, (n,), generator=g).tolist() for n in (4, 2, 3)]
    paths.append(paths[0][:2] + [77, 78])  # shares a prefix with the first path
    tree = Tree.from_paths(paths)
    root = prefix[-1]
    cm.prefill(torch.tensor([prefix[:-1]]))
    base = cm.length
    logits = cm.forward(tree.tokens(root)[None], positions=tree.positions(base), attend=tree.attend).logits[0]
    for i in range(len(tree)):
        seq = prefix + [tree.labels[n] for n in tree.path_to(i)[1:]]
        torch.testing.assert_close(logits[i], _full_logits(lm.model, seq)[-1], rtol=1e-4, atol=1e-5)
    # keep one root-to-leaf path (KV compaction), then continue: equals recomputation of the kept sequence
    path = tree.paths[3]
    cm.keep(path)
    assert cm.length == base + len(path)
    assert cm.tokens == prefix + [tree.labels[n] for n in path[1:]]
    nxt = cm.forward(torch.tensor([[5, 6]])).logits[0]
    ref = _full_logits(lm.model, prefix + [tree.labels[n] for n in path[1:]] + [5, 6])[-2:]
    torch.testing.assert_close(nxt, ref, rtol=1e-4, atol=1e-5)


def test_branches_left_in_the_cache_are_invisible_to_each_other():
    lm = tiny(2)
    cm = CachedModel(lm.model)
    prefix = list(range(400, 410))
    cm.prefill(torch.tensor([prefix]))
    p = cm.length
    a = [11, 12, 13]
    cm.forward(torch.tensor([a]))  # branch A stays in the cache at positions p..p+2
    b = [21, 22]
    # branch B at the same positions as A, seeing the prefix and itself but not A
    see = torch.zeros(2, p + 3 + 2, dtype=torch.bool)
    see[:, :p] = True
    see[:, p + 3 :] = torch.ones(2, 2, dtype=torch.bool).tril()
    got = cm.forward(torch.tensor([b]), positions=torch.arange(p, p + 2), attend=see).logits[0]
    torch.testing.assert_close(got, _full_logits(lm.model, prefix + b)[-2:], rtol=1e-4, atol=1e-5)
    # and A's logits, recomputed while B sits in the cache, do not see B either
    see_a = torch.zeros(1, cm.length + 1, dtype=torch.bool)
    see_a[0, : p + 3] = True
    see_a[0, -1] = True
    got_a = cm.forward(torch.tensor([[14]]), positions=torch.tensor([p + 3]), attend=see_a).logits[0, -1]
    torch.testing.assert_close(got_a, _full_logits(lm.model, prefix + a + [14])[-1], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="attend has shape"):
        cm.forward(torch.tensor([[1, 2]]), attend=torch.ones(2, 5, dtype=torch.bool))


def test_device_buffers_of_a_batch_of_trees_are_each_trees_own():
    """:func:`device_buffers` over trees of one size and different shapes: each row's ancestor mask, children and
    slots are its tree's, and the batch's tree rule on them picks each row's path as the one-tree rule does."""
    from pardec.config import SamplingConfig
    from pardec.decoding.batch.verify import verify_trees
    from pardec.decoding.tree import device_buffers
    from pardec.decoding.verify import verify_tree

    shapes = [[-1, 0, 0, 1, 3], [-1, 0, 1, 2, 0], [-1, 0, 0, 0, 2]]  # a branch, a chain + a sibling, a fan
    labels = [[-1, 5, 6, 7, 8], [-1, 5, 7, 9, 6], [-1, 4, 5, 6, 7]]
    trees = [Tree.from_parents(p, lab) for p, lab in zip(shapes, labels)]
    parent = torch.tensor([[max(p, 0) for p in ps] for ps in shapes])
    depth = torch.stack([t.depth for t in trees])
    rank = torch.tensor([[0] + [t.children[p].index(i) for i, p in enumerate(ps) if i] for t, ps in zip(trees, shapes)])
    buf = device_buffers(parent, depth, rank, 3, 4)
    for b, t in enumerate(trees):
        assert torch.equal(buf.attend[b], t.attend)
        for node, kids in enumerate(t.children):
            assert buf.kids[b, node, buf.kid_ok[b, node]].tolist() == kids
    logits = torch.randn(3, 5, 10)
    for b in range(3):  # make row b accept its first child's path at every node
        for node, kids in enumerate(trees[b].children):
            if kids:
                logits[b, node, labels[b][kids[0]]] = 10.0
    greedy = SamplingConfig(temperature=0.0)
    got = verify_trees(buf, torch.tensor(labels), logits, greedy, None)
    for b, t in enumerate(trees):
        v = verify_tree(t, logits[b], greedy, None)
        assert got[b] == (v.path, v.tokens)
    assert [len(path) for path, _ in got] == [4, 4, 2]
