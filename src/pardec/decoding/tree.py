"""Draft shapes: a :class:`Tree` of candidate continuations (a chain is the degenerate tree).

Node 0 is the root: the last committed token, whose KV is not cached yet. Every other node is a drafted
token with a parent. One target forward over all nodes (in node order) with

* ``tree.attend``                 [N, N] bool: node i sees node j iff j is i or an ancestor of i,
* ``tree.positions(base)``        [N]: ``base + depth`` (siblings share a position),

gives, at node i, the target's distribution for a child of i. Verification (:mod:`pardec.decoding.verify`)
walks down from the root; the cache then keeps exactly the accepted path (``CachedModel.keep(path)``).

Built from

* ``Tree.chain(tokens)``: a single draft,
* ``Tree.from_paths(paths)``: root-to-leaf label sequences (tokens, or Medusa's top-k ranks as "choices"):
  shared prefixes become shared nodes (a trie), so siblings always carry distinct labels,
* ``Tree.from_parents(parents, labels)``: explicit structure (parents before children),
* ``tree.relabel(labels)``: the same shape with other labels, e.g. a [N] tensor of tokens on the device
  (Medusa / FIRP: the rank tree's top-k tokens, never read back before verification).

``tree.paths`` are the root-to-leaf node-index lists (Medusa's "retrieve indices").

Buffers: the structure of a shape (children, depth, ancestor mask) is computed once per parent tuple (a
process-wide LRU of CPU data). Its device copies (:meth:`Tree.on`: mask, depths, parents and the padded
children matrix that verification reads) are made once per tree *object* and device, and shared by every
:meth:`~Tree.relabel` of it: a decoder whose tree shape is fixed (Medusa, FIRP) keeps its rank tree and relabels
it each step, so the device buffers are built once per shape and device. (The device cache is not process-wide
on purpose: its tensors belong to the run that made them.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch

from pardec.models.cached import to_device


@dataclass(frozen=True)
class _Structure:
    """What a parent tuple determines, on the CPU (shared, read-only)."""

    children: list[list[int]]
    depth: torch.Tensor  # [N] long
    attend: torch.Tensor  # [N, N] bool
    inner: list[int]  # nodes with children, in node order
    rank: list[int]  # each node's index among its siblings (root 0)


@functools.lru_cache(maxsize=1024)
def _structure(parents: tuple[int, ...]) -> _Structure:
    n = len(parents)
    children: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    rank = [0] * n
    attend = torch.zeros(n, n, dtype=torch.bool)
    attend[0, 0] = True
    for i in range(1, n):
        p = parents[i]
        if not 0 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come before their children")
        rank[i] = len(children[p])
        children[p].append(i)
        depth[i] = depth[p] + 1
        attend[i] = attend[p]
        attend[i, i] = True
    inner = [i for i in range(n) if children[i]]
    return _Structure(children, torch.tensor(depth, dtype=torch.long), attend, inner, rank)


@dataclass(frozen=True)
class TreeBuffers:
    """A tree shape's index tensors on one device (:meth:`Tree.on`). ``I`` nodes have children, at most ``C``."""

    attend: torch.Tensor  # [N, N] bool ancestor-or-self mask
    depth: torch.Tensor  # [N] long
    parent: torch.Tensor  # [N] long, the root's parent given as 0
    inner: torch.Tensor  # [I] long: the nodes with children, in node order
    kids: torch.Tensor  # [I, C] long: their children in order, padded with 0
    kid_ok: torch.Tensor  # [I, C] bool: False on the padding
    row: torch.Tensor  # [N] long: a node's row in ``inner`` (-1: a leaf)
    slot: torch.Tensor  # [N, 2] long: (row of the node's parent, the node's rank among its siblings); root (0, 0)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TreeBuffers:
        """The same buffers, each through ``fn`` (one tree's of a batch's, or one shape's seen per row)."""
        return TreeBuffers(*(fn(getattr(self, f.name)) for f in fields(self)))


def _buffers(parents: list[int], st: _Structure, device: torch.device) -> TreeBuffers:
    """Every buffer built on the CPU and moved in one copy."""
    n, inner = len(parents), st.inner
    width = max((len(st.children[i]) for i in inner), default=0)
    kids = [st.children[i] + [0] * (width - len(st.children[i])) for i in inner]
    ok = [[1] * len(st.children[i]) + [0] * (width - len(st.children[i])) for i in inner]
    row = [-1] * n
    for r, i in enumerate(inner):
        row[i] = r
    slot = [(row[max(p, 0)] if p >= 0 else 0, st.rank[i]) for i, p in enumerate(parents)]
    parts = [st.attend.long().reshape(-1), st.depth, torch.tensor([max(p, 0) for p in parents]),
             torch.tensor(inner, dtype=torch.long), torch.tensor(kids, dtype=torch.long).reshape(-1),
             torch.tensor(ok, dtype=torch.long).reshape(-1), torch.tensor(row), torch.tensor(slot).reshape(-1)]
    flat = to_device(torch.cat([p.to(torch.long) for p in parts]), device)
    sizes = [p.numel() for p in parts]
    a, d, par, inn, k, o, r, s = torch.split(flat, sizes)
    i = len(inner)
    return TreeBuffers(a.reshape(n, n).bool(), d, par, inn, k.reshape(i, width), o.reshape(i, width).bool(), r,
                       s.reshape(n, 2))


