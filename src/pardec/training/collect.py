"""Jacobi trajectory collection (CLLM paper, Algorithm 1), batched, resumable and shardable.

For each prompt the target model Jacobi-decodes block by block under greedy decoding. A block of n tokens
starts from random tokens of the prompt (seeded per prompt), and every state is recorded until the fixed
point; decoding continues from the fixed point until EOS or ``max_new_tokens``.

Batching keeps every row at the same cache length: the cache holds ``prompt[:-1]`` + the committed blocks
(left padding masked with ``key_valid``, explicit per-row ``positions``). Within a block, every iteration runs
the whole block ``[last committed token, y_0 .. y_{n-2}]`` of every row, then truncates the cache back to the
block start, until every row's block is a fixed point (rows already converged or finished stay frozen). The
last forward ran every row at its fixed point, so its cache is exactly the committed one and is kept.
Greedy Jacobi converges in at most n + 1 forwards (after t forwards the first t tokens are final).

Optional, both off by default:

* augmentation (the paper's "augment the dataset" by randomly correcting wrong tokens): for every state but the
  fixed point, a copy in which each wrong token after the first wrong one is replaced by the fixed-point token
  with probability ``augment_prob`` (the first wrong token is kept, so the copy stays distinct from the fixed
  point) is added to the block's ``augmented`` list when it differs from the state; the visited ``states`` stay
  as they were, so consecutive states remain true Jacobi successors (the local loss's pairs);
* cleaning: a record is dropped when its answer repeats some g-gram (g <= ``clean_max_ngram``) more than
  ``clean_max_repeats`` times in a row (see :func:`has_degenerate_repetition`). Dropped records stay in
  the part files (so a resumed run skips them) and are left out of ``trajectories.jsonl``.

Sharding: rank r of w takes the prompts with index % w == r and writes ``part-{r}.jsonl``; rank 0 merges.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pardec.config import ConfigError, DatasetConfig
from pardec.models.cached import CachedModel
from pardec.training import shards
from pardec.training.trajectories import SCHEMA_VERSION, merge

log = logging.getLogger(__name__)


@dataclass
class CollectConfig:
    block_size: int = 16  # n: tokens per Jacobi block
    max_new_tokens: int = 256
    batch_size: int = 8  # prompts per forward
    max_prompts: int | None = None  # the first N documents of the dataset (None: all)
    max_iters: int | None = None  # Jacobi forwards per block (None: block_size + 1, always enough)
    seed: int = 0  # initial guesses and augmentation, per prompt
    augment_prob: float = 0.0
    clean: bool = False  # drop answers with degenerate repetition
    clean_max_ngram: int = 8
    clean_max_repeats: int = 8
    out_dir: str = "data/trajectories"
    overwrite: bool = False  # wipe out_dir when its meta.json is from other settings

    def __post_init__(self) -> None:
        for key in ("block_size", "max_new_tokens", "batch_size", "clean_max_ngram", "clean_max_repeats"):
            if getattr(self, key) < 1:
                raise ConfigError(f"collect.{key}={getattr(self, key)!r} is out of range: it must be >= 1")
        if not 0.0 <= self.augment_prob <= 1.0:
            raise ConfigError(f"collect.augment_prob={self.augment_prob!r} is out of range: it must be in [0, 1]")


@dataclass
class Prompt:
    index: int  # position in the dataset: sharding key and sort key
    id: str
    ids: list[int]


# ------------------------------------------------------------------------------------------- algorithm
@torch.inference_mode()
def jacobi_trajectories(
    cm: CachedModel,
    prompts: list[list[int]],
    block_size: int,
    max_new_tokens: int,
    eos_ids: set[int],
    generators: list[torch.Generator],
    max_iters: int | None = None,
) -> list[dict]:
    """Greedy Jacobi decoding of a batch of prompts, recording every state of every block.

    Returns per prompt ``{"answer_ids", "stop_reason", "blocks": [{"states", "fixed_point"}], "unconverged"}``.
    ``generators[i]`` draws row i's initial guesses (random tokens of its prompt).
    """
    bsz, plen = len(prompts), max(len(p) for p in prompts)
    if min(len(p) for p in prompts) < 1:
        raise ValueError("empty prompt")
    ids = torch.zeros(bsz, plen, dtype=torch.long)
    key_valid = torch.zeros(bsz, plen, dtype=torch.bool)  # [B, P]: False = left padding
    for i, p in enumerate(prompts):
        ids[i, plen - len(p) :] = torch.tensor(p)
        key_valid[i, plen - len(p) :] = True
    positions = (key_valid.cumsum(-1) - 1).clamp(min=0)  # [B, P]
    cm.reset()
    if plen > 1:  # the cache holds prompt[:-1]; the last prompt token opens the first block
        cm.forward(ids[:, :-1], positions=positions[:, :-1], key_valid=key_valid[:, :-1], last_only=True)
    last = ids[:, -1].clone()  # [B] last committed token (its KV is not cached yet)
    next_pos = positions[:, -1].clone()  # [B] its position
    key_valid = key_valid[:, :-1]  # [B, cache length]
    out = [{"answer_ids": [], "stop_reason": None, "blocks": [], "unconverged": 0} for _ in prompts]
    done = torch.zeros(bsz, dtype=torch.bool)
    produced = 0
    while not done.all():
        n = min(block_size, max_new_tokens - produced)
        guess = torch.stack([torch.tensor(p)[torch.randint(len(p), (n,), generator=g)] for p, g in
                             zip(prompts, generators)])  # [B, n]
        guess[done] = last[done, None]  # finished rows: frozen filler
        fixed, states, unconverged = _iterate_block(cm, last, guess, done, next_pos, key_valid, max_iters or n + 1)
        key_valid = torch.cat([key_valid, torch.ones(bsz, n, dtype=torch.bool)], dim=1)
        next_pos += n
        produced += n
        for i in (~done).nonzero()[:, 0].tolist():
            fp = fixed[i].tolist()
            out[i]["blocks"].append({"states": states[i], "fixed_point": fp})
            out[i]["unconverged"] += int(unconverged[i])
            eos = next((j for j, t in enumerate(fp) if t in eos_ids), None)
            out[i]["answer_ids"] += fp if eos is None else fp[: eos + 1]
            if eos is not None:
                out[i]["stop_reason"], done[i] = "eos", True
            elif produced >= max_new_tokens:
                out[i]["stop_reason"], done[i] = "length", True
        last = fixed[:, -1].clone()
    return out


def _iterate_block(
    cm: CachedModel,
    last: torch.Tensor,
    guess: torch.Tensor,
    frozen: torch.Tensor,
    next_pos: torch.Tensor,
    key_valid: torch.Tensor,
    max_iters: int,
) -> tuple[torch.Tensor, list[list[list[int]]], torch.Tensor]:
    """Iterate one block of every row to its fixed point.

    Returns (fixed points [B, n], the states of each row, unconverged [B] bool: rows cut by ``max_iters``).

    last: [B]; guess: [B, n] initial states; frozen: [B] rows not decoded any more; next_pos: [B] position of
    ``last``; key_valid: [B, cache length]. On return the cache holds ``[last, fixed[:, :-1]]`` appended.
    """
    bsz, n = guess.shape
    base = cm.length
    positions = next_pos[:, None] + torch.arange(n)  # [B, n]
    kv = torch.cat([key_valid, torch.ones(bsz, n, dtype=torch.bool)], dim=1)
    states = [[g] for g in guess.tolist()]
    converged = frozen.clone()
    for _ in range(max_iters):
        inp = torch.cat([last[:, None], guess[:, :-1]], dim=1)  # [B, n]
        new = cm.forward(inp, positions=positions, key_valid=kv).logits.argmax(-1).cpu()  # [B, n]
        changed = ~converged & (new != guess).any(-1)
        for i in changed.nonzero()[:, 0].tolist():
            states[i].append(new[i].tolist())
        converged |= ~changed
        guess = torch.where(changed[:, None], new, guess)
        if converged.all():
            return guess, states, ~converged
        cm.truncate(base)
    # only reachable with max_iters < n + 1 (or non-deterministic kernels): commit the latest states
    log.warning("%d block(s) did not converge in %d iterations", int((~converged).sum()), max_iters)
    cm.forward(torch.cat([last[:, None], guess[:, :-1]], dim=1), positions=positions, key_valid=kv, last_only=True)
    return guess, states, ~converged


# ------------------------------------------------------------------------------------------- post-processing
def has_degenerate_repetition(ids: list[int], max_ngram: int = 8, max_repeats: int = 8) -> bool:
    """True when some g-gram (1 <= g <= max_ngram) occurs more than ``max_repeats`` times back to back,
    i.e. ``ids[s : s + g * (max_repeats + 1)]`` is one g-gram repeated, for some start s."""
    for g in range(1, max_ngram + 1):
        run = 0  # consecutive i with ids[i] == ids[i + g]
        for i in range(len(ids) - g):
            run = run + 1 if ids[i] == ids[i + g] else 0
            if run >= g * max_repeats:
                return True
    return False


def augment_states(blocks: list[dict], prob: float, rng: random.Random) -> None:
    """Add to every block ``augmented``: for each state but the fixed point, a copy with each wrong token after the
    first wrong one replaced by the fixed-point token with probability ``prob`` (copies equal to their state left
    out). The states themselves are not touched."""
    for b in blocks:
        fp = b["fixed_point"]
        extra = []
        for s in b["states"][:-1]:
            wrong = [j for j, (t, f) in enumerate(zip(s, fp)) if t != f]
            copy = list(s)
            for j in wrong[1:]:
                if rng.random() < prob:
                    copy[j] = fp[j]
            if copy != s:
                extra.append(copy)
        b["augmented"] = extra


# ------------------------------------------------------------------------------------------- pipeline
def prompts_from_dataset(cfg: DatasetConfig, tokenizer, chat: bool, max_prompts: int | None) -> list[Prompt]:
    """The first ``max_prompts`` documents of any registered task, as prompt token ids."""
    from pardec.tasks.base import build_task, select_docs

    task = build_task(cfg)
    docs = select_docs(task, max_prompts)
    return [Prompt(i, str(d["id"]), list(task.prompt_ids(d, tokenizer, chat))) for i, d in enumerate(docs)]


def eos_ids_of(model, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} | set(_as_list(getattr(model.generation_config, "eos_token_id", None)))
    return {int(i) for i in ids if i is not None}


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def prepare_out_dir(cfg: CollectConfig, meta: dict, rank: int = 0) -> Path:
    """Create ``out_dir`` with ``meta.json``; a different existing meta raises (rank 0 with
    ``collect.overwrite``: the directory is wiped)."""
    return shards.prepare_out_dir(cfg.out_dir, cfg.overwrite, meta, rank, "collect", "trajectories collected")


def collection_meta(cfg: CollectConfig, identity: dict, eos_ids: set[int]) -> dict:
    """What identifies a collection (a resumed run must match it): the settings that change the records,
    plus ``identity`` (model, dataset, prompt format)."""
    keep = ("block_size", "max_new_tokens", "max_prompts", "max_iters", "seed", "augment_prob", "clean",
            "clean_max_ngram", "clean_max_repeats")
    return {"schema_version": SCHEMA_VERSION, **identity, "eos_ids": sorted(eos_ids),
            **{k: v for k, v in asdict(cfg).items() if k in keep}}


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
    def work(batch: list[Prompt]) -> list[dict]:
        gens = [torch.Generator().manual_seed(cfg.seed * 1_000_003 + p.index) for p in batch]
        results = jacobi_trajectories(cm, [p.ids for p in batch], cfg.block_size, cfg.max_new_tokens, eos_ids,
                                      gens, cfg.max_iters)
        return [_record(cfg, p, r) for p, r in zip(batch, results)]

    return shards.run_stage(prompts, cfg.out_dir, lambda r: prepare_out_dir(cfg, meta, r), rank, world, barrier,
                            cfg.batch_size, work, f"collect[{rank}]", stop_after, lambda out, n: merge(out, expected=n))


def _record(cfg: CollectConfig, p: Prompt, r: dict) -> dict:
    if cfg.augment_prob > 0:
        augment_states(r["blocks"], cfg.augment_prob, random.Random(f"{cfg.seed}-{p.index}-augment"))
    drop = None
    if cfg.clean and has_degenerate_repetition(r["answer_ids"], cfg.clean_max_ngram, cfg.clean_max_repeats):
        drop = "repetition"
    return {"schema_version": SCHEMA_VERSION, "id": p.id, "index": p.index, "prompt_ids": p.ids,
            "answer_ids": r["answer_ids"], "stop_reason": r["stop_reason"], "blocks": r["blocks"],
            "unconverged_blocks": r["unconverged"], "drop_reason": drop}
