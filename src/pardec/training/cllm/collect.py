"""Jacobi trajectory collection (CLLM paper, Algorithm 1), batched, resumable and shardable.

For each prompt the target model Jacobi-decodes block by block under greedy decoding. A block of n tokens
starts from tokens drawn at random (seeded per prompt) from the prompt and the answer so far (``guess_from:
context``, CLLM Algorithm 3 and the official data/generate_trajectory.py, whose guess for every block draws from the
whole sequence so far; ``prompt``: the prompt only), by the same code as the ``jacobi`` decoder
(:func:`pardec.decoding.jacobi.initial_guess`). Every state is recorded until the fixed point; decoding continues
from the fixed point until EOS or ``max_new_tokens``.

Nothing is computed twice or for nothing (continuous batching, :func:`jacobi_stream`):

* prompts are sorted by length (rows of a batch pad little) and a batch holds ``batch_size`` rows; at every
  block boundary the rows that finished (EOS or ``max_new_tokens``) leave and waiting prompts take their places
  (prefilled in a cache of their own, then joined; left padding masked with ``key_valid``, explicit positions
  per row); a record is written as soon as its prompt finishes;
* within a block, a forward's outputs are final up to a row's first changed token, so the inputs before it stay
  cached and the next forward runs only the rest of the block (the cache keeps the positions final for every
  row still iterating);
* a row whose outputs are all final (no change, or only the last position changed) has reached its fixed point
  and its cache holds the whole block: it leaves the batch (parked) and rejoins at the block's end. A block of n
  therefore takes at most n forwards (after t forwards the first t tokens are final).

The recorded states are exactly those of plain Jacobi iteration over the whole block (a test compares them with
an uncached reference).

Augmentation (``augment``; CLLM §3.2.1: the data are augmented by randomly correcting wrongly predicted tokens of
the intermediate states):

* ``in_place`` (the default; the paper's rule as the official data/generate_trajectory.py applies it with
  ``--use_aug``, lines 299-304 @ 2277536): every state of a block except the fixed point and the state just before
  it is corrected in place: with w its wrong tokens (positions where it differs from the fixed point), ``w // 2``
  positions are drawn uniformly *with replacement* from the wrong positions after the first one, and those
  positions take the fixed point's tokens (a repeated draw corrects one token, so at most ``w // 2`` are fixed; the
  first wrong token is never corrected, so the state stays distinct from the fixed point). ``states`` then hold
  the corrected states (consecutive states are no longer exact Jacobi successors: the local loss's pairs are the
  corrected ones, as they would be in the official data);
* ``copies`` (pardec's earlier scheme): for every state but the fixed point, a copy in which each wrong token after
  the first wrong one is replaced by the fixed-point token with probability ``augment_prob`` is added to the
  block's ``augmented`` list when it differs from the state; ``states`` stay the visited ones;
* ``none``: the states as visited (the official script's default: scripts/generate_trajectory.sh passes no
  ``--use_aug``).

Optional, off by default:

* cleaning: a record is dropped when its answer repeats some g-gram (g <= ``clean_max_ngram``) more than
  ``clean_max_repeats`` times in a row (see :func:`has_degenerate_repetition`). Dropped records stay in
  the part files (so a resumed run skips them) and are left out of ``trajectories.jsonl``.

Sharding: rank r of w takes the prompts with index % w == r and writes ``part-{r}.jsonl``; rank 0 merges.
"""

from __future__ import annotations

import itertools
import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from pardec.config import ConfigError, DatasetConfig, check_choice
from pardec.decoding.jacobi import check_guess_from, initial_guess
from pardec.models.cached import CachedModel
from pardec.training import stages
from pardec.training.cllm.augment import augment_in_place, augment_states, has_degenerate_repetition
from pardec.training.cllm.trajectories import SCHEMA_VERSION, merge
from pardec.training.stages import Prompt

log = logging.getLogger(__name__)


