"""SDSAT (Liu et al. 2024) data: the masked corpus the adaptive tokens (:mod:`pardec.models.adaptive`) are trained
on (``stage=mask``); resumable, shardable (:mod:`pardec.training.stages`).

Layout of an output directory (``mask.out_dir``)::

    meta.json           schema_version, model identity, adaptive tokens and ids, masking settings, sources
                        (a resumed run must match it)
    part-{rank}.jsonl   the work log of each rank, one record per sequence, appended and fsynced per batch
    masked.jsonl        the merged records of every rank, sorted by index
    stats.json          records, tokens, eligible and masked positions, windows and their lengths, per source counts

One record (``schema_version`` 2)::

    {"schema_version": 2, "id": "<source>/<doc id>", "source": str, "index": 12,  # index: in the corpus list
     "ids": [...],              # the plain sequence (prompt + completion, or text), cut from the left to max_length
     "start": int,              # first position whose token is a label (completion start; 0 for plain text)
     "masked_ids": [...],       # ids with every masked position replaced by an adaptive id
     "windows": [[s, l], ...],  # the drawn windows (start, length before clipping), in draw order
     "masked": int}             # number of masked positions

Masking (paper Sec. 2.2): the eligible positions are t in [start, n-1) (a masked position t is trained to predict
ids[t+1], so the last position is never masked); m = round(ratio * #eligible) window starts are drawn uniformly
without replacement, each with a length l ~ U{1..L}; a window covers [s, min(s+l, n-1)) and overlapping windows
merge. Identical tokens: every masked position gets adaptive_ids[0]; diverse: position t gets adaptive_ids[t - s]
for the latest-starting window covering t. Each record has its own RNG, ``random.Random(f"{seed}/{id}")``, so
the corpus does not depend on sharding or resumption.

Sources (``mask.sources``), in order: ``{completions: <dir>, fraction: f}`` (a :mod:`pardec.training.completions`
output: prompt + the target's completion, labels from the completion; ``fraction`` < 1 keeps the first fraction of
each of its prompt sources' records, :func:`~pardec.training.completions.corpus_share`, for corpus-size studies),
``{file: <path.jsonl>, max_docs: N}`` (one JSON object per line, ``{"text": ...}`` or ``{"ids": [...], "start":
k}``; ids ``file:<stem>/<line>``) and ``{dataset: {name: ...}, max_docs: N}`` (a task's prompt + its reference
answer, and after a chat prompt the template's end-of-turn token: gsm8k, humaneval; ids ``ref:<task>/<doc id>``).
"""

from __future__ import annotations

import json
import logging
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pardec.config import ConfigError, DatasetConfig, to_dataclass
from pardec.jsonl import read_jsonl, record_at
from pardec.models.adaptive import adaptive_tokens, add_adaptive_tokens
from pardec.tasks.base import TASKS, DataError, Task, build_task, end_of_turn_id, select_docs
from pardec.training import stages
from pardec.training.completions import check_fraction, corpus_share, load_completions

log = logging.getLogger(__name__)

MASK_SCHEMA_VERSION = 2  # of meta.json, the records and stats.json; 2: chat reference answers end their turn
MERGED = "masked.jsonl"
REQUIRED = ("schema_version", "id", "source", "index", "ids", "start", "masked_ids", "windows", "masked")
STAGE = "python -m train +experiment=<name> stage=mask"
SOURCE_FORMS = ("{completions: <dir>, fraction: f}, {file: <path.jsonl>, max_docs: N} or {dataset: {name: ...}, "
                "max_docs: N}")


# ------------------------------------------------------------------------------------------- config
@dataclass
class MaskConfig:
    out_dir: str = "data/sdsat_masked"
    overwrite: bool = False  # wipe out_dir when its meta.json is from other settings
    ratio: float = 0.1  # window starts per eligible position
    max_span: int = 5  # L: window lengths ~ U{1..L}
    diverse: bool = False  # SDSAT-D: one adaptive token per offset in a window
    seed: int = 0
    max_length: int = 1024  # sequences are cut from the left to this many tokens
    batch_size: int = 64  # records per appended batch
    sources: list = field(default_factory=list)  # see SOURCE_FORMS; normalised by parse_sources

    def __post_init__(self) -> None:
        if not (isinstance(self.ratio, (int, float)) and 0.0 < self.ratio <= 1.0):
            raise ConfigError(f"mask.ratio={self.ratio!r} is out of range: it must be in (0, 1]")
        for key, low in (("max_span", 1), ("max_length", 2), ("batch_size", 1), ("seed", None)):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or (low is not None and v < low):
                rule = f"an integer >= {low}" if low is not None else "an integer"
                raise ConfigError(f"mask.{key}={v!r} is out of range: it must be {rule}")
        self.sources = parse_sources(self.sources)


