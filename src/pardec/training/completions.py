"""The target's own completions: its greedy completions of prompts from several sources; batched, resumable,
shardable (:mod:`pardec.training.stages`). The one corpus every drafter is trained on: the draft kind (distilled
draft models), the drafter kind (Medusa heads, FIRP projections, EAGLE-3, DFlash) and the sdsat kind (a
``{completions: <dir>}`` source of the masked corpus) read it; on held-out prompts the draft and drafter kinds
evaluate on it.

Layout of an output directory (``completions.out_dir``)::

    meta.json           schema_version, model, sources, settings (a resumed run must match it, or only grow it:
                        raise a source's max_prompts or append a source, and only the new prompts are generated)
    part-{rank}.jsonl   the work log of each rank, one record per prompt, appended and fsynced per batch
    completions.jsonl   the merged records of every rank, sorted by index
    stats.json          prompts, tokens, mean length, stop reasons, per source counts, generation seconds

One record (``schema_version`` 1)::

    {"schema_version": 1, "id": "<source>/<doc id>", "source": "gsm8k", "index": 12,  # index: in the prompt list
     "prompt_ids": [...], "completion_ids": [...],     # greedy, up to and including EOS (or max_new_tokens)
     "stop_reason": "eos" | "length", "seconds": 0.8}  # seconds: the record's share of its batch's wall time

With ``teacher_topk: k`` > 0 each record also holds the target's own next-token distribution at every completion
position, read off the logits generation computes anyway (so a draft trained on it needs no teacher forward;
``trainer.teacher: cached`` of the draft kind)::

     "teacher_ids": [[k ids] per completion token],        # the k most likely ids, most likely first
     "teacher_logprobs": [[k log-probs] per completion token]  # log-softmax over the full vocabulary, 4 decimals

Row j is the distribution that produced ``completion_ids[j]`` (its first id is that token: greedy).

Prompts are built as the task builds them for evaluation (chat template for chat models). Rank r of w takes the
prompts with index % w == r (sorted by length within the rank, so batches pad little); rank 0 merges. Greedy
decoding is HF ``generate`` with left padding; rows that stop early are cut at their first EOS.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from pardec.config import DTYPES, ConfigError, DatasetConfig, check_choice, to_dataclass
from pardec.jsonl import read_json, read_jsonl
from pardec.training import stages
from pardec.training.stages import Prompt

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
MERGED = "completions.jsonl"
REQUIRED = ("schema_version", "id", "source", "index", "prompt_ids", "completion_ids", "stop_reason")


@dataclass
class Source:
    dataset: DatasetConfig
    max_prompts: int | None = None  # the first N documents (None: all)


@dataclass
class GenerateConfig:
    max_new_tokens: int = 128
    batch_size: int = 8  # prompts per generate() call
    out_dir: str = "data/completions"
    overwrite: bool = False  # wipe out_dir when its meta.json is from other settings
    sources: list[Source] = field(default_factory=list)
    teacher_topk: int = 0  # > 0: also store the target's top-k log-probs at every completion position
    # the generating target's dtype (null: the run's model.dtype): the target that writes the corpus may run in
    # another precision than the one whose features a drafter trains on (the papers regenerate their data with the
    # target in bf16); the corpus's meta.json records it, so a resumed generation must use the same
    dtype: str | None = None

    def __post_init__(self) -> None:
        for key in ("max_new_tokens", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key}={getattr(self, key)!r} is out of range: it must be >= 1")
        if self.dtype is not None:
            check_choice("completions.dtype", self.dtype, DTYPES)
        if not isinstance(self.teacher_topk, int) or self.teacher_topk < 0:
            raise ConfigError(f"teacher_topk={self.teacher_topk!r} is out of range: it must be an integer >= 0 "
                              "(0: completions only)")


def generate_config(section: dict, where: str) -> GenerateConfig:
    """A :class:`GenerateConfig` from a config section whose ``sources`` is a list of
    ``{dataset: {...DatasetConfig}, max_prompts: N}``; errors name ``where``."""
    section = dict(section)
    raw = section.pop("sources", None) or []
    if not raw:
        raise ConfigError(f"{where}.sources is empty: list at least one {{dataset: {{name: ...}}, max_prompts: N}}")
    sources = []
    for i, s in enumerate(raw):
        if not isinstance(s, dict) or "dataset" not in s or set(s) - {"dataset", "max_prompts"}:
            raise ConfigError(f"{where}.sources[{i}] must be {{dataset: {{name: ...}}, max_prompts: N}}; got {s!r}")
        ds = to_dataclass(DatasetConfig, s["dataset"], f"{where}.sources[{i}].dataset")
        n = s.get("max_prompts")
        if n is not None and n < 1:
            raise ConfigError(f"{where}.sources[{i}].max_prompts={n!r} is out of range: it must be >= 1 or null")
        sources.append(Source(ds, n))
    cfg = to_dataclass(GenerateConfig, section, where)
    cfg.sources = sources
    return cfg


# ------------------------------------------------------------------------------------------- prompts
def source_prompts(sources: list[Source], tokenizer, model_chat: bool) -> list[Prompt]:
    """Every source's first ``max_prompts`` documents as prompt ids, in source order; ids ``<source>/<doc id>``."""
    pairs = [p for s in sources
             for p in stages.dataset_prompts(s.dataset, tokenizer, model_chat, s.max_prompts, f"{s.dataset.name}/")]
    return [Prompt(i, doc_id, ids) for i, (doc_id, ids) in enumerate(pairs)]


