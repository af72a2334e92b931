"""The batched decoding loop: continuous batching of requests over a :class:`~pardec.models.ragged.RaggedModel`.

:func:`run_batch` takes every prompt at once (an offline batch, as throughput benchmarks submit it), admits up to
``batch_size`` of them (each prompt prefilled alone, its first token chosen from that forward), then runs rounds: one
:meth:`BatchedMethod.round` for all active rows (one target forward, one host read), after which finished rows leave
and waiting prompts take their rows. Each request's result is a :class:`~pardec.decoding.base.GenerationResult` whose
``total_s`` is its latency from submission (the run's start) to its last token and ``prefill_s`` the time to its
first token; :class:`BatchRun` adds the run's wall time and rounds.

A batched method is a plug-in: subclass :class:`BatchedMethod`, implement :meth:`~BatchedMethod.round`, register it
with :func:`register_batched` under the name of the batch-1 method whose output it reproduces (``ar``, ``pld``,
``sps``: :mod:`pardec.decoding.batch.methods`), taking the same ``method.*`` parameters or a subset of them."""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding.base import METHODS, GenerationResult, Output, Stopper, check_params, method_params, sync
from pardec.decoding.batch.verify import padded_trees, verify_rows
from pardec.decoding.sampling import make_generator, select
from pardec.decoding.tree import Tree, TreeBuffers
from pardec.models.cache import to_device
from pardec.models.ragged import RaggedModel
from pardec.registry import Registry


@dataclass
class Row:
    """One request while it decodes: the target holds its prompt + committed tokens but the last (``last``)."""

    index: int  # the prompt's index in the submitted list
    prompt: list[int]
    out: Output
    last: int = -1
    forwards: int = 1  # target forwards this request took part in, its prefill included
    drafted: int = 0
    draft_accepted: int = 0
    first_s: float = 0.0  # from the run's start to its first token
    state: dict[str, Any] = field(default_factory=dict)  # what a method keeps per request between rounds

    @property
    def length(self) -> int:
        """Tokens of prompt + output."""
        return len(self.prompt) + len(self.out.tokens)

    def tail(self, start: int) -> list[int]:
        """(prompt + output)[start:]."""
        p = len(self.prompt)
        return (self.prompt[start:] + self.out.tokens) if start < p else self.out.tokens[start - p :]

    def commit(self, tokens: list[int], drafted: int = 0) -> None:
        """A target forward committed ``tokens`` (its accepted draft tokens, then its own)."""
        self.forwards += 1
        self.drafted += drafted
        self.draft_accepted += len(tokens) - 1
        self.out.commit(tokens)
        self.last = tokens[-1]