def parse_sources(raw: list, where: str = "mask.sources") -> list[dict]:
    """Validated sources in their normal form (idempotent): ``{"completions": dir}`` (with ``"fraction": f`` when
    f < 1, so the whole corpus keeps the form older ``meta.json`` files recorded), ``{"file": path,
    "max_docs": N | None}`` or ``{"dataset": {every DatasetConfig field}, "max_docs": N | None}``."""
    return [_source(s, f"{where}[{i}]") for i, s in enumerate(raw or [])]


def _source(s, where: str) -> dict:
    kinds = [k for k in ("completions", "file", "dataset") if isinstance(s, dict) and k in s]
    allowed = {"completions": {"completions", "fraction"}, "file": {"file", "max_docs"},
               "dataset": {"dataset", "max_docs"}}
    if len(kinds) != 1 or set(s) - allowed[kinds[0]]:
        raise ConfigError(f"{where} must be one of {SOURCE_FORMS}; got {s!r}")
    kind = kinds[0]
    if kind == "completions":
        if not isinstance(s["completions"], str):
            raise ConfigError(f"{where}.completions={s['completions']!r} must be a directory path")
        fraction = check_fraction(s.get("fraction", 1.0), f"{where}.fraction")
        return {"completions": s["completions"]} | ({"fraction": fraction} if fraction < 1.0 else {})
    n = s.get("max_docs")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ConfigError(f"{where}.max_docs={n!r} is out of range: it must be an integer >= 1 or null")
    if kind == "file":
        if not isinstance(s["file"], str):
            raise ConfigError(f"{where}.file={s['file']!r} must be a path to a .jsonl file")
        return {"file": s["file"], "max_docs": n}
    return {"dataset": asdict(to_dataclass(DatasetConfig, s["dataset"], f"{where}.dataset")), "max_docs": n}


# ------------------------------------------------------------------------------------------- corpus
@dataclass
class CorpusRecord:
    index: int  # position in the corpus: sharding key and sort key
    id: str  # "<source>/<doc id>"
    source: str
    ids: list[int]
    start: int  # first label position


def corpus_records(sources: list, tokenizer, chat: bool, max_length: int | None = None) -> list[CorpusRecord]:
    """Every source's sequences, in source order (ids unique across sources), each cut from the left to
    ``max_length`` tokens when given. ``chat``: the model's prompt style (a dataset's ``prompt_style=auto``)."""
    out: list[CorpusRecord] = []
    first: dict[str, int] = {}
    for i, src in enumerate(parse_sources(sources)):
        where = f"mask.sources[{i}]"
        if "completions" in src:
            docs = _completion_docs(src["completions"], src.get("fraction", 1.0))
        elif "file" in src:
            docs = _file_docs(src["file"], src["max_docs"], tokenizer)
        else:
            docs = _dataset_docs(src["dataset"], src["max_docs"], tokenizer, chat, where)
        for rid, source, ids, start in docs:
            if rid in first:
                raise ConfigError(f"{where} repeats id {rid!r} of mask.sources[{first[rid]}]; list each corpus once")
            first[rid] = i
            ids, start = cut(ids, start, max_length)
            out.append(CorpusRecord(len(out), rid, source, ids, start))
    return out


def cut(ids: list[int], start: int, max_length: int | None) -> tuple[list[int], int]:
    """``ids`` cut from the left to ``max_length`` tokens (None: whole), and ``start`` moved with them (>= 0)."""
    drop = max(0, len(ids) - max_length) if max_length else 0
    return ids[drop:], max(0, start - drop)


Doc = tuple[str, str, list[int], int]  # (id, source, ids, start)


def _completion_docs(out_dir: str, fraction: float = 1.0) -> list[Doc]:
    return [(r["id"], r["source"], r["prompt_ids"] + r["completion_ids"], len(r["prompt_ids"]))
            for r in corpus_share(load_completions(out_dir), fraction)]


def _file_docs(path: str, max_docs: int | None, tokenizer) -> list[Doc]:
    """Records of a JSONL file: ``{"text": str}`` (tokenized without special tokens) or ``{"ids": [...],
    "start": k}``; id ``file:<stem>/<n>`` with n the record's 1-based number (its line, without blank lines)."""
    source = f"file:{Path(path).stem}"

    docs = []
    rows = read_jsonl(path, error=DataError)
    for n, r in enumerate(rows[:max_docs], 1):
        text, ids = (r.get("text"), r.get("ids")) if isinstance(r, dict) else (None, None)
        start = r.get("start", 0) if isinstance(r, dict) else 0
        if isinstance(text, str) and ids is None and "start" not in r:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        elif not (text is None and isinstance(ids, list) and all(isinstance(t, int) for t in ids)
                  and isinstance(start, int) and 0 <= start <= len(ids)):
            raise DataError(f"{record_at(rows, n - 1, path)}: need {{\"text\": str}} or {{\"ids\": [int, ...], \"start\": k}} "
                            f"with 0 <= k <= len(ids); got {str(r)[:80]}")
        docs.append((f"{source}/{n}", source, list(ids), start))
    return docs


