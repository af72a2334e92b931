"""Static draft trees for head/projection drafters (Medusa heads, FIRP): measure, search, save, load.

Such a drafter proposes, for each depth ``d = 1..K`` ahead of the last committed token, a ranked candidate
list (the top-k of a distribution). A tree over those candidates is written as *paths of ranks* (Medusa's
"choices"): path ``(r1, ..., rd)`` is the node at depth ``d`` whose token is the ``r_d``-th ranked candidate of
depth ``d``, a child of node ``(r1, ..., r_{d-1})``. The root (depth 0, the last committed token) is implicit
and never listed. E.g. ``[[0], [1], [0, 0], [0, 1], [0, 0, 0]]``; :meth:`pardec.decoding.tree.Tree.from_paths`
turns such a list into a :class:`~pardec.decoding.tree.Tree`.

The pipeline:

1. :func:`rank_accuracies`: from held-out ranks of the true token, ``acc[d][r]`` = how often the true token at
   depth ``d + 1`` is the drafter's rank-``r`` candidate (:func:`topk_accuracy` gives the cumulative view).
2. :func:`search_tree`: Medusa's greedy search for the tree of ``budget`` nodes with the highest expected
   acceptance; :func:`expected_accept_length` scores any tree under the same model.
3. :func:`save_tree` / :func:`load_tree` / :func:`resolve_tree`: small versioned JSON files::

       {"format": "pardec-tree", "version": 1, "name": "T16", "paths": [[0], ...],
        "expected_accept_length": 2.3, "accuracies": [[...], ...] or null, "source": {...free-form...}}

   :func:`resolve_tree` maps a config value (``chain``, a file, or a name found in search folders) to paths,
   checked with :func:`validate_paths` against the drafter's depth.
"""

from __future__ import annotations

import heapq
import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pardec.config import ConfigError
from pardec.decoding.tree import Tree

TREE_FORMAT = "pardec-tree"
TREE_VERSION = 1


# ---------------------------------------------------------------------------------------------- accuracies
def rank_accuracies(ranks: torch.Tensor, topk: int, valid: torch.Tensor | None = None) -> list[list[float]]:
    """Per-depth, per-rank accuracy of a drafter on held-out positions.

    Args:
        ranks: [N, K] integer tensor: at each of N positions, the 0-based rank of the true token among the
            drafter's candidates for each of the K depths (a rank ``>= topk`` means "not in the top-k").
        topk: how many ranks to report per depth (>= 1).
        valid: optional [N, K] bool tensor; False marks entries with no true token (positions near the end of
            a sequence have none at deeper depths). Those entries are ignored.

    Returns:
        ``acc`` with ``acc[d][r]`` = fraction of the valid rows at depth ``d + 1`` whose true token has rank
        ``r``, for ``r < topk``. A depth without any valid row gets all zeros.
    """
    if not isinstance(ranks, torch.Tensor) or ranks.dim() != 2:
        shape = tuple(ranks.shape) if isinstance(ranks, torch.Tensor) else type(ranks).__name__
        raise ValueError(f"ranks must be a 2-D [N, K] tensor, got {shape}")
    if ranks.dtype.is_floating_point or ranks.dtype == torch.bool:
        raise ValueError(f"ranks must be an integer tensor, got dtype {ranks.dtype}")
    if isinstance(topk, bool) or not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r} is not valid; it must be an int >= 1")
    if valid is None:
        valid = torch.ones_like(ranks, dtype=torch.bool)
    elif tuple(valid.shape) != tuple(ranks.shape):
        raise ValueError(f"valid has shape {tuple(valid.shape)}; it must match ranks' {tuple(ranks.shape)}")
    valid = valid.to(device=ranks.device, dtype=torch.bool)
    ranks = ranks.long()
    if bool(((ranks < 0) & valid).any()):
        bad = int(ranks[(ranks < 0) & valid].min())
        raise ValueError(f"ranks contains {bad} at a valid entry; ranks must be >= 0 (mark missing entries in valid)")
    acc: list[list[float]] = []
    for d in range(ranks.shape[1]):
        col = ranks[:, d][valid[:, d]]
        n = col.numel()
        if n == 0:
            acc.append([0.0] * topk)
            continue
        counts = torch.bincount(col.clamp(max=topk), minlength=topk + 1)[:topk]
        acc.append([float(c) / n for c in counts.tolist()])
    return acc