#: augmentation schemes (module docstring)
AUGMENT = ("in_place", "copies", "none")


@dataclass
class CollectConfig:
    block_size: int = 16  # n: tokens per Jacobi block
    max_new_tokens: int = 256
    batch_size: int = 8  # prompts per forward
    max_prompts: int | None = None  # the first N documents of the dataset (None: all)
    max_iters: int | None = None  # Jacobi forwards per block (None: block_size + 1, always enough)
    seed: int = 0  # initial guesses and augmentation, per prompt
    guess_from: str = "context"  # initial guesses from the prompt + answer so far (CLLM Alg. 3) | prompt
    augment: str = "in_place"  # in_place (CLLM §3.2.1, official rule) | copies | none
    augment_prob: float = 0.5  # copies only: the chance of correcting each wrong token after the first
    clean: bool = False  # drop answers with degenerate repetition
    clean_max_ngram: int = 8
    clean_max_repeats: int = 8
    out_dir: str = "data/trajectories"
    overwrite: bool = False  # wipe out_dir when its meta.json is from other settings

    def __post_init__(self) -> None:
        for key in ("block_size", "max_new_tokens", "batch_size", "clean_max_ngram", "clean_max_repeats"):
            if getattr(self, key) < 1:
                raise ConfigError(f"collect.{key}={getattr(self, key)!r} is out of range: it must be >= 1")
        check_guess_from(self.guess_from, "collect.guess_from")
        check_choice("collect.augment", self.augment, AUGMENT)
        if not 0.0 < self.augment_prob <= 1.0:
            raise ConfigError(f"collect.augment_prob={self.augment_prob!r} is out of range: it must be in (0, 1]")


# ------------------------------------------------------------------------------------------- algorithm
@dataclass
class _Row:
    """One prompt being decoded: ``last`` is its last committed token (not cached yet), at position ``pos``."""
    key: Any
    prompt: list[int]
    gen: torch.Generator
    last: int
    pos: int
    out: dict = field(default_factory=lambda: {"answer_ids": [], "stop_reason": None, "blocks": [],
                                               "unconverged": 0})
    produced: int = 0


@torch.inference_mode()
def jacobi_stream(
    cm: CachedModel,
    prompts: Iterable[tuple[Any, list[int], torch.Generator]],
    batch_size: int,
    block_size: int,
    max_new_tokens: int,
    eos_ids: set[int],
    max_iters: int | None = None,
    guess_from: str = "context",
) -> Iterator[tuple[Any, dict]]:
    """Greedy Jacobi decoding of a stream of ``(key, prompt ids, generator)``, recording every state of every block;
    yields ``(key, result)`` as each prompt finishes (not in input order).

    A result is ``{"answer_ids", "stop_reason", "blocks": [{"states", "fixed_point"}], "unconverged"}``; the
    generator draws the prompt's initial guesses (:func:`~pardec.decoding.jacobi.initial_guess`, from ``guess_from``).
    Continuous batching: at every block boundary finished rows leave the batch and waiting prompts take their places
    (prefilled on their own, then joined; left padding masked with ``key_valid``, explicit positions per row), so
    the batch stays full.
    """
    queue = iter(prompts)
    rows: list[_Row] = []
    key_valid = torch.zeros(0, 0, dtype=torch.bool)  # [B, cache length]: False = padding
    cm.reset()
    while True:
        new = list(itertools.islice(queue, batch_size - len(rows)))
        if new:
            key_valid = _admit(cm, rows, key_valid, new)
        if not rows:
            return
        n = [min(block_size, max_new_tokens - r.produced) for r in rows]
        guess = torch.stack([_initial_guess(r, k, block_size, guess_from) for r, k in zip(rows, n)])  # [B, block]
        order, fixed, states, unconverged = _iterate_block(cm, rows, guess, n, key_valid, max_iters or block_size + 1)
        rows, n = [rows[i] for i in order], [n[i] for i in order]
        key_valid = torch.cat([key_valid[order], torch.ones(len(rows), block_size, dtype=torch.bool)], dim=1)
        finished = []
        for i, r in enumerate(rows):
            fp = fixed[i][: n[i]]
            r.out["blocks"].append({"states": [s[: n[i]] for s in states[i]], "fixed_point": fp})
            r.out["unconverged"] += int(unconverged[i])
            eos = next((j for j, t in enumerate(fp) if t in eos_ids), None)
            r.out["answer_ids"] += fp if eos is None else fp[: eos + 1]
            r.produced += n[i]
            r.last, r.pos = fixed[i][-1], r.pos + block_size
            if eos is not None or r.produced >= max_new_tokens:
                r.out["stop_reason"] = "eos" if eos is not None else "length"
                finished.append(i)
        for i in finished:
            yield rows[i].key, rows[i].out
        if finished:
            cm.take_rows(finished)  # dropped
            stay = [i for i in range(len(rows)) if i not in set(finished)]
            rows, key_valid = [rows[i] for i in stay], key_valid[stay]
            key_valid = _drop_padding_columns(cm, key_valid)


