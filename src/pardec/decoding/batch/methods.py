"""``ar``, ``pld``, ``sps`` and ``jacobi`` (CLLM's decoding) over a batch (:mod:`pardec.decoding.batch.engine`):
each row's output is what the batch-1 method gives its prompt (greedy: token for token, as greedy ``ar``; sampled:
the same distribution).

Each round is one target forward for every active row; a row's draft is as long as the batch-1 method would make
it (``pld``: its own lookup, cut to the room left; ``sps``: ``gamma``, cut to the room left), shorter drafts padded
to the longest. ``eagle3``'s chain, ``dflash``, ``medusa`` and ``lookahead``: :mod:`pardec.decoding.batch.eagle`,
:mod:`pardec.decoding.batch.dflash`, :mod:`pardec.decoding.batch.medusa`, :mod:`pardec.decoding.batch.lookahead`.
``bild``, ``sdsat``, ``firp``: :mod:`pardec.decoding.batch.bild`, :mod:`pardec.decoding.batch.sdsat`,
:mod:`pardec.decoding.batch.firp`; ``spectr``: :mod:`pardec.decoding.batch.spectr`; ``mjsd``, ``mjgd``:
:mod:`pardec.decoding.batch.mjsd`; ``ouroboros``: :mod:`pardec.decoding.batch.ouroboros`. Not batched
(docs/batch.md): transformers' peers."""

from __future__ import annotations

import torch

from pardec.config import ConfigError, check_at_least
from pardec.decoding.batch.engine import BatchedMethod, Row, register_batched
from pardec.decoding.jacobi import check_guess_from, initial_guess
from pardec.decoding.pld import lookup
from pardec.decoding.sampling import sample, select, warp
from pardec.models.ragged import RaggedModel


@register_batched("ar")
class BatchedAR(BatchedMethod):
    """One token per row per forward: every row's weights read once per step for the whole batch."""

    def round(self, rows: list[Row]) -> None:
        logits = self.target.forward(torch.tensor([[r.last] for r in rows], dtype=torch.long))[:, -1]
        for r, t in zip(rows, select(logits, self.s, self.gen).tolist()):  # the round's one host read
            r.commit([t])


@register_batched("pld")
class BatchedPLD(BatchedMethod):
    """Prompt lookup per row (:func:`pardec.decoding.pld.lookup`, on the host), verified together."""

    def __init__(self, target, tokenizer=None, draft=None, max_ngram: int = 3, min_ngram: int = 1,
                 num_pred: int = 10):
        super().__init__(target, tokenizer, draft)
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"method.min_ngram={min_ngram}, max_ngram={max_ngram}: need 1 <= min <= max")
        check_at_least("method.num_pred", num_pred, 1)
        self.max_ngram, self.min_ngram, self.num_pred = max_ngram, min_ngram, num_pred

    def round(self, rows: list[Row]) -> None:
        drafts = [lookup(torch.tensor(r.tail(0)), self.max_ngram, self.min_ngram, self.num_pred)[: r.out.room - 1]
                  .tolist() for r in rows]
        k = max(len(d) for d in drafts)
        draft = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long).reshape(len(rows), k)
        self.verify(rows, draft, [len(d) for d in drafts])


@register_batched("sps")
class BatchedSPS(BatchedMethod):
    """A draft model proposes ``gamma`` tokens per row (its own ragged cache, fed the tokens it lacks first:
    one or two per row), the target verifies them with the draft's distributions."""

    def __init__(self, target, tokenizer=None, draft=None, gamma: int = 4):
        super().__init__(target, tokenizer, draft)
        check_at_least("method.gamma", gamma, 1, integer=True)
        self.gamma = gamma

    def round(self, rows: list[Row]) -> None:
        ks = [min(self.gamma, r.out.room - 1) for r in rows]
        k = max(ks)
        if k == 0:  # every row has room for the target's token only
            self.verify(rows, torch.zeros(len(rows), 0, dtype=torch.long), ks)
            return
        logits, fed = catch_up_rows(self.draft, rows)
        toks, qs = [], []
        for j in range(k):
            if j:
                logits = self.draft.forward(toks[-1][:, None])[:, 0]
            if self.s.greedy:
                toks.append(logits.argmax(-1))
            else:
                qs.append(warp(logits, self.s))
                toks.append(sample(qs[-1], self.gen)[:, 0])
        acc = self.verify(rows, torch.stack(toks, 1), ks, torch.stack(qs, 1) if qs else None).tokens
        # the draft holds each row's old sequence + d_1..d_{k-1}: keep what the new sequence shares with it
        self.draft.set_lengths([f + min(len(a) - 1, k - 1) for f, a in zip(fed, acc)])


def catch_up_rows(draft: RaggedModel, rows: list[Row]) -> tuple[torch.Tensor, list[int]]:
    """Feed a draft model what it lacks of each row (one or more tokens per row, in one forward): (its logits after
    each row's last token [n, V], each row's length now, which the draft holds)."""
    pending = [r.tail(n) for r, n in zip(rows, draft.lengths)]
    w = max(len(p) for p in pending)
    fed = [r.length for r in rows]
    at = torch.tensor([[len(p) - 1] for p in pending], dtype=torch.long)
    logits = draft.forward(torch.tensor([p + [0] * (w - len(p)) for p in pending], dtype=torch.long),
                           widths=[len(p) for p in pending], logits_at=at)[:, 0]
    return logits, fed


@register_batched("jacobi")
class BatchedJacobi(BatchedMethod):
    """Jacobi decoding (CLLM's, on a CLLM model) per row: each row iterates its own block, whose guess (the target's
    tokens after the accepted ones) comes back in the round's one host read; rows start blocks at different rounds.
    The initial guesses are drawn as batch-1 ``jacobi`` draws them (:func:`pardec.decoding.jacobi.initial_guess`,
    a generator per request seeded with the run's seed), so each row iterates as it would alone."""

    def __init__(self, target, tokenizer=None, draft=None, block_size: int = 16, max_iters: int | None = None,
                 guess_from: str = "context"):
        super().__init__(target, tokenizer, draft)
        check_guess_from(guess_from)
        check_at_least("method.block_size", block_size, 1)
        if max_iters is not None and max_iters < 1:
            raise ConfigError(f"method.max_iters={max_iters} is out of range: it must be >= 1 (or null)")
        self.block_size, self.max_iters, self.guess_from = block_size, max_iters or block_size, guess_from

    def round(self, rows: list[Row]) -> None:
        for r in rows:
            st = r.state
            if not st.get("guess"):  # a new block
                gen = st.setdefault("gen", torch.Generator().manual_seed(self.s.seed))
                n = min(self.block_size, r.out.room)
                st.update(n=n, done=0, iters=0,
                          guess=initial_guess(r.prompt, r.out.tokens, n, gen, self.guess_from))
        drafts = [r.state["guess"][:-1] for r in rows]
        k = max(len(d) for d in drafts)
        draft = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long).reshape(len(rows), k)
        before = [len(r.out.tokens) for r in rows]
        acc, nxt, _ = self.verify(rows, draft, [len(d) for d in drafts], extra=lambda lg: select(lg, self.s, self.gen))
        for r, a, g, n0 in zip(rows, acc, nxt, before):
            st = r.state
            st["done"] += len(r.out.tokens) - n0
            st["iters"] += 1
            open_ = st["done"] < st["n"] and st["iters"] < self.max_iters
            st["guess"] = g[len(a) :] if open_ else []
