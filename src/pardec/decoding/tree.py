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
* ``Tree.from_parents(parents, labels)``: explicit structure (parents before children).

``tree.paths`` are the root-to-leaf node-index lists (Medusa's "retrieve indices").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Tree:
    parents: list[int]  # parent node per node; parents[0] == -1 (the root)
    labels: list[int]  # label per node (a token id, or a rank for structure-only trees); labels[0] unused (-1)
    children: list[list[int]] = field(init=False)
    depth: torch.Tensor = field(init=False)  # [N] long, root 0
    attend: torch.Tensor = field(init=False)  # [N, N] bool ancestor-or-self mask

    def __post_init__(self) -> None:
        n = len(self.parents)
        if n == 0 or self.parents[0] != -1 or len(self.labels) != n:
            raise ValueError("a tree needs a root (parents[0] == -1) and one label per node")
        self.children = [[] for _ in range(n)]
        depth = [0] * n
        attend = torch.zeros(n, n, dtype=torch.bool)
        attend[0, 0] = True
        for i in range(1, n):
            p = self.parents[i]
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come before their children")
            if any(self.labels[c] == self.labels[i] for c in self.children[p]):
                raise ValueError(f"node {i} repeats label {self.labels[i]} among the children of node {p}")
            self.children[p].append(i)
            depth[i] = depth[p] + 1
            attend[i] = attend[p]
            attend[i, i] = True
        self.depth = torch.tensor(depth, dtype=torch.long)
        self.attend = attend

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

    # ------------------------------------------------------------------ views
    def __len__(self) -> int:
        return len(self.parents)

    def positions(self, base: int) -> torch.Tensor:
        """[N] absolute positions when the root sits at ``base``."""
        return self.depth + base

    def tokens(self, root_token: int) -> torch.Tensor:
        """[N] the forward's input: the root's token, then every node's label."""
        return torch.tensor([int(root_token)] + self.labels[1:], dtype=torch.long)

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
        return tuple(self.labels[n] for n in self.path_to(node)[1:])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max())