def topk_accuracy(acc: list[list[float]]) -> list[list[float]]:
    """Cumulative accuracies: ``out[d][r]`` = top-(r+1) accuracy at depth ``d + 1`` (the sum of ``acc[d][:r+1]``)."""
    out = []
    for row in acc:
        total, cum = 0.0, []
        for a in row:
            total += float(a)
            cum.append(total)
        out.append(cum)
    return out


# ---------------------------------------------------------------------------------------------- search
def _check_acc(acc: list[list[float]]) -> list[list[float]]:
    """``acc`` as floats, or ValueError for an empty table, an empty depth, or a value outside [0, 1]."""
    if not acc:
        raise ValueError("acc is empty; it needs one row of rank accuracies per drafted depth (>= 1 row)")
    out = []
    for d, row in enumerate(acc):
        if len(row) == 0:
            raise ValueError(f"acc[{d}] is empty; every depth needs >= 1 rank accuracy")
        vals = [float(a) for a in row]
        for r, a in enumerate(vals):
            if not 0.0 <= a <= 1.0:  # also rejects NaN
                raise ValueError(f"acc[{d}][{r}]={a!r} is not valid; accuracies must lie in [0, 1]")
        out.append(vals)
    return out


def _path_value(acc: list[list[float]], path: list[int] | tuple[int, ...]) -> float:
    v = 1.0
    for d, r in enumerate(path):
        v *= acc[d][r]
    return v


def search_tree(acc: list[list[float]], budget: int) -> list[list[int]]:
    """The tree of at most ``budget`` nodes (root excluded) with the highest expected acceptance (Medusa's search).

    A node with path ``(r1, ..., rd)`` has value ``prod_{i<=d} acc[i-1][r_i]``: the chance that the whole path
    is correct, assuming the depths are independent. Starting from the empty tree, the frontier holds the
    children of the root and of every chosen node (ranks ``0..len(acc[d])-1`` at each depth ``d < len(acc)``);
    the frontier node of highest value is chosen (ties: shallower first, then the lexicographically smaller
    path; values are compared rounded to 12 decimals so float noise does not break ties) until ``budget``
    nodes are chosen or the frontier is empty. As a child's value never exceeds its parent's, the result is
    the best prefix-closed set of that size, i.e. the best subtree.

    Returns:
        The chosen paths sorted by (depth, path); fewer than ``budget`` when the full tree is smaller.
    """
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} is not valid; it must be an int >= 1")
    acc = _check_acc(acc)
    # heap entries: (-value, depth, path, exact value)
    frontier: list[tuple[float, int, tuple[int, ...], float]] = []

    def push_children(parent: tuple[int, ...], value: float) -> None:
        d = len(parent)
        if d >= len(acc):
            return
        for r, a in enumerate(acc[d]):
            v = value * a
            heapq.heappush(frontier, (-round(v, 12), d + 1, (*parent, r), v))

    push_children((), 1.0)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < budget:
        _, _, path, v = heapq.heappop(frontier)
        chosen.append(path)
        push_children(path, v)
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


def expected_accept_length(acc: list[list[float]], paths: list[list[int]]) -> float:
    """Tokens committed per step under ``acc``'s independence model: 1 (the target's own token) plus the sum of
    the values of ``paths`` (each node is accepted with the chance its whole path is correct)."""
    acc = _check_acc(acc)
    total = 1.0
    for path in paths:
        if len(path) > len(acc):
            raise ValueError(f"path {list(path)} has depth {len(path)}; acc covers depths 1..{len(acc)}")
        for d, r in enumerate(path):
            if not 0 <= r < len(acc[d]):
                raise ValueError(
                    f"path {list(path)} uses rank {r} at depth {d + 1}; acc covers ranks 0..{len(acc[d]) - 1} there"
                )
        total += _path_value(acc, path)
    return total