def _initial_guess(row: _Row, n: int, block_size: int, guess_from: str) -> torch.Tensor:
    """``n`` random tokens of the row's context (prompt + answer so far, or the prompt: ``guess_from``; its
    generator), then ``block_size - n`` copies of its last token: the positions past a short last block are never
    recorded and cannot change the first ``n`` (causality)."""
    g = initial_guess(row.prompt, row.out["answer_ids"], n, row.gen, guess_from)
    return torch.tensor(g + [row.last] * (block_size - n), dtype=torch.long)


def _admit(cm: CachedModel, rows: list[_Row], key_valid: torch.Tensor,
           new: list[tuple[Any, list[int], torch.Generator]]) -> torch.Tensor:
    """Prefill ``prompt[:-1]`` of the new prompts (left-padded among themselves; the last prompt token opens the
    first block) in a cache of their own, join it to ``cm``'s rows and append them to ``rows``; returns the
    new ``key_valid``."""
    if min(len(p) for _, p, _ in new) < 1:
        raise ValueError("empty prompt")
    plen = max(1, max(len(p) for _, p, _ in new) - 1)
    ids = torch.zeros(len(new), plen, dtype=torch.long)
    kv = torch.zeros(len(new), plen, dtype=torch.bool)
    for i, (_, p, _) in enumerate(new):
        ctx = p[:-1]
        if ctx:
            ids[i, plen - len(ctx):] = torch.tensor(ctx)
            kv[i, plen - len(ctx):] = True
    fresh = CachedModel(cm.model, cm.name)  # a one-token prompt's row holds one masked dummy position
    fresh.forward(ids, positions=(kv.cumsum(-1) - 1).clamp(min=0), key_valid=kv, last_only=True)
    pad_old, pad_new = cm.join_rows(fresh)
    left = lambda t, k: torch.cat([torch.zeros(t.shape[0], k, dtype=torch.bool), t], dim=1)  # noqa: E731
    rows += [_Row(key, list(p), g, p[-1], len(p) - 1) for key, p, g in new]
    return torch.cat([left(key_valid, pad_old), left(kv, pad_new)], dim=0) if len(key_valid) else kv


def _drop_padding_columns(cm: CachedModel, key_valid: torch.Tensor) -> torch.Tensor:
    """Drop leading cache positions no row may attend to (left by rows that left the batch)."""
    if not len(key_valid):
        return key_valid
    used = key_valid.any(0).nonzero()
    start = int(used[0]) if used.numel() else key_valid.shape[1]
    if start:
        cm.keep(list(range(start, cm.length)), start=0)
        key_valid = key_valid[:, start:]
    return key_valid


