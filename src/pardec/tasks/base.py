"""The task seam: a benchmark is a registered :class:`Task`.

A task loads its documents (HF hub by default, a local file via ``dataset.path`` always possible), builds
the prompt for each turn (chat template for chat models, plain text for base models), names its stop
strings, scores a document's completions and aggregates the scores. Like lm-evaluation-harness tasks,
but small.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import huggingface_hub.constants

from pardec import hub
from pardec.config import DatasetConfig
from pardec.jsonl import read_jsonl as _read_jsonl
from pardec.metrics.sandbox import check_programs
from pardec.registry import Registry


class DataError(ValueError):
    """A dataset cannot be read; the message names the file/line or the override to pass."""


class Task:
    name: ClassVar[str] = ""
    #: key of the headline metric in :meth:`aggregate`'s output
    metric: ClassVar[str] = "score"
    higher_is_better: ClassVar[bool] = True
    #: conversation turns per document (MT-Bench: 2); turn k is conditioned on the method's own answers
    n_turns: ClassVar[int] = 1
    #: whether scoring runs model output (code, SQL) in :mod:`pardec.metrics.sandbox`: summary.json then says which
    #: isolation ran (``sandbox``)
    sandboxed: ClassVar[bool] = False

    def __init__(self, cfg: DatasetConfig, timeout_s: float = 10.0):
        self.cfg = cfg
        self.timeout_s = timeout_s

    # -- documents ---------------------------------------------------------------------------
    def docs(self) -> list[dict]:
        """Every document, each with a unique string ``id``, in a fixed order."""
        raise NotImplementedError

    # -- prompting ---------------------------------------------------------------------------
    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        """Token ids of the prompt for turn ``len(history)``; ``history`` holds earlier answers."""
        raise NotImplementedError

    def stop_strings(self, chat: bool) -> list[str]:
        return []

    def reference_answer(self, doc: dict, chat: bool) -> str | None:
        """The document's reference answer as text continuing its prompt (chat or base), or None when the task
        has none (e.g. a corpus to train on human text: the sdsat kind's ``{dataset: ...}`` sources)."""
        return None

    # -- scoring -----------------------------------------------------------------------------
    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        """Per-document scores, e.g. ``{"pass": 1.0}``; a value may be None (not computed)."""
        raise NotImplementedError

    def check_sandbox(self) -> None:
        """For a ``sandboxed`` task: raise :class:`~pardec.metrics.sandbox.SandboxError` (one line naming the cause)
        unless the sandbox its scorer uses runs a known-good program and fails a known-bad one (the canary, once per
        process and configuration; see :mod:`pardec.metrics.sandbox`). Evaluate calls it before any model loads, a
        sandboxed task's :meth:`score` before it scores. Here: :func:`~pardec.metrics.sandbox.run_program`'s canary;
        nothing for a task that runs no model output."""
        if self.sandboxed:
            check_programs()

    def aggregate(self, scores: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean of every numeric key over the documents where it is not None (None if never computed)."""
        keys = sorted({k for s in scores for k in s})
        out: dict[str, Any] = {}
        for k in keys:
            vals = [float(s[k]) for s in scores if isinstance(s.get(k), (int, float))]  # bool counts as 0/1
            vals = [v for v in vals if not math.isnan(v)]
            out[k] = sum(vals) / len(vals) if vals else None
            out[f"{k}_n"] = len(vals)
        return out


TASKS: Registry[type[Task]] = Registry("dataset")


def register_task(name: str, *, aliases: tuple[str, ...] = ()):
    def deco(cls: type[Task]) -> type[Task]:
        cls.name = name
        return TASKS.register(name, aliases=aliases)(cls)

    return deco


def build_task(cfg: DatasetConfig, timeout_s: float = 10.0) -> Task:
    """The registered task ``cfg.name`` (importing this module ran :mod:`pardec.tasks`, which registers the built-in
    tasks)."""
    return TASKS.get(cfg.name)(cfg, timeout_s=timeout_s)


# ------------------------------------------------------------------------------- helpers
def read_jsonl(path: str | Path) -> list[dict]:
    """Records of a JSONL file; a malformed line raises :class:`DataError` naming the file and the line."""
    return _read_jsonl(path, error=DataError)


def load_hub(hub_id: str, config: str | None, split: str, task: str) -> list[dict]:
    """Rows of a Hugging Face hub dataset. Offline (``HF_DATASETS_OFFLINE`` / ``HF_HUB_OFFLINE`` set, or the hub not
    reachable) only the local cache is read, so a dataset that is not cached fails in seconds, not after ~30 s of
    retries; every failure is one line naming the dataset and the way out (``dataset.path=<file>``)."""
    var = hub.offline_var(hub.DATASET_OFFLINE_VARS)
    offline = f"offline mode is on ({var})" if var else None
    if offline is None and not hub.hub_reachable():
        offline = "the Hugging Face hub cannot be reached (no network)"
    try:
        with _datasets_offline(offline is not None):
            import datasets  # heavy: datasets

            ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as e:  # network, auth, missing split: all end the same way for the user
        detail = " ".join(f"{type(e).__name__}: {e}".split())[:300]  # one line, whatever the library wrote
        why = (f": {offline}, so only the local Hugging Face cache was read ({detail})" if offline
               else f" from the Hugging Face hub: {detail}")
        raise DataError(
            f"could not load dataset {hub_id!r} (config {config!r}, split {split!r}){why}. Pass a local copy: "
            f"dataset.path=<file> (see conf/dataset/{task}.yaml for the expected fields)"
        ) from None
    return [dict(r) for r in ds]


@contextmanager
def _datasets_offline(on: bool) -> Iterator[None]:
    """Within: ``datasets`` and ``huggingface_hub`` in offline mode (cache only), whatever they read from the
    environment when they were imported."""
    if not on:
        yield
        return
    import datasets.config  # heavy: datasets

    flags = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
             (huggingface_hub.constants, "HF_HUB_OFFLINE")]
    saved = [getattr(mod, name) for mod, name in flags]
    for mod, name in flags:
        setattr(mod, name, True)
    try:
        yield
    finally:
        for (mod, name), value in zip(flags, saved):
            setattr(mod, name, value)


def select_docs(task: Task, limit: int | None = None) -> list[dict]:
    """The first ``limit`` documents of ``task`` (all: None); a dataset without any is a :class:`DataError`
    naming where they were read from."""
    docs = task.docs()
    if not docs:
        cfg = task.cfg
        source = (f"dataset.path={cfg.path}" if cfg.path else f"dataset.hub_id={cfg.hub_id}" if cfg.hub_id
                  else f"its default source (conf/dataset/{task.name}.yaml)")
        raise DataError(f"dataset {task.name!r} has no documents: {source} holds no usable records; "
                        f"pass a non-empty dataset.path=<file>")
    return docs[:limit] if limit else docs


def chat_ids(tokenizer, messages: list[dict], assistant_prefix: str = "") -> list[int]:
    """Chat-template prompt ids, generation prompt added, optionally starting the assistant's answer."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text + assistant_prefix, add_special_tokens=False)["input_ids"]


def end_of_turn_id(tokenizer) -> int | None:
    """The id with which the chat template ends an assistant turn (what a chat model emits to stop, e.g. SmolLM2's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``): the first special token the template renders after an assistant
    message; the tokenizer's EOS when it renders none."""
    mark = "\u2063PARDEC\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": mark}],
                                         tokenize=False)
    after = text[text.rindex(mark) + len(mark):] if mark in text else ""
    special = set(tokenizer.all_special_ids)
    for i in tokenizer(after, add_special_tokens=False)["input_ids"] if after else []:
        if i in special:
            return i
    return tokenizer.eos_token_id


def text_ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text)["input_ids"]
