"""N-gram proposers shared by ``lookahead`` and ``ouroboros``: the pool, the lookahead window, and the one
forward that runs both branches.

* :class:`NGramPool`: n-grams keyed by their first token, at most ``max_per_key`` continuations per key,
  least recently used evicted (re-adding one refreshes it). Lookahead's "n-gram pool", Ouroboros's
  "phrase pool".
* :class:`LookaheadWindow` (Fu et al. 2024, the lookahead branch), laid out as the official code (LADE,
  ``lade/decoding.py`` and ``lade/models/modeling_llama.py``): ``N-1`` levels of ``W`` columns, iterated
  Jacobi-style. Column 0 of level 0 is the last committed token (the forward's root), so level 0 holds ``W-1``
  guesses of its own; column ``j`` of level ``l`` sits at ``root + l + j``, sees level 0 up to column ``j`` (the
  root included) and the tokens of its own column in levels ``1..l``, so each column is a sequence (level 0's
  prefix, then up the column). The top level's outputs are the next guesses; once all levels exist every column
  yields an n-gram (level 0 .. top level, output) for the pool, column 0's keyed by the root. The window starts as
  one level of ``W+N-3`` guesses and fills one level per step (each level losing its first column), so it holds
  ``W`` columns when the ``N-1``-th level arrives. After each step the oldest level is dropped and the window moves
  on by one position, however many tokens were committed (LADE's ``ALWAYS_FWD_ONE``, the only mode its decoding
  loop accepts): positions are always counted from the new root.
* :func:`check_ranges`, :func:`prompt_filler`, :func:`candidate_tree`: the two methods' parameter ranges, the
  window's initial guesses, and the verification branch built from the pool.
* :func:`lookahead_inputs`, :func:`lookahead_forward`: one forward of a model over ``[prefix, candidate tree,
  window]`` -- the verification branch (a :class:`~pardec.decoding.tree.Tree` of candidates rooted at the last
  prefix token) and the lookahead branch under one mask, invisible to each other -- then the cache keeps only the
  prefix (the caller keeps the accepted path with :func:`keep_path`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from pardec.decoding.base import check_range
from pardec.decoding.tree import Tree
from pardec.models.cached import CachedModel, to_device


class NGramPool:
    """``key token -> continuations`` (tuples of up to ``n - 1`` tokens), at most ``max_per_key`` per key, LRU."""

    def __init__(self, n: int, max_per_key: int):
        if n < 2 or max_per_key < 1:
            raise ValueError(f"NGramPool needs n >= 2 and max_per_key >= 1; got n={n}, max_per_key={max_per_key}")
        self.n, self.max_per_key = n, max_per_key
        self._grams: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, key: int, cont: Iterable[int]) -> None:
        cont = tuple(int(t) for t in cont)[: self.n - 1]
        if not cont:
            return
        grams = self._grams.setdefault(int(key), OrderedDict())
        if cont in grams:
            grams.move_to_end(cont)
            return
        grams[cont] = None
        if len(grams) > self.max_per_key:
            grams.popitem(last=False)  # the least recently used

    def add_sequence(self, tokens: list[int]) -> None:
        """Every full n-gram of ``tokens`` (key = its first token)."""
        for i in range(len(tokens) - self.n + 1):
            self.add(tokens[i], tokens[i + 1 : i + self.n])

    def replace(self, key: int, old: Iterable[int], new: Iterable[int]) -> bool:
        """Put ``new`` where ``old`` is in ``key``'s recency order (Ouroboros's ``update_in_place``); another copy of
        ``new`` is dropped. Returns whether ``old`` was there (nothing changes otherwise)."""
        old, new = tuple(int(t) for t in old), tuple(int(t) for t in new)[: self.n - 1]
        grams = self._grams.get(int(key))
        if grams is None or old not in grams or not new:
            return False
        if new != old:
            self._grams[int(key)] = OrderedDict((new if g == old else g, None) for g in grams if g != new)
        return True

    def get(self, key: int, k: int | None = None) -> list[tuple[int, ...]]:
        """Up to ``k`` continuations of ``key``, most recently added or refreshed first."""
        grams = list(reversed(self._grams.get(int(key), ())))
        return grams if k is None else grams[:k]

    def __len__(self) -> int:
        return sum(len(g) for g in self._grams.values())

    def __contains__(self, key: int) -> bool:
        return int(key) in self._grams

    def clear(self) -> None:
        self._grams.clear()


class LookaheadWindow:
    """The lookahead branch's 2D window (LADE's layout): ``levels[0]`` holds level 0's own guesses (its column 0 is the
    root, not stored), ``levels[l]`` (``l >= 1``) one guess per column; at most ``n - 1`` levels of ``width`` columns.
    """

    def __init__(self, width: int, n: int, fill: Callable[[int], list[int]]):
        if width < 1 or n < 2:
            raise ValueError(f"LookaheadWindow needs width >= 1 and n >= 2; got width={width}, n={n}")
        self.width, self.n, self.fill = width, n, fill
        self.levels: list[list[int]] = [list(fill(width + n - 3))]  # LADE: W + N - 3 initial guesses

    def __len__(self) -> int:
        return sum(len(level) for level in self.levels)

    @property
    def full(self) -> bool:
        """All ``n - 1`` levels exist: each step now yields ``width`` n-grams."""
        return len(self.levels) == self.n - 1

    @property
    def top_has_root(self) -> bool:
        """Whether the root's output is one of the top level's (``n == 2``: level 0, root included, is the top)."""
        return self.n == 2

    def top(self) -> slice:
        """The top level's tokens among :meth:`inputs`' (level 0's own guesses on the first step)."""
        return slice(len(self) - len(self.levels[-1]), len(self))

    def inputs(self, root_pos: int) -> tuple[list[int], list[int], torch.Tensor]:
        """(tokens, positions, attend [M, M] among the window's tokens), level by level; every one also sees
        the root (the caller's job)."""
        own = len(self.levels[0])
        tokens = [t for level in self.levels for t in level]
        positions = list(range(root_pos + 1, root_pos + 1 + own))  # level 0: columns 1..own
        m = len(tokens)
        attend = torch.zeros(m, m, dtype=torch.bool)
        attend[:own, :own] = torch.ones(own, own, dtype=torch.bool).tril()
        start = own
        for lvl, level in enumerate(self.levels[1:], start=1):
            w = len(level)
            positions += [root_pos + lvl + j for j in range(w)]
            rows = slice(start, start + w)
            attend[rows, :own] = torch.ones(w, own, dtype=torch.bool).tril(-1)  # level 0 up to column j (root: caller)
            below = own
            for b in range(1, lvl + 1):  # its own column in levels 1..lvl
                attend[rows, below : below + w] = torch.eye(w, dtype=torch.bool)
                below += len(self.levels[b])
            start += w
        return tokens, positions, attend

    def update(self, outputs: list[int], pool: NGramPool | None, root: int) -> int:
        """Take the top level's next guesses (``outputs``, one per top-level token; with :attr:`top_has_root` the
        root's first), harvest one n-gram per column into ``pool`` once the window is full (column 0 keyed by
        ``root``, the step's last committed token), and move on by one position. Returns the n-grams harvested."""
        outputs = list(outputs)
        if not self.full:  # filling: every level loses its first column, the new level its first output but once
            new = outputs if len(self.levels) == 1 else outputs[1:]
            self.levels = [level[1:] for level in self.levels] + [new]
            return 0
        harvested = 0
        if pool is not None:
            keys = [root] + self.levels[0]
            for j in range(len(outputs)):
                pool.add(keys[j], [lvl[j] for lvl in self.levels[1:]] + [outputs[j]])
                harvested += 1
        stack = self.levels[1:] + [outputs]  # drop the oldest level; level 1 becomes level 0 behind the new root
        self.levels = [stack[0][1:]] + stack[1:]
        return harvested


def lookahead_inputs(prefix: list[int], tree: Tree, window: LookaheadWindow | None
                     ) -> tuple[list[int], list[int], torch.Tensor, list[int]]:
    """The new tokens of one forward over ``prefix[:-1]`` (causal), the candidate ``tree`` rooted at ``prefix[-1]``
    and the ``window`` (both branches see the whole prefix, not each other): (tokens, their offsets from the cache's
    length, attend among them [T, T], the columns whose logits the caller reads: the tree's nodes, then the window's
    top level)."""
    root, n = len(prefix) - 1, len(tree)
    tokens = list(prefix[:-1]) + tree.tokens(prefix[-1]).tolist()
    offsets = list(range(root)) + tree.positions(root).tolist()
    w_tokens, w_pos, w_attend = window.inputs(root) if window is not None else ([], [], None)
    m = len(w_tokens)
    total = root + n + m
    attend = torch.zeros(total, total, dtype=torch.bool)
    attend[:root, :root] = torch.ones(root, root, dtype=torch.bool).tril()
    attend[root:, :root] = True  # tree and window see the prefix
    attend[root : root + n, root : root + n] = tree.attend
    if m:
        attend[root + n :, root] = True  # the root (column 0 of level 0)
        attend[root + n :, root + n :] = w_attend
    top = window.top() if window is not None else slice(0, 0)
    wanted = list(range(root, root + n)) + [root + n + i for i in range(top.start, top.stop)]
    return tokens + w_tokens, offsets + w_pos, attend, wanted


def lookahead_forward(model: CachedModel, prefix: list[int], tree: Tree,
                      window: LookaheadWindow | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One forward of ``model`` over :func:`lookahead_inputs`. Returns (logits of the tree's nodes [N, V], logits of
    the window's top level [T, V] -- the root's first when ``window.top_has_root`` -- or None without a window).
    Keep the accepted path with :func:`keep_path`."""
    tokens, offsets, attend, wanted = lookahead_inputs(prefix, tree, window)
    base, n = model.length, len(tree)
    ids = to_device(torch.tensor([tokens]), model.device)
    pos = to_device(torch.tensor([[base + o for o in offsets]]), model.device)
    logits = model.forward(ids, positions=pos, attend=attend, logits_at=wanted).logits[0]
    if window is None:
        return logits[:n], None
    win = logits[n:]
    return logits[:n], (torch.cat([logits[:1], win]) if window.top_has_root else win)


def keep_path(model: CachedModel, prefix_len: int, path: list[int], known: list[int] | None = None) -> None:
    """After :func:`lookahead_forward`: keep the prefix and the accepted tree ``path`` (root first) in the cache.
    ``known``: the kept positions' tokens as host values (the prefix, then the path's labels after the root), for a
    model that later calls :meth:`~pardec.models.cached.CachedModel.sync` (no read of the ids fed as device tensors)."""
    model.keep(list(range(prefix_len - 1)) + [prefix_len - 1 + i for i in path])
    if known is not None:
        model.settle(known)


#: (name, lowest, highest) of the integer parameters shared by lookahead and ouroboros
RANGES = {"level": (2, 16), "window": (1, 128), "guess_set": (1, 128), "gamma": (1, 64), "top_k_phrases": (0, 64)}


def check_ranges(**values: int) -> None:
    """One line naming the parameter, its value and the valid range, for any value out of range."""
    for key, v in values.items():
        check_range(key, v, *RANGES[key])


def prompt_filler(prompt: list[int], seed: int):
    """``fill(k)``: k random prompt tokens from a generator of its own (the window's initial guesses)."""
    gen = torch.Generator().manual_seed(seed)

    def fill(k: int) -> list[int]:
        return [prompt[i] for i in torch.randint(len(prompt), (k,), generator=gen).tolist()]

    return fill


def candidate_tree(pool: NGramPool, key: int, k: int, room: int) -> Tree:
    """A trie of up to ``k`` pool continuations of ``key``, each cut to ``room`` tokens (root only if none)."""
    cands = [c[:room] for c in pool.get(key, k)] if room > 0 else []
    return Tree.from_paths([c for c in cands if c])