def generation_meta(cfg: GenerateConfig, model: dict, eos_ids: set[int]) -> dict:
    """What identifies a generation run (a resumed run must match it)."""
    sources = [{"dataset": asdict(s.dataset), "max_prompts": s.max_prompts} for s in cfg.sources]
    meta = {"schema_version": SCHEMA_VERSION, "model": model, "sources": sources, "eos_ids": sorted(eos_ids),
            "max_new_tokens": cfg.max_new_tokens, "decoding": "greedy"}
    if cfg.teacher_topk:  # absent when off, so corpora generated before the option still resume
        meta["teacher_topk"] = cfg.teacher_topk
    return meta


def with_corpus_topk(cfg: GenerateConfig) -> GenerateConfig:
    """``cfg``, taking the teacher top-k of the corpus already in ``cfg.out_dir`` when it asks for none (and does not
    overwrite): a corpus that cached the target's top-k serves a kind that never reads them (one corpus for every
    drafter: a drafter run on the draft's corpus), and a resumed generation keeps recording them."""
    f = Path(cfg.out_dir) / "meta.json"
    if cfg.teacher_topk or cfg.overwrite or not f.is_file():
        return cfg
    k = read_json(f).get("teacher_topk")
    return replace(cfg, teacher_topk=k) if k else cfg


def grows(old: dict, new: dict) -> bool:
    """Whether the generation settings ``new`` only extend ``old``: the same model and settings, every old source
    kept in place with its ``max_prompts`` raised or unchanged (``null``: all documents), new sources appended.
    A corpus grows in place: its records are kept and only the new prompts are generated (a source's first N
    documents do not depend on N)."""
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))
    a, b = old.pop("sources", []), new.pop("sources", [])
    if old != new or len(b) < len(a) or a == b:
        return False
    for s, t in zip(a, b):
        if s["dataset"] != t["dataset"]:
            return False
        m, n = s.get("max_prompts"), t.get("max_prompts")
        if m is None and n is not None or m is not None and n is not None and n < m:
            return False
    return True


def check_settings(cfg: GenerateConfig, meta: dict, ignore: tuple[str, ...] = ()) -> None:
    """Refuse (before a model loads) an ``out_dir`` generated with other settings, unless ``meta`` only grows it
    (top-level keys in ``ignore`` left out of both)."""
    stages.check_settings(cfg.out_dir, meta, cfg.overwrite, "completions", "completions generated", ignore, grows)


def prepare_out_dir(cfg: GenerateConfig, meta: dict, rank: int = 0, key: str = "completions") -> Path:
    """Create ``out_dir`` with ``meta.json``; an existing one from other settings raises (rank 0 with
    ``overwrite``: the directory is wiped), unless the new settings only grow it (:func:`grows`): then rank 0
    rewrites ``meta.json`` and drops the merged file and stats (stale until the grown corpus is merged).
    ``key``: the config section named in the error."""
    return stages.prepare_out_dir(cfg.out_dir, cfg.overwrite, meta, rank, key, "completions generated", grows,
                                  stale=(MERGED, "stats.json"))