def _dataset_docs(dataset: dict, max_docs: int | None, tokenizer, chat: bool, where: str) -> list[Doc]:
    """A task's documents as its prompt (as built for evaluation) + its reference answer; a chat prompt's answer
    ends with the template's end-of-turn token, as the model's own completions do when it stops (schema 2: schema 1
    left it out, so the human answers never trained an ending and the model learnt to go on after one)."""
    cfg = DatasetConfig(**dataset)
    task = build_task(cfg)
    if type(task).reference_answer is Task.reference_answer:
        with_refs = sorted(n for n in TASKS.names() if TASKS.get(n).reference_answer is not Task.reference_answer)
        raise ConfigError(f"{where}.dataset.name={dataset['name']!r} has no reference answers to mask; valid: "
                          f"{', '.join(with_refs)} (or a {{completions: <dir>}} or {{file: <path.jsonl>}} source)")
    chat = cfg.use_chat(chat)
    source = f"ref:{task.name}"
    eot = end_of_turn_id(tokenizer) if chat else None
    end = [] if eot is None else [eot]
    docs = []
    for d in select_docs(task, max_docs):
        prompt = list(task.prompt_ids(d, tokenizer, chat))
        ids = tokenizer(task.reference_answer(d, chat), add_special_tokens=False)["input_ids"] + end
        docs.append((f"{source}/{d['id']}", source, prompt + ids, len(prompt)))
    return docs


# ------------------------------------------------------------------------------------------- masking
def mask_windows(n: int, start: int, ratio: float, max_span: int, rng: random.Random) -> list[tuple[int, int]]:
    """Windows (s, l) for a sequence of ``n`` tokens: round(ratio * #eligible) starts drawn without replacement from
    the eligible positions [start, n-1), then one length l ~ U{1..max_span} per start; in draw order."""
    eligible = range(max(0, start), max(0, n - 1))
    starts = rng.sample(eligible, round(ratio * len(eligible)))
    return [(s, rng.randint(1, max_span)) for s in starts]


def apply_mask(ids: list[int], windows: list[tuple[int, int]], start: int, adaptive_ids: list[int],
               diverse: bool) -> tuple[list[int], int]:
    """(``ids`` with each window's positions [s, min(s+l, n-1)) replaced by an adaptive id, masked count).
    Identical: adaptive_ids[0]; diverse: adaptive_ids[t - s] of the latest-starting window covering t."""
    n = len(ids)
    offset: dict[int, int] = {}  # masked position -> offset in its latest-starting window
    for s, length in sorted(windows):
        if not start <= s < n - 1:
            raise ValueError(f"window ({s}, {length}) starts outside the eligible positions [{start}, {n - 1})")
        for t in range(s, min(s + length, n - 1)):
            offset[t] = t - s
    masked = list(ids)
    for t, j in offset.items():
        if diverse and j >= len(adaptive_ids):
            raise ValueError(f"window offset {j} needs adaptive id {j + 1} of {len(adaptive_ids)}")
        masked[t] = adaptive_ids[j if diverse else 0]
    return masked, len(offset)


def mask_record(rec: CorpusRecord, cfg: MaskConfig, adaptive_ids: list[int]) -> dict:
    """The masked record of ``rec`` (schema in the module docstring), with its own seeded RNG."""
    rng = random.Random(f"{cfg.seed}/{rec.id}")
    windows = mask_windows(len(rec.ids), rec.start, cfg.ratio, cfg.max_span, rng)
    masked_ids, masked = apply_mask(rec.ids, windows, rec.start, adaptive_ids, cfg.diverse)
    return {"schema_version": MASK_SCHEMA_VERSION, "id": rec.id, "source": rec.source, "index": rec.index,
            "ids": rec.ids, "start": rec.start, "masked_ids": masked_ids, "windows": [list(w) for w in windows],
            "masked": masked}


# ------------------------------------------------------------------------------------------- stage
def mask_meta(cfg: MaskConfig, identity: dict, adaptive_tokens: list[str], adaptive_ids: list[int]) -> dict:
    """What identifies a masked corpus (a resumed run must match it); ``identity``: the model's / tokenizer's."""
    return {"schema_version": MASK_SCHEMA_VERSION, "model": identity, "adaptive_tokens": list(adaptive_tokens),
            "adaptive_ids": list(adaptive_ids), "ratio": cfg.ratio, "max_span": cfg.max_span,
            "diverse": cfg.diverse, "seed": cfg.seed, "max_length": cfg.max_length,
            "sources": parse_sources(cfg.sources)}