class BatchedMethod:
    """Base class of a batched method: the target (and the draft) as ragged batches, rows in the same order."""

    name: ClassVar[str] = ""
    exactness: ClassVar[str] = "distribution"  # as its batch-1 method's (tests hold every row to it)
    needs_draft: ClassVar[bool] = False
    renamed: ClassVar[dict[str, str]] = {}

    def __init__(self, target: RaggedModel, tokenizer=None, draft: RaggedModel | None = None):
        self.target, self.tokenizer, self.draft = target, tokenizer, draft
        self.s = SamplingConfig()
        self.gen: torch.Generator | None = None

    @classmethod
    def check_options(cls, params: dict[str, Any], sampling: SamplingConfig | None = None) -> None:
        """What the batched form refuses of values its batch-1 method takes (one line), before any model loads
        (``sampling``: the run's, where known)."""

    @classmethod
    def draft_rows(cls, batch_size: int, params: dict[str, Any]) -> int:
        """Rows of the draft model's ragged cache for ``batch_size`` requests (a method that grows several draft
        branches per request in rows of their own takes more)."""
        return batch_size

    def start(self, s: SamplingConfig, gen: torch.Generator | None) -> None:
        self.s, self.gen = s, gen

    def admit(self, row: Row) -> None:
        """Prefill ``row``'s prompt into a new last row (target and draft) and commit its first token."""
        first = select(self.target.add(row.prompt), self.s, self.gen)
        if self.draft is not None:
            self.draft.add(row.prompt)
        row.last = int(first)  # (the admission's one host read)
        row.out.commit([row.last])

    def round(self, rows: list[Row]) -> None:
        """One round for every active row (``rows[b]`` is the models' row ``b``): one target forward, commit."""
        raise NotImplementedError

    def drop(self, b: int) -> None:
        """Row ``b`` leaves every model (the last row takes its place, as in ``rows``)."""
        self.target.drop(b)
        if self.draft is not None:
            self.draft.drop(b)

    # ---------------------------------------------------------------- shared steps
    def verify(self, rows: list[Row], draft: torch.Tensor, ks: list[int], q: torch.Tensor | None = None,
               extra: Callable[[torch.Tensor], torch.Tensor] | None = None,
               hidden_layer: tuple[int, ...] | None = None, rule: Rule | None = None) -> Verified:
        """One target forward over ``[last, *draft[b]]`` per row (``draft`` [n, K], row b's first ``ks[b]`` real):
        commit each row's accepted prefix + the target's token, keep exactly those in the cache. ``extra(logits)``
        [n, X]: ids read back in the same host read; ``hidden_layer``: also the target's hidden states entering
        those layers; ``rule(draft, ks, logits)``: what each row commits, in one host read (default: speculative
        verification, :func:`~pardec.decoding.batch.verify.verify_rows`)."""
        lasts = torch.tensor([[r.last] for r in rows], dtype=torch.long)
        ids = torch.cat([to_device(lasts, draft.device), draft], 1)
        base = list(self.target.lengths)
        out = self.target.forward(ids, hidden_layer=hidden_layer)
        logits, hidden = out if hidden_layer is not None else (out, None)
        if rule is not None:
            acc, more = rule(draft, ks, logits), []
        else:
            acc, more = verify_rows(draft, ks, logits, self.s, self.gen, q, None if extra is None else extra(logits))
        self.target.set_lengths([b0 + len(a) for b0, a in zip(base, acc)])
        for r, a, kb in zip(rows, acc, ks):
            r.commit(a, kb)
        return Verified(acc, more, hidden)

    def forward_trees(self, rows: list[Row], trees: list[Tree], max_depth: int | None = None
                      ) -> tuple[TreeBuffers, torch.Tensor, list[int], torch.Tensor]:
        """One target forward over every row's tree (rooted at its last token), the trees padded to the largest
        (:func:`~pardec.decoding.batch.verify.padded_trees`, ``max_depth`` their deepest: by default the deepest
        tree's depth), each row under its own
        ancestor mask. Returns (the per-row buffers, the labels [n, N], the rows' lengths before it, the logits
        [n, N, V]); the caller keeps each row's accepted path (``target.keep_rows(base, paths)``)."""
        dev = self.target.device
        if max_depth is None:
            max_depth = max(int(t.depth.max()) for t in trees)
        buf, labels = padded_trees(trees, dev, max_depth)
        last = to_device(torch.tensor([[r.last] for r in rows], dtype=torch.long), dev)
        base = list(self.target.lengths)
        logits = self.target.forward(torch.cat([last, labels[:, 1:].clamp(min=0)], 1), depths=buf.depth,
                                     attend=buf.attend)
        return buf, labels, base, logits


Rule = Callable[[torch.Tensor, list[int], torch.Tensor], list[list[int]]]
"""A verification rule of a batch of chains: (draft [n, K], real lengths, logits [n, K+1, V]) -> each row's
committed tokens (one host read)."""


class Verified(NamedTuple):
    """What :meth:`BatchedMethod.verify` committed per row, the ``extra`` ids' rows, the captured hidden states."""

    tokens: list[list[int]]
    extra: list[list[int]]
    hidden: torch.Tensor | None


BATCHED: Registry[type[BatchedMethod]] = Registry("batched method")


def register_batched(name: str) -> Callable[[type[BatchedMethod]], type[BatchedMethod]]:
    """Register a batched method under the name of the batch-1 method it reproduces."""

    def deco(cls: type[BatchedMethod]) -> type[BatchedMethod]:
        single = METHODS.get(name)
        cls.name, cls.exactness, cls.needs_draft = name, single.exactness, single.needs_draft
        return BATCHED.register(name)(cls)

    return deco