# ------------------------------------------------------------------------------------------- decoding
@torch.inference_mode()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos_ids: set[int], pad_id: int,
                 topk: int = 0) -> list[tuple]:
    """Greedy completions of a left-padded batch: per prompt (ids up to and including the first EOS, reason), and
    with ``topk`` > 0 a third item: (ids [n, k], log-probs [n, k]) of the target's raw next-token distribution at
    each of the n completion positions (generate's unprocessed logits, log-softmax in fp32)."""
    from transformers import GenerationConfig  # heavy: transformers

    ids, att, _ = left_pad(prompts, pad_id)  # [B, P]; att 0 = left padding
    width = ids.shape[1]
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                           eos_token_id=sorted(eos_ids) or None, pad_token_id=pad_id,
                           output_logits=topk > 0, return_dict_in_generate=topk > 0)
    out = model.generate(input_ids=ids.to(model.device), attention_mask=att.to(model.device), generation_config=gen)
    top = None
    if topk:  # out.logits: one [B, V] per step, raw (before any processor); one step at a time to spare memory
        steps = [torch.log_softmax(x.float(), -1).topk(min(topk, x.shape[-1]), -1) for x in out.logits]
        top = (torch.stack([t.indices for t in steps], 1).tolist(),  # [B, S, k]
               torch.stack([t.values for t in steps], 1).cpu().tolist())
        out = out.sequences
    results = []
    for b, row in enumerate(out[:, width:].tolist()):  # [B, <= max_new_tokens]
        stop = next((j for j, t in enumerate(row) if t in eos_ids), None)
        keep, why = (stop + 1, "eos") if stop is not None else (min(len(row), max_new_tokens), "length")
        if top is None:
            results.append((row[:keep], why))
        else:
            results.append((row[:keep], why, (top[0][b][:keep], [[round(x, 4) for x in r] for r in top[1][b][:keep]])))
    return results


def generate(cfg: GenerateConfig, model, pad_id: int, eos_ids: set[int], prompts: list[Prompt], meta: dict,
             rank: int = 0, world: int = 1, barrier: Callable[[], None] | None = None, stop_after: int | None = None,
             key: str = "completions") -> dict | None:
    """Generate this rank's share of ``prompts`` into ``part-{rank}.jsonl``, then (rank 0) merge.

    Prompts already in any part file are skipped (resume). ``stop_after``: write at most that many records, then
    return without merging (simulates a killed run in tests). Returns the stats on rank 0, else None.
    """
    sources = {p.id: p.id.split("/", 1)[0] for p in prompts}

    def work(batch: list[Prompt]) -> list[dict]:
        t0 = time.perf_counter()
        results = greedy_batch(model, [p.ids for p in batch], cfg.max_new_tokens, eos_ids, pad_id,
                               cfg.teacher_topk)
        share = (time.perf_counter() - t0) / len(batch)
        records = []
        for p, (ids, why, *teacher) in zip(batch, results):
            r = {"schema_version": SCHEMA_VERSION, "id": p.id, "source": sources[p.id], "index": p.index,
                 "prompt_ids": p.ids, "completion_ids": ids, "stop_reason": why, "seconds": round(share, 4)}
            if teacher:
                r["teacher_ids"], r["teacher_logprobs"] = teacher[0]
            records.append(r)
        return records

    return stages.run_stage(prompts, cfg.out_dir, lambda r: prepare_out_dir(cfg, meta, r, key), rank, world,
                            barrier, cfg.batch_size, work, f"generate[{rank}] {Path(cfg.out_dir).name}", stop_after,
                            lambda out, n: merge(out, expected=n, index_of={p.id: p.index for p in prompts}),
                            order=lambda p: len(p.ids))


def merge(out_dir: Path, expected: int, index_of: dict[str, int] | None = None) -> dict:
    """Merge every part file into ``completions.jsonl`` (sorted by index; ``index_of``: the index of each id in
    the current prompt list, which a grown corpus renumbers) and write ``stats.json``."""
    return stages.merge(out_dir, MERGED, expected, completion_stats, index_of=index_of)