def _iterate_block(
    cm: CachedModel,
    rows: list[_Row],
    guess: torch.Tensor,
    n: list[int],
    key_valid: torch.Tensor,
    max_iters: int,
) -> tuple[list[int], list[list[int]], list[list[list[int]]], list[bool]]:
    """Iterate one block of every row to its fixed point (the first ``n[i]`` tokens of row i; Jacobi on a block
    restricted to its first k positions is Jacobi on those k positions, by causality).

    Returns (``order``: the new row order of the cache, and per row in that order its fixed point, states and
    whether ``max_iters`` cut it). On return the cache holds ``[last, fixed[:-1]]`` appended to every row.

    Nothing is computed twice: after a forward, the tokens before a row's first change are final, so the cache
    keeps the block positions final for every row still iterating (``c``) and the next forward runs only the
    rest of the block; a row that converged leaves the batch (its cache, complete, is parked) and rejoins when
    the block ends.
    """
    bsz, width = guess.shape
    base = cm.length
    active = list(range(bsz))  # original row indices still iterating, in cache order
    limit = torch.tensor(n)
    states: list[list[list[int]]] = [[g] for g in guess.tolist()]
    fixed: list[list[int]] = [[] for _ in range(bsz)]
    parked: list[tuple[list[int], CachedModel]] = []
    last = torch.tensor([r.last for r in rows])
    pos = torch.tensor([r.pos for r in rows])
    kv = key_valid
    c = 0  # block positions (inputs) cached for every active row
    for _ in range(max_iters):
        inp = torch.cat([last[active, None], guess[active, :-1]], dim=1)[:, c:]  # [A, width - c]
        positions = pos[active, None] + torch.arange(c, width)
        mask = torch.cat([kv, torch.ones(len(active), width, dtype=torch.bool)], dim=1)  # [A, base + width]
        tail = cm.forward(inp, positions=positions, key_valid=mask).logits.argmax(-1)
        old = guess[active]
        new = torch.cat([old[:, :c], tail.cpu()], dim=1)
        lim = limit[active]
        differs = (new != old) & (torch.arange(width) < lim[:, None])  # [A, width]
        changed = differs.any(-1)
        first = torch.where(changed, differs.float().argmax(-1), lim)  # first change (outputs up to it are final)
        for a, i in enumerate(active):
            if changed[a]:
                states[i].append(new[a].tolist())
        guess[active] = new
        # a row is at its fixed point once its outputs up to the limit are final (no change, or only the last
        # position changed); its cache then holds the whole block: [last, fixed[:-1]]
        done = (first >= lim - 1).nonzero()[:, 0].tolist()
        if done:
            parked.append(([active[a] for a in done], cm.take_rows(done)))
            for a in done:
                fixed[active[a]] = new[a].tolist()
            stay = [a for a in range(len(active)) if a not in set(done)]
            active, kv, first = [active[a] for a in stay], kv[stay], first[stay]
        if not active:
            break
        c = int(first.min()) + 1  # inputs up to the first change (exclusive of it) are final for every active row
        cm.truncate(base + c)
    unconverged = [False] * bsz
    if active:  # only reachable with max_iters < block + 1 (or non-deterministic kernels): commit the latest states
        log.warning("%d block(s) did not converge in %d iterations", len(active), max_iters)
        inp = torch.cat([last[active, None], guess[active, :-1]], dim=1)[:, c:]
        mask = torch.cat([kv, torch.ones(len(active), width, dtype=torch.bool)], dim=1)
        cm.forward(inp, positions=pos[active, None] + torch.arange(c, width), key_valid=mask, last_only=True)
        for i in active:
            fixed[i], unconverged[i] = guess[i].tolist(), True
    order = list(active)
    for idx, part in parked:
        cm.join_rows(part)
        order += idx
    return order, [fixed[i] for i in order], [states[i] for i in order], [unconverged[i] for i in order]


