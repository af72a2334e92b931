"""The teacher answer of the AR row: the collected answer, extended to the teacher's whole greedy answer.

CLLM's AR loss (Eq. 6) is on the target's generation l of a prompt: its whole answer. The official data carry it
as ``complete_teacher_output_ids`` (cllm/utils.py, ``jacobian_generated_data_postprocessed``: the teacher output of
the prompt's last Jacobi iteration, up to EOS or ``--max_new_seq_len``), and the official trainer's AR loss runs on
a whole answer (``labels_ids``, or the teacher output). A collection that stops at ``collect.max_new_tokens``
before the answer ends (the CPU recipe collects 3 blocks of 16 tokens) holds only the start of each answer; an AR
loss on it never sees the teacher's EOS nor anything past the collected blocks.

``ar_answer`` (an experiment key, :data:`AR_ANSWERS`):

* ``whole`` (the default, the paper's): the AR row's answer is the teacher's whole greedy answer, up to its EOS or
  ``completions.max_new_tokens``. Where the collection stopped short of it (a record with ``stop_reason ==
  "length"`` and fewer than ``completions.max_new_tokens`` answer tokens) the rest comes from the teacher's own
  greedy completion of the same prompt in the completions corpus (:mod:`pardec.training.completions`, directory
  ``completions.out_dir``, written by the kind's ``generate`` stage; resumable and sharded like every stage),
  matched to the record by its prompt token ids. Where nothing stopped short (``completions.max_new_tokens <=
  collect.max_new_tokens``, as in the paper-scale experiments) no corpus is generated or read;
* ``collected``: the collected answer only (pardec's earlier recipe; an ablation).

Matching rules (:func:`extend_answers`), so that nothing is corrupted silently:

* the collected answer always wins: a completion's tokens past it are appended only when completion and collected
  answer agree on their common prefix. Batched greedy decoding in two different programs (the Jacobi collector's
  cache, HF ``generate`` with left padding) can flip a near-tie; such a record keeps its collected answer, is
  counted as ``mismatched`` (with the first divergent position) and a warning names how many;
* a record that stopped short but whose prompt is not in the corpus is an error (the corpus must cover the
  collection: same dataset, ``max_prompts`` at least the collection's);
* corpus and collection must come from the same teacher: their ``meta.json`` ``model`` identities (all but
  ``device``, ``device_map`` and ``attn_implementation``, which change only numerics, which the prefix rule
  handles) and EOS ids must agree;
* with ``ar_clean`` (an experiment key; default ``collect.clean``) the collection's repetition rule
  (``collect.clean_max_ngram``, ``collect.clean_max_repeats``) is applied to the whole answer too: a record whose
  whole answer loops is left out of training (counted as ``dropped_repetition``). ``ar_clean: false`` with
  ``collect.clean: true`` keeps those records (their collected blocks passed the rule) with their looping whole
  answers, without changing the collection's settings.

The whole answer goes into each record as ``ar_answer_ids`` (in memory only: neither file changes), read by
:class:`~pardec.training.cllm.data.TrajectoryDataset` (the AR row; ``answer_ids`` still bounds the consistency
positions); the counts go into the train stage's summary under ``ar_answers``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pardec.config import ConfigError, check_choice, settings_diff
from pardec.training.cllm.augment import has_degenerate_repetition
from pardec.training.completions import load_completions

log = logging.getLogger(__name__)

#: values of the ``ar_answer`` key (module docstring)
AR_ANSWERS = ("whole", "collected")
#: model identity fields that change only the numerics of a teacher, not which teacher it is
_NUMERICS_ONLY = ("device", "device_map", "attn_implementation")


def check_ar_answer(value: object, key: str = "ar_answer") -> str:
    check_choice(key, value, AR_ANSWERS)
    return value  # type: ignore[return-value]


def stops_short(rec: dict, cap: int) -> bool:
    """Whether the record's collected answer ends before the teacher's whole answer can (no EOS, under ``cap``)."""
    return rec.get("stop_reason") != "eos" and len(rec["answer_ids"]) < cap


def extend_answers(records: list[dict], completions: list[dict], cap: int,
                   repeats: tuple[int, int] | None = None) -> tuple[list[dict], dict]:
    """Set ``ar_answer_ids`` of every record (the rules in the module docstring): the records to train on (those
    whose whole answer loops left out when ``repeats`` = (max n-gram, max repeats) is given) and the counts.
    ``completions``: corpus records (``prompt_ids``, ``completion_ids``, ``stop_reason``); ``cap``: the answer cap
    (``completions.max_new_tokens``); records that do not stop short of it are kept as collected."""
    by_prompt: dict[tuple[int, ...], dict] = {}
    for c in completions:
        by_prompt.setdefault(tuple(c["prompt_ids"]), c)
    kept: list[dict] = []
    missing: list[str] = []
    mismatched: list[tuple[str, int]] = []  # (record id, first divergent answer position)
    short = extended = eos = dropped = 0
    for rec in records:
        answer = rec["answer_ids"]
        whole, stop = answer, rec.get("stop_reason")
        comp = by_prompt.get(tuple(rec["prompt_ids"]))
        c = comp["completion_ids"] if comp is not None else []
        diverge = next((k for k in range(min(len(c), len(answer))) if c[k] != answer[k]), None)
        if diverge is not None:
            mismatched.append((rec["id"], diverge))
        if stops_short(rec, cap):
            short += 1
            if comp is None:
                missing.append(rec["id"])
                continue
            if diverge is None and len(c) > len(answer):
                whole, stop = answer + c[len(answer):], comp["stop_reason"]
                extended += 1
        if repeats is not None and whole is not answer and has_degenerate_repetition(whole, *repeats):
            dropped += 1
            continue
        eos += stop == "eos"
        kept.append({**rec, "ar_answer_ids": whole})
    if missing:
        raise ConfigError(f"{len(missing)} of {short} trajectory records that stop short of "
                          f"completions.max_new_tokens={cap} have no completion of their prompt in the corpus (first "
                          f"ids: {', '.join(missing[:3])}): generate it for the collection's prompts (stage=generate, "
                          f"completions.sources = the collection's dataset and max_prompts) or set "
                          f"ar_answer=collected")
    if mismatched:
        log.warning("%d of %d trajectory records disagree with the teacher's completion of their prompt (first: %s at "
                    "answer position %d); they keep their collected answer (not extended)", len(mismatched),
                    len(records), mismatched[0][0], mismatched[0][1])
    stats = {"ar_answer": "whole", "records": len(records), "stopped_short": short, "extended": extended,
             "mismatched": len(mismatched), "mismatched_first": [f"{i}@{k}" for i, k in mismatched[:5]],
             "dropped_repetition": dropped, "ending_with_eos": eos,
             "collected_tokens": sum(len(r["answer_ids"]) for r in kept),
             "ar_tokens": sum(len(r["ar_answer_ids"]) for r in kept)}
    return kept, stats


def check_same_teacher(trajectories: Path, corpus: Path) -> None:
    """The two directories' ``meta.json`` name the same teacher (model identity but its numerics-only fields, EOS
    ids); raises ConfigError naming both directories and the differences. Skipped where a meta.json is missing."""
    a, b = trajectories / "meta.json", corpus / "meta.json"
    if not (a.is_file() and b.is_file()):
        return
    ma, mb = json.loads(a.read_text()), json.loads(b.read_text())
    strip = lambda m: {k: v for k, v in (m.get("model") or {}).items() if k not in _NUMERICS_ONLY}  # noqa: E731
    diff = settings_diff({"model": strip(ma), "eos_ids": ma.get("eos_ids")},
                         {"model": strip(mb), "eos_ids": mb.get("eos_ids")})
    if diff:
        raise ConfigError(f"the completions in {corpus} are not of the teacher that collected {trajectories} "
                          f"(collection -> completions: {'; '.join(diff)}); generate them with the same model "
                          f"(stage=generate) or set ar_answer=collected")


def whole_answers(records: list[dict], train_data: Path, corpus: str | Path, cap: int,
                  repeats: tuple[int, int] | None = None) -> tuple[list[dict], dict]:
    """``ar_answer=whole`` for the train stage: the records with ``ar_answer_ids`` and the counts
    (:func:`extend_answers`); the corpus in ``corpus`` is read only when some record stops short of ``cap``."""
    if not any(stops_short(r, cap) for r in records):
        return extend_answers(records, [], cap, repeats)
    corpus = Path(corpus)
    check_same_teacher(Path(train_data), corpus)
    return extend_answers(records, load_completions(corpus, "stage=generate"), cap, repeats)