def completion_stats(records: list[dict], kept: list[dict], expected: int) -> dict:
    lengths = [len(r["completion_ids"]) for r in records]
    return {"schema_version": SCHEMA_VERSION, "prompts": len(records), "expected_prompts": expected,
            "complete": len(records) >= expected, "tokens": sum(lengths),
            "mean_completion_length": sum(lengths) / max(1, len(lengths)),
            "mean_prompt_length": sum(len(r["prompt_ids"]) for r in records) / max(1, len(records)),
            "stop_reasons": dict(Counter(r["stop_reason"] for r in records)),
            "per_source": dict(Counter(r["source"] for r in records)),
            "generation_seconds": round(sum(r.get("seconds", 0.0) for r in records), 1)}


def corpus_share(records: list[dict], fraction: float) -> list[dict]:
    """The first ``ceil(fraction * n)`` records (by prompt index) of each source's n: a smaller corpus with the same
    mix, for studies of how a drafter scales with its data (``draft.corpus_fraction``, ``drafter.corpus_fraction``, the
    sdsat kind's ``{completions: <dir>, fraction: f}`` source)."""
    if fraction >= 1.0:
        return records
    by_source: dict[str, list[dict]] = defaultdict(list)
    for r in sorted(records, key=lambda r: r["index"]):
        by_source[r["source"]].append(r)
    keep = {id(r) for rs in by_source.values() for r in rs[: math.ceil(fraction * len(rs))]}
    return [r for r in records if id(r) in keep]


def check_fraction(value, key: str) -> float:
    """A corpus fraction from the config (``<kind>.corpus_fraction``), checked: in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ConfigError(f"{key}={value!r} is out of range: it must be in (0, 1] (1: the whole corpus)")
    return float(value)


def load_completions(out_dir: str | Path, stage: str = "stage=generate") -> list[dict]:
    """The merged records of ``out_dir``, validated; a missing or unfinished generation names ``stage``."""
    out = Path(out_dir)
    f, stats = out / MERGED, out / "stats.json"
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist; generate the completions first ({stage})")
    if stats.is_file() and not read_json(stats).get("complete", True):
        raise ConfigError(f"{out} holds an unfinished generation ({stats}); finish it first: rerun {stage}")
    records = read_jsonl(f)
    stages.check_records(records, f, REQUIRED, SCHEMA_VERSION, f"generate again ({stage})")
    return records


def run_generation(cfg: GenerateConfig, lm, rank: int, world: int, barrier, key: str = "completions",
                   stop_after: int | None = None) -> dict | None:
    """Prompts of ``cfg.sources`` -> greedy completions of ``lm`` (a LoadedModel) in ``cfg.out_dir``; a resumed
    generation must match the model's whole identity (``ModelConfig.identity``: weights, revision, dtype, ...)."""
    cfg = with_corpus_topk(cfg)
    prompts = source_prompts(cfg.sources, lm.tokenizer, lm.chat)
    eos = lm.eos_ids
    meta = generation_meta(cfg, lm.cfg.identity(), eos)
    log.info("generating greedy completions of %d prompts into %s (rank %d of %d)", len(prompts), cfg.out_dir,
             rank, world)
    return generate(cfg, lm.model, lm.tokenizer.pad_token_id, eos, prompts, meta, rank, world, barrier,
                    stop_after, key)


def generating_model(gen: GenerateConfig, model_cfg):
    """The model config that writes ``gen``'s corpus: ``model_cfg`` at ``gen.dtype`` when one is set."""
    return model_cfg if gen.dtype in (None, model_cfg.dtype) else replace(model_cfg, dtype=gen.dtype)


def generate_stage(gen: GenerateConfig, model_cfg, ranks) -> dict | None:
    """The ``generate`` stage of the draft and drafter kinds: the target's greedy completions of ``gen.sources``
    (``ranks``: this process's :class:`~pardec.config.Ranks`)."""
    from pardec.models.loading import load_model  # heavy: transformers

    barrier = ranks.barrier()  # first: it picks this rank's GPU
    lm = load_model(generating_model(gen, model_cfg))
    stats = run_generation(gen, lm, ranks.rank, ranks.world, barrier)
    if stats:
        log.info("completions: %s", json.dumps(stats))
    return stats