# ------------------------------------------------------------------------------------------- pipeline
def prompts_from_dataset(cfg: DatasetConfig, tokenizer, model_chat: bool, max_prompts: int | None) -> list[Prompt]:
    """The first ``max_prompts`` documents of any registered task, as prompt token ids."""
    return [Prompt(i, doc_id, ids)
            for i, (doc_id, ids) in enumerate(stages.dataset_prompts(cfg, tokenizer, model_chat, max_prompts))]


def prepare_out_dir(cfg: CollectConfig, meta: dict, rank: int = 0) -> Path:
    """Create ``out_dir`` with ``meta.json``; a different existing meta raises (rank 0 with
    ``collect.overwrite``: the directory is wiped)."""
    return stages.prepare_out_dir(cfg.out_dir, cfg.overwrite, meta, rank, "collect", "trajectories collected")


def collection_meta(cfg: CollectConfig, identity: dict, eos_ids: set[int]) -> dict:
    """What identifies a collection (a resumed run must match it): the settings that change the records,
    plus ``identity`` (model, dataset, prompt format)."""
    keep = ("block_size", "max_new_tokens", "max_prompts", "max_iters", "seed", "guess_from", "augment", "clean",
            "clean_max_ngram", "clean_max_repeats")
    meta = {"schema_version": SCHEMA_VERSION, **identity, "eos_ids": sorted(eos_ids),
            **{k: v for k, v in asdict(cfg).items() if k in keep}}
    if cfg.augment == "copies":
        meta["augment_prob"] = cfg.augment_prob
    return meta


def collect(
    cfg: CollectConfig,
    cm: CachedModel,
    eos_ids: set[int],
    prompts: list[Prompt],
    meta: dict,
    rank: int = 0,
    world: int = 1,
    barrier: Callable[[], None] | None = None,
    stop_after: int | None = None,
) -> dict | None:
    """Collect this rank's share of ``prompts`` into ``part-{rank}.jsonl``, then (rank 0) merge.

    Prompts already in any part file are skipped (resume). ``stop_after``: write at most that many records,
    then return without merging (simulates a killed run in tests). Returns the stats on rank 0, else None.
    """
    def stream(todo: Iterator[Prompt]) -> Iterator[dict]:
        by_index = {}

        def feed():
            for p in todo:
                by_index[p.index] = p
                yield p.index, p.ids, torch.Generator().manual_seed(cfg.seed * 1_000_003 + p.index)
        for index, r in jacobi_stream(cm, feed(), cfg.batch_size, cfg.block_size, cfg.max_new_tokens, eos_ids,
                                      cfg.max_iters, cfg.guess_from):
            yield _record(cfg, by_index.pop(index), r)

    # prompts sorted by length: the rows of a batch pad little
    return stages.run_stage(prompts, cfg.out_dir, lambda r: prepare_out_dir(cfg, meta, r), rank, world, barrier,
                            cfg.batch_size, None, f"collect[{rank}]", stop_after, lambda out, n: merge(out, expected=n),
                            order=lambda p: (len(p.ids), p.index), stream=stream)


def _record(cfg: CollectConfig, p: Prompt, r: dict) -> dict:
    rng = random.Random(f"{cfg.seed}-{p.index}-augment")
    if cfg.augment == "in_place":
        augment_in_place(r["blocks"], rng)
    elif cfg.augment == "copies":
        augment_states(r["blocks"], cfg.augment_prob, rng)
    drop = None
    if cfg.clean and has_degenerate_repetition(r["answer_ids"], cfg.clean_max_ngram, cfg.clean_max_repeats):
        drop = "repetition"
    return {"schema_version": SCHEMA_VERSION, "id": p.id, "index": p.index, "prompt_ids": p.ids,
            "answer_ids": r["answer_ids"], "stop_reason": r["stop_reason"], "blocks": r["blocks"],
            "unconverged_blocks": r["unconverged"], "drop_reason": drop}