def run_masking(cfg: MaskConfig, tokenizer, identity: dict, rank: int = 0, world: int = 1,
                barrier: Callable[[], None] | None = None, stop_after: int | None = None,
                chat: bool = True) -> dict | None:
    """Build the masked corpus of ``cfg.sources`` in ``cfg.out_dir``: this rank's share (index % world == rank)
    into ``part-{rank}.jsonl``, then (rank 0) the merge. Adds the adaptive tokens to ``tokenizer``.

    Records already in any part file are skipped (resume). ``stop_after``: write at most that many records, then
    return without merging (a simulated kill in tests). Returns the stats on rank 0, else None."""
    if not cfg.sources:
        raise ConfigError(f"mask.sources is empty: list at least one of {SOURCE_FORMS}")
    records = corpus_records(cfg.sources, tokenizer, chat, cfg.max_length)
    tokens = adaptive_tokens(cfg.max_span, cfg.diverse)
    ids = add_adaptive_tokens(tokenizer, tokens)
    meta = mask_meta(cfg, identity, tokens, ids)
    log.info("masking %d sequences into %s (rank %d of %d)", len(records), cfg.out_dir, rank, world)

    def work(batch: list[CorpusRecord]) -> list[dict]:
        return [mask_record(r, cfg, ids) for r in batch]

    return stages.run_stage(records, cfg.out_dir, lambda r: _prepare(cfg, meta, r), rank, world, barrier,
                            cfg.batch_size, work, f"mask[{rank}] {Path(cfg.out_dir).name}", stop_after,
                            lambda out, n: merge(out, expected=n))


def _prepare(cfg: MaskConfig, meta: dict, rank: int) -> Path:
    return stages.prepare_out_dir(cfg.out_dir, cfg.overwrite, meta, rank, "mask", "a masked corpus")


def merge(out_dir: Path, expected: int) -> dict:
    """Merge every part file into ``masked.jsonl`` (sorted by index, one record per id) and write ``stats.json``."""
    return stages.merge(out_dir, MERGED, expected, lambda records, kept, n: mask_stats(records, n))


def mask_stats(records: list[dict], expected: int) -> dict:
    """Counts over masked records: tokens, eligible / masked positions, windows and their drawn lengths."""
    eligible = sum(max(0, len(r["ids"]) - 1 - r["start"]) for r in records)
    masked = sum(r["masked"] for r in records)
    lengths = Counter(length for r in records for _, length in r["windows"])
    windows = sum(lengths.values())
    return {"schema_version": MASK_SCHEMA_VERSION, "records": len(records), "expected": expected,
            "complete": len(records) >= expected, "tokens": sum(len(r["ids"]) for r in records),
            "eligible_positions": eligible, "masked_positions": masked,
            "masked_fraction": masked / eligible if eligible else 0.0, "windows": windows,
            "mean_window_length": sum(k * v for k, v in lengths.items()) / windows if windows else 0.0,
            "window_length_histogram": {str(k): lengths[k] for k in sorted(lengths)},
            "per_source": dict(Counter(r["source"] for r in records))}


# ------------------------------------------------------------------------------------------- reading
def check_masked_dir(out_dir: str | Path, stage: str = STAGE) -> dict:
    """The ``meta.json`` of a finished masked corpus, reading only meta.json and stats.json (cheap: before any
    model loads). Raises one line when either is missing, of another schema_version, or unfinished."""
    out = Path(out_dir)
    docs = {}
    for name in ("meta.json", "stats.json"):
        f = out / name
        if not f.is_file():
            raise FileNotFoundError(f"{f} does not exist; build the masked corpus first: run `{stage}`")
        docs[name] = json.loads(f.read_text())
        _check_version(docs[name].get("schema_version"), str(f))
    if not docs["stats.json"].get("complete"):
        raise ConfigError(f"{out} holds an unfinished masked corpus ({out / 'stats.json'}); finish it first: "
                          f"rerun `{stage}`")
    return docs["meta.json"]


def load_masked(out_dir: str | Path, stage: str = STAGE) -> tuple[dict, list[dict]]:
    """(meta, records) of a finished masked corpus, validated; errors are one line naming the file and ``stage``."""
    meta = check_masked_dir(out_dir, stage)
    f = Path(out_dir) / MERGED
    if not f.is_file():
        raise FileNotFoundError(f"{f} does not exist; build the masked corpus first: run `{stage}`")
    records = read_jsonl(f)
    stages.check_records(records, f, REQUIRED, MASK_SCHEMA_VERSION, REMASK)
    return meta, records


REMASK = "regenerate it with stage=mask (mask.overwrite=true)"


def _check_version(version, where: str) -> None:
    if version != MASK_SCHEMA_VERSION:
        raise ValueError(stages.version_error(where, version, MASK_SCHEMA_VERSION, REMASK))