class Tree:
    """``parents`` [N] (``parents[0] == -1``: the root) and ``labels`` [N] (a token id, or a rank for structure-only
    trees; ``labels[0]`` unused, -1): a list of ints, or a [N] long tensor (on any device) whose siblings the caller
    guarantees distinct."""

    def __init__(self, parents: list[int], labels: list[int] | torch.Tensor,
                 _shared: tuple[_Structure, dict] | None = None):
        self.parents = list(parents)
        n = len(self.parents)
        if n == 0 or self.parents[0] != -1 or len(labels) != n:
            raise ValueError("a tree needs a root (parents[0] == -1) and one label per node")
        st, self._on = _shared if _shared is not None else (_structure(tuple(self.parents)), {})
        self._st = st
        self.labels = labels if isinstance(labels, torch.Tensor) else list(labels)
        if not isinstance(labels, torch.Tensor):
            for p in st.inner:
                kids = st.children[p]
                if len({self.labels[c] for c in kids}) < len(kids):
                    i = next(c for j, c in enumerate(kids) if self.labels[c] in {self.labels[x] for x in kids[:j]})
                    raise ValueError(f"node {i} repeats label {self.labels[i]} among the children of node {p}")
        self._labels_on: dict[torch.device, torch.Tensor] = {}

    # ------------------------------------------------------------------ builders
    @classmethod
    def chain(cls, tokens: list[int] | torch.Tensor) -> Tree:
        toks = torch.as_tensor(tokens).tolist() if not isinstance(tokens, list) else tokens
        return cls([-1] + list(range(len(toks))), [-1] + [int(t) for t in toks])

    @classmethod
    def from_paths(cls, paths: list[list[int]]) -> Tree:
        """A trie of label sequences, in first-seen order (each path's nodes follow their parent)."""
        parents, labels = [-1], [-1]
        index: dict[tuple[int, ...], int] = {(): 0}
        for path in paths:
            for d in range(len(path)):
                key = tuple(int(x) for x in path[: d + 1])
                if key not in index:
                    index[key] = len(parents)
                    parents.append(index[key[:-1]])
                    labels.append(key[-1])
        return cls(parents, labels)

    @classmethod
    def from_parents(cls, parents: list[int], labels: list[int]) -> Tree:
        return cls(list(parents), list(labels))

    def relabel(self, labels: list[int] | torch.Tensor) -> Tree:
        """The same shape with other labels, sharing this tree's structure and device buffers."""
        return Tree(self.parents, labels, _shared=(self._st, self._on))

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.parents)

    @property
    def children(self) -> list[list[int]]:
        """Child node indices per node, in order (shared by trees of one shape: read-only)."""
        return self._st.children

    @property
    def depth(self) -> torch.Tensor:
        """[N] long on the CPU, root 0."""
        return self._st.depth

    @property
    def attend(self) -> torch.Tensor:
        """[N, N] bool ancestor-or-self mask on the CPU (:meth:`on` for a device's copy)."""
        return self._st.attend

    def on(self, device: torch.device | str) -> TreeBuffers:
        """This shape's buffers on ``device``, built on first use and kept (shared with :meth:`relabel` trees)."""
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = _buffers(self.parents, self._st, device)
        return self._on[device]

    def label_tensor(self, device: torch.device | str) -> torch.Tensor:
        """[N] long labels on ``device`` (the root's is -1 or unused); one copy per tree and device."""
        device = torch.device(device)
        if device not in self._labels_on:
            labels = self.labels if isinstance(self.labels, torch.Tensor) else torch.tensor(self.labels)
            self._labels_on[device] = to_device(labels.to(torch.long), device)
        return self._labels_on[device]

    def positions(self, base: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[N] absolute positions when the root sits at ``base`` (on the CPU, or on ``device`` from its buffers)."""
        return (self.depth if device is None else self.on(device).depth) + base

    def tokens(self, root_token: int, device: torch.device | str | None = None) -> torch.Tensor:
        """[N] the forward's input: the root's token, then every node's label (on the CPU, or on ``device``)."""
        if device is None and not isinstance(self.labels, torch.Tensor):
            return torch.tensor([int(root_token)] + self.labels[1:], dtype=torch.long)
        labels = self.label_tensor(device if device is not None else self.labels.device)
        return torch.cat([torch.full((1,), int(root_token), dtype=torch.long, device=labels.device), labels[1:]])

    @property
    def paths(self) -> list[list[int]]:
        """Root-to-leaf node indices, one list per leaf (the root included)."""
        out = []
        for i in range(len(self)):
            if not self.children[i] and i:
                path = [i]
                while self.parents[path[-1]] > 0:
                    path.append(self.parents[path[-1]])
                out.append([0] + path[::-1])
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to ``node``, both included."""
        path = [node]
        while path[-1] != 0:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def label_path(self, node: int) -> tuple[int, ...]:
        """The labels from the root's child down to ``node`` (empty for the root): the node's drafted prefix."""
        return tuple(int(self.labels[n]) for n in self.path_to(node)[1:])

    @property
    def inner(self) -> list[int]:
        """Nodes with children, in node order (the rows of :attr:`TreeBuffers.inner`)."""
        return self._st.inner

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())


class DeviceTree:
    """A tree whose structure exists only on the device: made each step from device tensors (EAGLE-2's dynamic
    tree: which candidates survive is decided on the device), so building it reads nothing back. It offers what
    drafting and verification use of a :class:`Tree` (``len``, ``labels``, :meth:`on`, :meth:`label_tensor`,
    :meth:`positions`, :meth:`tokens`) with every buffer made on the device at once; its children are deterministic
    candidates (no draft distribution ``q`` for :func:`~pardec.decoding.verify.verify_tree`).

    ``parent`` [N] long (node indices, parents before children; the root's given as 0), ``depth`` [N] long,
    ``rank`` [N] long (a node's index among its parent's children slots, ``< width``; siblings distinct, gaps
    allowed), ``labels`` [N] long (siblings distinct; the root's unused). ``max_depth``: a bound on the depth
    (the ancestor mask takes that many gathers)."""

    def __init__(self, parent: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, labels: torch.Tensor,
                 width: int, max_depth: int):
        self.labels, self._n = labels, parent.numel()
        rows = device_buffers(parent[None], depth[None], rank[None], width, max_depth)
        self._buf = rows.map(lambda t: t[0])
        self.max_depth = max_depth  # (a bound: the tree may be shallower)

    def __len__(self) -> int:
        return self._n

    @property
    def children(self) -> list[list[int]]:
        """Child node indices per node, read back from the device (for instrumentation and tests: it costs a host
        read, which no decoding path makes)."""
        parent = self._buf.parent.tolist()
        kids: list[list[int]] = [[] for _ in parent]
        for i in range(1, len(parent)):
            kids[parent[i]].append(i)
        return kids

    def on(self, device: torch.device | str) -> TreeBuffers:
        if torch.device(device) != self._buf.parent.device:
            raise ValueError(f"a tree built on {self._buf.parent.device} is used on {device}")
        return self._buf

    def label_tensor(self, device: torch.device | str) -> torch.Tensor:
        return self.labels

    def positions(self, base: int, device: torch.device | str | None = None) -> torch.Tensor:
        return self._buf.depth + base

    def tokens(self, root_token: int, device: torch.device | str | None = None) -> torch.Tensor:
        return torch.cat([self.labels.new_full((1,), int(root_token)), self.labels[1:]])


def device_buffers(parent: torch.Tensor, depth: torch.Tensor, rank: torch.Tensor, width: int, max_depth: int
                   ) -> TreeBuffers:
    """The buffers of ``n`` trees of ``N`` nodes each, made on their device from [n, N] long tensors (``parent``:
    parents before children, the root's given as 0; ``depth``; ``rank``: a node's slot among its parent's children,
    ``< width``, siblings distinct) without a host read: every field with a leading row dimension ([n, N, N] mask,
    [n, N, width] children). Every node is a row of ``inner`` (a leaf's row has no valid child), so the shapes need
    no host count; ``max_depth`` bounds the depth (the ancestor mask takes that many gathers)."""
    n, size = parent.shape
    dev = parent.device
    eye = torch.eye(size, dtype=torch.bool, device=dev).expand(n, size, size)
    up = parent[:, :, None].expand(n, size, size)
    attend = eye
    for _ in range(max_depth):  # a node sees what its parent sees, and itself
        attend = eye | attend.gather(1, up)
    nodes = torch.arange(size, device=dev).expand(n, size)
    kids = torch.zeros(n, size, width, dtype=torch.long, device=dev)
    ok = torch.zeros(n, size, width, dtype=torch.bool, device=dev)
    at = (torch.arange(n, device=dev)[:, None].expand(n, size - 1), parent[:, 1:], rank[:, 1:])
    kids.index_put_(at, nodes[:, 1:])
    ok.index_put_(at, torch.ones(n, size - 1, dtype=torch.bool, device=dev))  # (no host scalar)
    slot = torch.stack([parent, rank], 2)
    slot[:, 0].zero_()
    return TreeBuffers(attend, depth, parent, nodes, kids, ok, nodes, slot)