def check_batched(name: str, batch_size: int, params: dict[str, Any], sampling: SamplingConfig | None = None
                  ) -> type[BatchedMethod]:
    """The batched method ``name`` for ``batch_size`` rows with ``params`` (and the run's ``sampling``, where known),
    checked before any model loads."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r} must be an integer >= 1")
    if name not in BATCHED:
        single = METHODS.canonical(name)  # (an unknown method: the registry's message)
        raise ConfigError(f"method {single!r} has no batched implementation: batch_size > 1 runs "
                          f"{', '.join(BATCHED.names())}")
    cls = BATCHED.get(name)
    check_params(cls, batched_params(name, params))
    cls.check_options(batched_params(name, params), sampling)
    return cls


def batched_params(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """``params`` less the batch-1 method's parameters that its batched form does not take and that are at the batch-1
    default (a method's config lists every parameter: ``conf/method/<name>.yaml``); any other value stays, and is
    refused by :func:`check_params` naming what the batched form takes."""
    taken = method_params(BATCHED.get(name))
    single = method_params(METHODS.get(name))
    return {k: v for k, v in params.items() if k in taken or k not in single or single[k].default != v}


def build_batched(name: str, model: torch.nn.Module, batch_size: int, capacity: int, tokenizer=None,
                  draft: torch.nn.Module | None = None, forward_impl: str = "lean", **params: Any) -> BatchedMethod:
    """The batched method ``name`` over ``model`` (and ``draft``) for ``batch_size`` rows of ``capacity`` positions
    (the batch cache grows past it if needed); ``forward_impl``: the target's forwards after each prefill, ``lean``
    (eager) or ``compiled`` (:data:`~pardec.models.ragged.BATCH_FORWARDS`; a draft model runs the lean one)."""
    cls = check_batched(name, batch_size, params)
    if cls.needs_draft and draft is None:
        raise ConfigError(f"method {name!r} needs a draft model: pass draft=<name>")
    target = RaggedModel(model, batch_size, capacity, forward_impl=forward_impl)
    params = batched_params(name, params)
    return cls(target, tokenizer,
               RaggedModel(draft, cls.draft_rows(batch_size, params), capacity) if cls.needs_draft else None,
               **params)


@dataclass
class BatchRun:
    """Every request's result (in submission order), and the run's."""

    results: list[GenerationResult]
    wall_s: float
    rounds: int
    batch_size: int
    #: of ``wall_s``, the time spent admitting requests: each prompt's prefill and first token
    prefill_s: float = 0.0
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(r.tokens) for r in self.results)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """The tokens after each request's first over the time outside admissions: what the rounds make, without the
        prefills, which a batch does not share (each prompt is prefilled alone)."""
        rounds_s = self.wall_s - self.prefill_s
        return (self.tokens - len(self.results)) / rounds_s if rounds_s > 0 else 0.0

    def latency(self) -> dict[str, float | None]:
        """Per-request latency from submission to the last token, seconds: mean, p50, p95."""
        return latency([r.total_s for r in self.results])


def latency(values: list[float]) -> dict[str, float | None]:
    """Mean, median and 95th percentile (nearest rank) of per-request latencies (None: no request)."""
    if not values:
        return {"mean": None, "p50": None, "p95": None}
    v = sorted(values)
    return {"mean": statistics.fmean(v), "p50": statistics.median(v),
            "p95": v[min(len(v) - 1, max(0, round(0.95 * len(v)) - 1))]}


@torch.inference_mode()
def run_batch(method: BatchedMethod, prompts: list[list[int]], max_new_tokens: int, stop: Stopper | None = None,
              sampling: SamplingConfig | None = None, on_finish: Callable[[GenerationResult], None] | None = None
              ) -> BatchRun:
    """Decode every prompt with ``method``, at most its batch rows at a time (continuous batching)."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    s = sampling or SamplingConfig()
    device = method.target.device
    method.start(s, make_generator(s, device))
    queue = deque(enumerate(prompts))
    active: list[Row] = []
    results: list[GenerationResult | None] = [None] * len(prompts)
    rounds, prefill = 0, 0.0
    sync(device)
    t0 = time.perf_counter()

    def leave() -> None:  # finished rows leave, last first (each one's place is taken by the current last row)
        for b in reversed(range(len(active))):
            r = active[b]
            if r.out.done:
                results[r.index] = res = GenerationResult(
                    r.out.tokens, r.out.reason, r.forwards, accepted=r.out.accepted, prefill_s=r.first_s,
                    total_s=time.perf_counter() - t0, drafted=r.drafted, draft_accepted=r.draft_accepted)
                method.drop(b)
                tail = active.pop()
                if b < len(active):
                    active[b] = tail
                if on_finish is not None:
                    on_finish(res)

    while queue or active:
        while queue and len(active) < method.target.max_rows:
            i, prompt = queue.popleft()
            row = Row(i, [int(t) for t in prompt], Output(max_new_tokens, stop or Stopper()))
            admitted = time.perf_counter()
            method.admit(row)  # (its one host read: the clock reads after the device is done)
            row.first_s = time.perf_counter() - t0
            prefill += t0 + row.first_s - admitted
            active.append(row)
        leave()
        if active:
            method.round(active)
            rounds += 1
            leave()
    sync(device)
    return BatchRun(results, time.perf_counter() - t0, rounds, method.target.max_rows, prefill)
