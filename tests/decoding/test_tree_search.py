"""Tree search for head/projection drafters: rank accuracies, greedy search (hand values and brute-force
optimality), expected acceptance, tree files (round trip, resolution by name/path/chain, every error)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding.tree import Tree
from pardec.decoding.tree_search import (
    available_trees,
    chain_paths,
    expected_accept_length,
    load_tree,
    rank_accuracies,
    resolve_tree,
    save_tree,
    search_tree,
    topk_accuracy,
    truncate_paths,
    validate_paths,
)

ACC = [[0.6, 0.2, 0.1], [0.5, 0.2], [0.4]]
# node values under ACC, for reference:
#   [0] .6  [1] .2  [2] .1
#   [0,0] .3  [0,1] .12  [1,0] .1  [1,1] .04  [2,0] .05  [2,1] .02
#   [0,0,0] .12  [0,1,0] .048  [1,0,0] .04  [1,1,0] .016  [2,0,0] .02  [2,1,0] .008


# ---------------------------------------------------------------------------------------------- accuracies
def _close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g == pytest.approx(w)


def test_rank_accuracies_counts_valid_rows_per_depth():
    ranks = torch.tensor(
        [
            [0, 1, 0],
            [0, 0, 5],  # 5 >= topk: not in the top-2
            [1, 3, 0],
            [2, 0, -1],  # -1 is fine where invalid
        ]
    )
    valid = torch.tensor(
        [
            [True, True, True],
            [True, True, True],
            [True, True, False],
            [True, False, False],
        ]
    )
    acc = rank_accuracies(ranks, topk=2, valid=valid)
    _close(acc, [[2 / 4, 1 / 4], [1 / 3, 1 / 3], [1 / 2, 0.0]])  # depth 2: ranks 1, 0, 3
    _close(topk_accuracy(acc), [[0.5, 0.75], [1 / 3, 2 / 3], [0.5, 0.5]])


def test_rank_accuracies_without_mask_and_empty_depth():
    ranks = torch.tensor([[0, 2], [1, 0], [0, 0], [4, 1]])
    _close(rank_accuracies(ranks, topk=3), [[0.5, 0.25, 0.0], [0.5, 0.25, 0.25]])
    valid = torch.tensor([[True, False]] * 4)
    assert rank_accuracies(ranks, topk=1, valid=valid) == [[0.5], [0.0]]


def test_rank_accuracies_errors():
    with pytest.raises(ValueError, match="ranks contains -1 at a valid entry"):
        rank_accuracies(torch.tensor([[0, -1]]), topk=2)
    with pytest.raises(ValueError, match="topk=0"):
        rank_accuracies(torch.tensor([[0]]), topk=0)
    with pytest.raises(ValueError, match="2-D"):
        rank_accuracies(torch.tensor([0, 1]), topk=2)
    with pytest.raises(ValueError, match="must match"):
        rank_accuracies(torch.tensor([[0, 1]]), topk=2, valid=torch.tensor([[True]]))


# ---------------------------------------------------------------------------------------------- search
@pytest.mark.parametrize(
    "budget, want",
    [
        (1, [[0]]),
        (2, [[0], [0, 0]]),
        (3, [[0], [1], [0, 0]]),
        (4, [[0], [1], [0, 0], [0, 1]]),  # [0,1] and [0,0,0] tie at .12: shallower first
        (5, [[0], [1], [0, 0], [0, 1], [0, 0, 0]]),
        (6, [[0], [1], [2], [0, 0], [0, 1], [0, 0, 0]]),  # [2] and [1,0] tie at .1: shallower first
        (7, [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
    ],
)
def test_search_tree_hand_values(budget, want):
    assert search_tree(ACC, budget) == want


def test_search_tree_full_tree_and_pick_order():
    full = search_tree(ACC, 100)
    assert len(full) == 3 + 6 + 6
    assert full == sorted(
        [list(p) for d in (1, 2, 3) for p in itertools.product(*[range(len(ACC[i])) for i in range(d)])],
        key=lambda p: (len(p), p),
    )
    # the 8th..15th picks, in order: .05, .048, then ties at .04 and .02 broken shallower-first
    prev = search_tree(ACC, 7)
    order = []
    for b in range(8, 16):
        cur = search_tree(ACC, b)
        (new,) = [p for p in cur if p not in prev]
        order.append(new)
        prev = cur
    assert order == [[2, 0], [0, 1, 0], [1, 1], [1, 0, 0], [2, 1], [2, 0, 0], [1, 1, 0], [2, 1, 0]]


def test_expected_accept_length_hand_value():
    assert expected_accept_length(ACC, search_tree(ACC, 5)) == pytest.approx(1 + 0.6 + 0.2 + 0.3 + 0.12 + 0.12)
    assert expected_accept_length(ACC, chain_paths(3)) == pytest.approx(1 + 0.6 + 0.3 + 0.12)
    with pytest.raises(ValueError, match=r"path \[0, 0, 0, 0\] has depth 4; acc covers depths 1..3"):
        expected_accept_length(ACC, [[0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"rank 2 at depth 2; acc covers ranks 0..1"):
        expected_accept_length(ACC, [[0, 2]])


def _all_nodes(acc):
    return [p for d in range(1, len(acc) + 1) for p in itertools.product(*[range(len(acc[i])) for i in range(d)])]


def _brute_force_best(acc, size):
    nodes = _all_nodes(acc)
    best = -1.0
    for subset in itertools.combinations(nodes, size):
        s = set(subset)
        if all(p[:-1] in s for p in subset if len(p) > 1):
            best = max(best, expected_accept_length(acc, [list(p) for p in subset]))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_search_tree_is_optimal_against_brute_force(seed):
    rng = random.Random(seed)
    depth = rng.choice([2, 3])
    widths = [1, 2, 3] if depth == 2 else [1, 2]
    acc = [[round(rng.random(), 2) for _ in range(rng.choice(widths))] for _ in range(depth)]
    n = len(_all_nodes(acc))
    for size in range(1, min(n, 5) + 1):
        got = search_tree(acc, size)
        assert len(got) == size
        validate_paths(got)  # prefix-closed, no duplicates
        assert expected_accept_length(acc, got) == pytest.approx(_brute_force_best(acc, size), abs=1e-9)


def test_search_tree_result_builds_a_tree():
    for budget in (1, 3, 5, 9, 15):
        paths = search_tree(ACC, budget)
        t = Tree.from_paths(paths)
        assert len(t) == budget + 1
        assert sorted(list(t.label_path(i)) for i in range(1, len(t))) == sorted(paths)
        assert t.max_depth == max(len(p) for p in paths)


def test_search_tree_errors():
    with pytest.raises(ValueError, match="budget=0 is not valid; it must be an int >= 1"):
        search_tree(ACC, 0)
    with pytest.raises(ValueError, match="acc is empty"):
        search_tree([], 3)
    with pytest.raises(ValueError, match=r"acc\[1\]\[0\]=1.5 is not valid; accuracies must lie in \[0, 1\]"):
        search_tree([[0.5], [1.5]], 3)
    with pytest.raises(ValueError, match=r"acc\[0\]\[0\]=-0.1"):
        expected_accept_length([[-0.1]], [[0]])
    with pytest.raises(ValueError, match=r"acc\[0\]\[0\]=nan"):
        search_tree([[float("nan")]], 1)


# ---------------------------------------------------------------------------------------------- paths
def test_chain_and_truncate():
    assert chain_paths(3) == [[0], [0, 0], [0, 0, 0]]
    paths = search_tree(ACC, 7)
    assert truncate_paths(paths, 2) == [[0], [1], [2], [0, 0], [0, 1], [1, 0]]
    assert truncate_paths(paths, 1) == [[0], [1], [2]]
    assert truncate_paths(paths, 0) == []
    assert truncate_paths(paths, 9) == paths
    with pytest.raises(ValueError, match="depth=0"):
        chain_paths(0)


def test_validate_paths_accepts_and_normalises():
    assert validate_paths(((0,), (0, 1), (1,))) == [[0], [0, 1], [1]]
    assert validate_paths([[1], [0], [0, 0]], max_depth=2) == [[1], [0], [0, 0]]


@pytest.mark.parametrize(
    "paths, max_depth, message",
    [
        ([], None, "T: paths=[] is not valid; it must be a non-empty list of rank lists"),
        ("abc", None, "T: paths='abc' is not valid"),
        ([[0], []], None, "T: path [] is not valid; each path must be a non-empty list of ranks"),
        ([[0], [0, -1]], None, "T: path [0, -1] has rank -1; ranks must be non-negative integers"),
        ([[0], [0.5]], None, "T: path [0.5] has rank 0.5"),
        ([[0], [1], [0]], None, "T: path [0] is listed twice; each node must appear once"),
        ([[0], [0, 1, 2], [0, 1]], None, None),  # closed, order-free: no error
        ([[0], [0, 0, 0]], None, "T: path [0, 0, 0] has no parent [0, 0] in the list"),
        ([[1, 0]], None, "T: path [1, 0] has no parent [1] in the list"),
        (chain_paths(5), 3, "T: tree depth 5 (path [0, 0, 0, 0, 0]) exceeds the drafter's 3 heads"),
    ],
)
def test_validate_paths_errors(paths, max_depth, message):
    if message is None:
        validate_paths(paths, max_depth, where="T")
        return
    with pytest.raises(ConfigError) as e:
        validate_paths(paths, max_depth, where="T")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------------- files
def test_save_load_round_trip(tmp_path):
    paths = search_tree(ACC, 5)
    f = save_tree(tmp_path / "sub" / "dir" / "T5.json", "T5", paths, acc=ACC, source={"drafter": "medusa", "n": 3})
    assert f == tmp_path / "sub" / "dir" / "T5.json" and f.is_file()
    assert [p.name for p in f.parent.iterdir()] == ["T5.json"]  # no temp file left behind
    doc = json.loads(f.read_text())
    assert doc["format"] == "pardec-tree" and doc["version"] == 1 and doc["name"] == "T5"
    assert doc["paths"] == paths and doc["accuracies"] == ACC
    assert doc["expected_accept_length"] == pytest.approx(2.34)
    assert doc["source"] == {"drafter": "medusa", "n": 3}
    tf = load_tree(f, max_depth=3)
    assert (tf.name, tf.paths, tf.accuracies, tf.source) == ("T5", paths, ACC, {"drafter": "medusa", "n": 3})
    assert tf.expected_accept_length == pytest.approx(2.34)
    # overwrite in place, without accuracies
    save_tree(f, "T5", [[0]])
    doc = json.loads(f.read_text())
    assert doc["paths"] == [[0]] and doc["accuracies"] is None and doc["expected_accept_length"] is None
    with pytest.raises(ConfigError, match="has no parent"):
        save_tree(tmp_path / "bad.json", "bad", [[0, 0]])
    assert not (tmp_path / "bad.json").exists()


@pytest.fixture
def tree_dirs(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    save_tree(a / "T16.json", "T16", search_tree(ACC, 15), ACC)
    save_tree(a / "T63.json", "T63", chain_paths(2))
    save_tree(b / "T32.json", "T32", search_tree(ACC, 4))
    save_tree(b / "T16.json", "T16-other", [[0]])  # shadowed by a/T16.json
    return [a, b, tmp_path / "missing"]


def test_resolve_tree_chain_name_and_path(tree_dirs, tmp_path):
    assert resolve_tree("chain", tree_dirs, 4) == ("chain", chain_paths(4))
    assert resolve_tree("T16", tree_dirs, 3) == ("T16", search_tree(ACC, 15))  # first folder wins
    assert resolve_tree("T32", tree_dirs, 3) == ("T32", search_tree(ACC, 4))
    assert resolve_tree(str(tree_dirs[1] / "T16.json"), tree_dirs, 3) == ("T16-other", [[0]])
    assert available_trees(tree_dirs) == ["T16", "T32", "T63"]
    # a file without a name is named after itself
    f = tmp_path / "anon.json"
    f.write_text(json.dumps({"format": "pardec-tree", "version": 1, "paths": [[0], [1]]}))
    assert resolve_tree(str(f), [], 1) == ("anon", [[0], [1]])


def test_resolve_tree_unknown_name_lists_available(tree_dirs):
    with pytest.raises(ConfigError) as e:
        resolve_tree("T99", tree_dirs, 3)
    msg = str(e.value)
    assert msg.startswith("method.tree='T99' is not a tree file or a known name; choose chain, a JSON file, or ")
    assert "one of: T16, T32, T63 (in " in msg and str(tree_dirs[0]) in msg and "\n" not in msg
    with pytest.raises(ConfigError, match="a name \\(none found\\)"):
        resolve_tree("T99", [], 3)


def test_resolve_tree_too_deep_is_an_error(tree_dirs):
    with pytest.raises(ConfigError, match=r"T16.json: tree depth 3 \(path \[0, 0, 0\]\) exceeds the drafter's 2 heads"):
        resolve_tree("T16", tree_dirs, 2)
    assert resolve_tree("T63", tree_dirs, 2) == ("T63", [[0], [0, 0]])


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a valid JSON tree file"),
        ("[1, 2]", "a tree file must hold a JSON object, found list"),
        (json.dumps({"format": "medusa", "version": 1, "paths": [[0]]}), "format='medusa' is not a tree file"),
        (json.dumps({"version": 1, "paths": [[0]]}), "format=None is not a tree file; expected format='pardec-tree'"),
        (json.dumps({"format": "pardec-tree", "version": 2, "paths": [[0]]}), "version=2 is not supported"),
        (json.dumps({"format": "pardec-tree", "version": True, "paths": [[0]]}), "version=True is not supported"),
        (json.dumps({"format": "pardec-tree", "version": 1, "paths": []}), "paths=[] is not valid"),
        (json.dumps({"format": "pardec-tree", "version": 1}), "paths=None is not valid"),
        (json.dumps({"format": "pardec-tree", "version": 1, "paths": [[0], [0]]}), "path [0] is listed twice"),
        (json.dumps({"format": "pardec-tree", "version": 1, "paths": [[0], [-2]]}), "path [-2] has rank -2"),
        (json.dumps({"format": "pardec-tree", "version": 1, "paths": [[0, 1]]}), "path [0, 1] has no parent [0]"),
    ],
)
def test_load_errors_name_the_file(tmp_path, content, message):
    f = tmp_path / "bad.json"
    f.write_text(content)
    for spec, dirs in ((str(f), []), ("bad", [tmp_path])):
        with pytest.raises(ConfigError) as e:
            resolve_tree(spec, dirs, 3)
        assert str(e.value).startswith(f"{f}: ")
        assert message in str(e.value)
        assert "\n" not in str(e.value)