# ---------------------------------------------------------------------------------------------- paths
def _short(value: Any, limit: int = 80) -> str:
    s = repr(value)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def validate_paths(paths: Any, max_depth: int | None = None, where: str = "tree") -> list[list[int]]:
    """Check a tree's rank paths and return them as lists of ints, or raise :class:`ConfigError`.

    Valid: a non-empty list of non-empty lists of non-negative ints, without duplicates, prefix-closed (every
    proper prefix of a path is listed too), and no deeper than ``max_depth`` when given. Errors are one line
    naming ``where``, the bad value and what is valid.
    """
    if not isinstance(paths, (list, tuple)) or len(paths) == 0:
        raise ConfigError(f"{where}: paths={_short(paths)} is not valid; it must be a non-empty list of rank lists")
    out: list[list[int]] = []
    for p in paths:
        if not isinstance(p, (list, tuple)) or len(p) == 0:
            raise ConfigError(f"{where}: path {_short(p)} is not valid; each path must be a non-empty list of ranks")
        for r in p:
            if isinstance(r, bool) or not isinstance(r, int) or r < 0:
                raise ConfigError(
                    f"{where}: path {_short(list(p))} has rank {r!r}; ranks must be non-negative integers"
                )
        out.append([int(r) for r in p])
    seen: set[tuple[int, ...]] = set()
    for p in out:
        if tuple(p) in seen:
            raise ConfigError(f"{where}: path {p} is listed twice; each node must appear once")
        seen.add(tuple(p))
    for p in out:
        if len(p) > 1 and tuple(p[:-1]) not in seen:
            raise ConfigError(
                f"{where}: path {p} has no parent {p[:-1]} in the list; every proper prefix of a path must be listed"
            )
    if max_depth is not None:
        deepest = max(out, key=len)
        if len(deepest) > max_depth:
            raise ConfigError(
                f"{where}: tree depth {len(deepest)} (path {deepest}) exceeds the drafter's {max_depth} heads; "
                f"use a tree of depth <= {max_depth}"
            )
    return out


def chain_paths(depth: int) -> list[list[int]]:
    """The single chain of top-1 candidates: ``[[0], [0, 0], ...]`` with ``depth`` nodes."""
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r} is not valid; a chain needs depth >= 1")
    return [[0] * d for d in range(1, depth + 1)]


def truncate_paths(paths: list[list[int]], depth: int) -> list[list[int]]:
    """The paths of length <= ``depth`` (still prefix-closed), e.g. when fewer tokens remain to generate."""
    if depth < 0:
        raise ValueError(f"depth={depth!r} is not valid; it must be >= 0")
    return [list(p) for p in paths if len(p) <= depth]


# ---------------------------------------------------------------------------------------------- files
@dataclass
class TreeFile:
    """A loaded tree file (paths already validated)."""

    name: str
    paths: list[list[int]]
    path: Path
    expected_accept_length: float | None = None
    accuracies: list[list[float]] | None = None
    source: dict = field(default_factory=dict)


def _dumps_tree(doc: dict) -> str:
    """JSON with one key per line and one path (or accuracy row) per line: readable and diff-friendly."""
    lines = []
    for i, (k, v) in enumerate(doc.items()):
        comma = "," if i < len(doc) - 1 else ""
        if isinstance(v, list) and v and all(isinstance(x, list) for x in v):
            rows = ",\n".join("    " + json.dumps(x) for x in v)
            lines.append(f"  {json.dumps(k)}: [\n{rows}\n  ]{comma}")
        else:
            lines.append(f"  {json.dumps(k)}: {json.dumps(v)}{comma}")
    return "{\n" + "\n".join(lines) + "\n}\n"