class GeneratesCompletions:
    """The ``generate`` stage of a kind trained on the target's own completions (draft, drafter): a mixin of its
    :class:`~pardec.training.kinds.Kind`, whose spec holds ``gen`` (a :class:`GenerateConfig`)."""

    def stage_generate(self, spec, run_dir: Path, ranks) -> dict | None:
        return generate_stage(spec.gen, spec.model, ranks)


def eval_sources(section: dict) -> list[GenerateConfig]:
    """The ``eval`` generation section of a draft / drafter experiment: one GenerateConfig per held-out source, each
    in its own ``<eval.out_dir>/<dataset>``."""
    eval_all = generate_config(section, "eval")
    if eval_all.dtype is not None:
        raise ConfigError(f"eval.dtype={eval_all.dtype!r} is not an option: held-out completions are the trained run's "
                          "own target's (model.dtype); only completions.dtype sets the corpus's generating dtype")
    return [replace(eval_all, sources=[s], out_dir=str(Path(eval_all.out_dir) / s.dataset.name))
            for s in eval_all.sources]


# ------------------------------------------------------------------------------------------- training samples
class CompletionDataset(torch.utils.data.Dataset):
    """One sample per record: ``prompt + completion[:-1]`` (the last completion token is only a label) and a mask
    of the positions that predict a completion token; longer sequences lose their start (counted). ``teacher``:
    also pass the records' cached teacher (``teacher_ids`` / ``teacher_logprobs``), the rows of the masked positions
    that are kept."""

    def __init__(self, records: list[dict], max_length: int = 1024, teacher: bool = False):
        self.records = [r for r in records if r["completion_ids"]]
        self.max_length = max_length
        self.teacher = teacher
        self.n_truncated = sum(len(r["prompt_ids"]) + len(r["completion_ids"]) - 1 > max_length for r in self.records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        r = self.records[i]
        ids = (r["prompt_ids"] + r["completion_ids"])[:-1]
        mask = [j >= len(r["prompt_ids"]) - 1 for j in range(len(ids))]  # position j predicts token j + 1
        sample = {"input_ids": ids[-self.max_length :], "loss_mask": mask[-self.max_length :]}
        if self.teacher:  # row j predicts completion token j; truncation keeps the last ones
            m = sum(sample["loss_mask"])
            sample["teacher_ids"] = r["teacher_ids"][len(r["teacher_ids"]) - m :]
            sample["teacher_logprobs"] = r["teacher_logprobs"][len(r["teacher_logprobs"]) - m :]
        return sample


@dataclass
class CompletionCollator:
    """Left-pads samples: ``input_ids``, ``attention_mask``, ``position_ids``, ``loss_mask`` (bool), all [B, L].
    Samples with a cached teacher add ``teacher_ids`` (long) and ``teacher_logprobs`` (float), [N, k]: one row per
    True of ``loss_mask``, in row-major order (``x[loss_mask]``'s order)."""

    pad_id: int

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        ids, att, pos = left_pad([s["input_ids"] for s in samples], self.pad_id)
        mask = torch.zeros_like(ids, dtype=torch.bool)
        for i, s in enumerate(samples):
            mask[i, ids.shape[1] - len(s["loss_mask"]) :] = torch.tensor(s["loss_mask"])
        batch = {"input_ids": ids, "attention_mask": att, "position_ids": pos, "loss_mask": mask}
        cached = ["teacher_ids" in s for s in samples]
        if any(cached):
            if not all(cached):
                raise ValueError("a batch mixes records with and without a cached teacher; generate the whole "
                                 "corpus with the same completions.teacher_topk")
            batch["teacher_ids"] = torch.tensor([row for s in samples for row in s["teacher_ids"]], dtype=torch.long)
            batch["teacher_logprobs"] = torch.tensor([row for s in samples for row in s["teacher_logprobs"]],
                                                     dtype=torch.float32)
        return batch


def loss_window(mask: torch.Tensor) -> int:
    """Positions to keep logits for: from the first masked position of any row to the end (left padding)."""
    first = int(mask.float().argmax(-1).masked_fill(~mask.any(-1), mask.shape[1]).min())
    return max(1, mask.shape[1] - first)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, attention mask, position ids), each [N, max len], padded on the left; positions start at 0."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    att = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        att[i, width - len(s) :] = 1
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    return ids, att, pos
