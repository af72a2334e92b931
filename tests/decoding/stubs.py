"""Stub models with hand-set logits, for tests of accept / reject logic (nanoGPT/litgpt habit)."""

from __future__ import annotations

import torch

from pardec.models.cached import ForwardOut


class TableLM:
    """A :class:`~pardec.models.cached.CachedModel` stand-in whose next-token distribution depends on the last
    token only: ``probs[t]`` [V] after token ``t`` (rows missing from ``probs`` are uniform). It keeps the token ids
    a real cache would hold, so ``sync`` / ``truncate`` / ``keep`` behave as the real verbs; ``calls`` records the
    token lists of every forward."""

    name = "table"
    device = torch.device("cpu")
    dtype = torch.float32
    max_length = 1 << 20

    def __init__(self, vocab: int, probs: dict[int, dict[int, float]]):
        self.vocab = vocab
        self.logits = torch.full((vocab, vocab), -1e9)
        for t in range(vocab):
            row = probs.get(t)
            if row is None:
                self.logits[t] = 0.0
            else:
                for x, p in row.items():
                    self.logits[t, x] = float(torch.log(torch.tensor(p)))
        self._tokens: list[int] = []
        self._last = 0
        self.calls: list[list[int]] = []

    @property
    def length(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    def reset(self) -> None:
        self._tokens, self._last = [], 0

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        self.reset()
        return self.forward(ids, last_only=True).logits[:, -1]

    def forward(self, ids, positions=None, attend=None, key_valid=None, last_only=False, logits_at=None,
                hidden_layer=None) -> ForwardOut:
        toks = torch.as_tensor(ids).reshape(-1).tolist()
        self.calls.append(toks)
        self._tokens += toks
        self._last = len(toks)
        out = self.logits[toks][None]  # [1, T, V]
        return ForwardOut(out[:, -1:] if last_only else out)

    def truncate(self, length: int) -> None:
        self._last = max(0, self._last - (len(self._tokens) - length))
        self._tokens = self._tokens[:length]

    def keep(self, indices, start=None) -> None:
        start = len(self._tokens) - self._last if start is None else start
        tail = self._tokens[start:]
        self._tokens = self._tokens[:start] + [tail[i] for i in torch.as_tensor(indices).tolist()]
        self._last = len(torch.as_tensor(indices).reshape(-1))

    def confirm(self, accepted) -> None:
        """Its tokens are host values already: nothing to settle (:meth:`CachedModel.confirm`)."""

    def settle(self, values) -> None:
        """Its tokens are host values already; checks that the caller's claim about the last ones is true
        (:meth:`CachedModel.settle`)."""
        values = [int(v) for v in values]
        assert self._tokens[len(self._tokens) - len(values):] == values, (self._tokens, values)

    def sync(self, seq) -> list[int]:
        seq = torch.as_tensor(seq).tolist()
        n = min(len(self._tokens), len(seq) - 1)
        common = next((i for i in range(n) if self._tokens[i] != seq[i]), n)
        self.truncate(common)
        return seq[common:]