def save_tree(
    path: str | Path,
    name: str,
    paths: list[list[int]],
    acc: list[list[float]] | None = None,
    source: dict | None = None,
) -> Path:
    """Write a tree file (see the module docstring) atomically; returns its path.

    ``paths`` are validated first (:class:`ConfigError` if bad). With ``acc``, the file records the accuracies
    and the tree's :func:`expected_accept_length` under them; without, both are null. Parent folders are
    created; the file is written to a temporary sibling and moved into place with ``os.replace``.
    """
    path = Path(path)
    checked = validate_paths(paths, where=str(path))
    acc_f = _check_acc(acc) if acc is not None else None
    doc = {
        "format": TREE_FORMAT,
        "version": TREE_VERSION,
        "name": str(name),
        "paths": checked,
        "expected_accept_length": expected_accept_length(acc_f, checked) if acc_f is not None else None,
        "accuracies": acc_f,
        "source": dict(source) if source else {},
    }
    text = _dumps_tree(doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return path


def load_tree(path: str | Path, max_depth: int | None = None) -> TreeFile:
    """Read and check a tree file: valid JSON, ``format == "pardec-tree"``, ``version == 1``, valid paths no deeper
    than ``max_depth`` (when given). Raises :class:`ConfigError` naming the file otherwise."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read tree file ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not a valid JSON tree file ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: a tree file must hold a JSON object, found {type(doc).__name__}")
    fmt = doc.get("format")
    if fmt != TREE_FORMAT:
        raise ConfigError(f"{path}: format={_short(fmt)} is not a tree file; expected format={TREE_FORMAT!r}")
    version = doc.get("version")
    if isinstance(version, bool) or version != TREE_VERSION:
        raise ConfigError(f"{path}: tree file version={_short(version)} is not supported; this reader needs version 1")
    paths = validate_paths(doc.get("paths"), max_depth, where=str(path))
    name = doc.get("name")
    eal = doc.get("expected_accept_length")
    source = doc.get("source")
    return TreeFile(
        name=name if isinstance(name, str) and name else path.stem,
        paths=paths,
        path=path,
        expected_accept_length=float(eal) if isinstance(eal, (int, float)) and not isinstance(eal, bool) else None,
        accuracies=doc.get("accuracies"),
        source=source if isinstance(source, dict) else {},
    )


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def available_trees(search_dirs: list[Path]) -> list[str]:
    """The ``*.json`` stems in ``search_dirs`` (missing folders skipped), deduplicated, in natural order."""
    names: set[str] = set()
    for d in search_dirs:
        d = Path(d)
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.json") if p.is_file())
    return sorted(names, key=_natural_key)


def resolve_tree(
    spec: str, search_dirs: list[Path], max_depth: int, *, key: str = "method.tree"
) -> tuple[str, list[list[int]]]:
    """Map a tree spec to ``(name, paths)``.

    ``"chain"`` gives ``("chain", chain_paths(max_depth))``; an existing file path is loaded; otherwise the first
    ``<dir>/<spec>.json`` among ``search_dirs`` is loaded. Loaded trees must be valid and no deeper than
    ``max_depth`` (the drafter's heads; a deeper tree is an error, not truncated). An unknown spec raises
    :class:`ConfigError` listing the names found (``key`` is the config key named in that message).
    """
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 1:
        raise ValueError(f"max_depth={max_depth!r} is not valid; the drafter needs >= 1 head")
    spec = str(spec)
    if spec == "chain":
        return "chain", chain_paths(max_depth)
    if spec and Path(spec).is_file():
        tf = load_tree(spec, max_depth)
        return tf.name, tf.paths
    if spec and "/" not in spec and os.sep not in spec:
        for d in search_dirs:
            f = Path(d) / f"{spec}.json"
            if f.is_file():
                tf = load_tree(f, max_depth)
                return tf.name, tf.paths
    names = available_trees(search_dirs)
    dirs = ", ".join(str(d) for d in search_dirs) or "no search folders"
    choices = f"one of: {', '.join(names)}" if names else "a name (none found)"
    raise ConfigError(
        f"{key}={spec!r} is not a tree file or a known name; choose chain, a JSON file, or {choices} (in {dirs})"
    )


# ---------------------------------------------------------------------------------------------- candidates
class RankTree:
    """A static tree of rank ``paths`` over K ranked candidate lists (Medusa's heads, FIRP's projections, DFlash's
    slots) and, each step, the tree of tokens it makes of K distributions: path ``(r1, ..., rd)``'s node holds the
    ``r_d``-th ranked token of distribution ``d``."""

    def __init__(self, paths: list[list[int]]):
        self.paths = paths
        self._cut: dict[tuple[int, torch.device], tuple[Tree, torch.Tensor, int]] = {}

    def cut(self, depth: int, device: torch.device | str) -> tuple[Tree, torch.Tensor, int]:
        """The rank tree cut to ``depth`` (built once per depth and device: its device buffers too, shared by every
        step's relabelled tree), the (depth - 1, rank) of each non-root node [2, N-1] on ``device``, the ranks
        needed."""
        key = (depth, torch.device(device))
        if key not in self._cut:
            ranks = Tree.from_paths(truncate_paths(self.paths, depth))
            at = torch.tensor([[int(d) - 1 for d in ranks.depth[1:]], ranks.labels[1:]], dtype=torch.long)
            self._cut[key] = (ranks, at.to(device), max(ranks.labels[1:], default=-1) + 1)
        return self._cut[key]

    def candidates(self, drafts: torch.Tensor, depth: int, to_target=None) -> Tree:
        """The tree of top-ranked tokens of ``drafts`` [K, V] (cut to ``depth``), its labels a [N] tensor on the
        drafts' device (nothing read back: siblings hold distinct ranks of one distribution, hence distinct
        tokens). ``to_target``: maps the drafts' ids to the target's (a reduced draft vocabulary)."""
        ranks, at, need = self.cut(depth, drafts.device)
        if len(ranks) == 1:
            return ranks
        top = drafts[: max(1, depth)].topk(min(need, drafts.shape[-1]), dim=-1).indices  # [depth, need]
        if to_target is not None:
            top = to_target(top)
        return ranks.relabel(torch.cat([top.new_full((1,), -1), top[at[0], at[1]]]))
