"""GSM8K (Cobbe et al. 2021): grade-school math word problems, scored by the final number (accuracy).

Documents: hub ``openai/gsm8k`` (config ``main``, split ``dataset.split``) or a local JSONL file
``dataset.path`` with fields ``question`` and ``answer`` (the gold solution, ending "#### <number>").
Options in ``dataset.extra``: ``num_fewshot`` (default 0), ``fewshot_seed`` (1234) and ``train_path``
(local JSONL of the train split the exemplars are drawn from; default: the hub's train split).
"""

from __future__ import annotations

import math
import random
import re
from functools import cached_property
from typing import Any

from pardec.config import ConfigError, DatasetConfig
from pardec.jsonl import record_at
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
EXTRA_KEYS = ("num_fewshot", "fewshot_seed", "train_path")
INSTRUCTION = 'Solve the problem step by step. End your answer with a last line of the form "#### <number>".'
BASE_STOP = ["\n\nQuestion:", "Question:"]

# a number: optional sign (not a hyphen between words/digits), optional $, thousands commas, decimals
_NUMBER = re.compile(r"(?<![\w.])-?\$?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\$?\.\d+")
_MARKERS = (re.compile(r"####"), re.compile(r"\banswer is\b", re.IGNORECASE))
_CALCULATOR = re.compile(r"<<[^>]*>>")  # GSM8K's calculator annotations, e.g. "<<48/2=24>>"


def extract_answer(text: str) -> str | None:
    """The final number of a solution, normalised ("1,234" -> "1234", "$18." -> "18"), or None.

    Preference: the first number after the last "####", else after the last "answer is" (as in
    "The answer is 42."), else the last number in the text.
    """
    text = text.replace("\u2212", "-")  # unicode minus
    for marker in _MARKERS:
        hits = list(marker.finditer(text))
        if hits:
            m = _NUMBER.search(text, hits[-1].end())
            if m:
                return _normalise(m.group())
    numbers = _NUMBER.findall(text)
    return _normalise(numbers[-1]) if numbers else None


def _normalise(number: str) -> str:
    return number.replace("$", "").replace(",", "").rstrip(".")


def same_number(a: str, b: str) -> bool:
    """Numeric equality of two normalised numbers ("18.00" == "18")."""
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-6)


def reference(answer: str) -> str | None:
    """The gold number: the one after "####" in a GSM8K solution (None if there is none)."""
    hits = list(_MARKERS[0].finditer(answer))
    m = _NUMBER.search(answer, hits[-1].end()) if hits else None
    return _normalise(m.group()) if m else None


@register_task("gsm8k")
class GSM8K(Task):
    metric = "correct"

    def __init__(self, cfg: DatasetConfig, timeout_s: float = 10.0):
        super().__init__(cfg, timeout_s)
        unknown = sorted(set(cfg.extra) - set(EXTRA_KEYS))
        if unknown:
            raise ConfigError(f"unknown dataset.extra key(s) {unknown} for gsm8k; valid: {', '.join(EXTRA_KEYS)}")
        self.num_fewshot = cfg.extra.get("num_fewshot", 0)
        self.fewshot_seed = cfg.extra.get("fewshot_seed", 1234)
        if not isinstance(self.num_fewshot, int) or self.num_fewshot < 0:
            raise ConfigError(f"dataset.extra.num_fewshot={self.num_fewshot!r} must be an integer >= 0")

    # -- documents ---------------------------------------------------------------------------
    def docs(self) -> list[dict]:
        """``{"id": "gsm8k/<split>/<index>", "question", "answer", "reference"}`` per problem."""
        split = self.cfg.split
        if self.cfg.path:
            rows, where = read_jsonl(self.cfg.path), self.cfg.path
        else:
            hub_id, hub_config = self.cfg.hub_id or HUB_ID, self.cfg.hub_config or HUB_CONFIG
            rows, where = load_hub(hub_id, hub_config, split, self.name), f"{hub_id} ({split})"
        return [{"id": f"gsm8k/{split}/{i}", **r} for i, r in enumerate(_checked(rows, where))]

    @cached_property
    def train(self) -> list[dict]:
        """The rows few-shot exemplars are drawn from (``extra.train_path``, else the hub's train split)."""
        path = self.cfg.extra.get("train_path")
        if path:
            return _checked(read_jsonl(path), path)
        hub_id, hub_config = self.cfg.hub_id or HUB_ID, self.cfg.hub_config or HUB_CONFIG
        return _checked(load_hub(hub_id, hub_config, "train", self.name), f"{hub_id} (train)")

    @cached_property
    def _train_by_question(self) -> dict[str, set[int]]:
        index: dict[str, set[int]] = {}
        for i, r in enumerate(self.train):
            index.setdefault(r["question"].strip(), set()).add(i)
        return index

    def fewshot(self, doc: dict) -> list[dict]:
        """``num_fewshot`` train rows for ``doc``: seeded by (fewshot_seed, doc id), never the doc itself."""
        k = self.num_fewshot
        if k == 0:
            return []
        excluded = self._train_by_question.get(doc["question"].strip(), set())
        if k + len(excluded) > len(self.train):
            raise DataError(f"gsm8k: num_fewshot={k} but the train split has only "
                            f"{len(self.train) - len(excluded)} exemplars other than doc {doc['id']}")
        rng = random.Random(f"{self.fewshot_seed}/{doc['id']}")
        picks = rng.sample(range(len(self.train)), k + len(excluded))
        return [self.train[i] for i in picks if i not in excluded][:k]

    # -- prompting ---------------------------------------------------------------------------
    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        """Chat: exemplars as earlier user/assistant turns. Base: "Question: ...\\nAnswer: ..." blocks."""
        if history:
            raise ValueError(f"gsm8k has one turn; got a history of {len(history)} answer(s)")
        shots = self.fewshot(doc)
        if chat:
            messages = []
            for s in shots:
                messages += [{"role": "user", "content": f"{s['question']}\n\n{INSTRUCTION}"},
                             {"role": "assistant", "content": reference_solution(s["answer"])}]
            messages.append({"role": "user", "content": f"{doc['question']}\n\n{INSTRUCTION}"})
            return chat_ids(tokenizer, messages)
        blocks = [f"Question: {s['question']}\nAnswer: {reference_solution(s['answer'])}" for s in shots]
        return text_ids(tokenizer, "\n\n".join([*blocks, f"Question: {doc['question']}\nAnswer:"]))

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else list(BASE_STOP)

    def reference_answer(self, doc: dict, chat: bool) -> str:
        """The gold solution without calculator annotations (base: continuing the prompt's "Answer:")."""
        return reference_solution(doc["answer"]) if chat else " " + reference_solution(doc["answer"])

    # -- scoring -----------------------------------------------------------------------------
    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        """``{"correct": 1.0}`` if the completion's final number equals the gold one, else 0.0."""
        if len(completions) != 1:
            raise ValueError(f"gsm8k scores one completion per doc; got {len(completions)} for {doc['id']}")
        pred = extract_answer(completions[0])
        return {"correct": float(pred is not None and same_number(pred, doc["reference"]))}


def reference_solution(answer: str) -> str:
    """A gold solution as an exemplar answer: calculator annotations removed."""
    return _CALCULATOR.sub("", answer).strip()


def _checked(rows: list[dict], where: str) -> list[dict]:
    """Rows with string ``question``/``answer`` and a gold number after "####", plus ``reference``."""
    out = []
    for i, r in enumerate(rows):
        if not (isinstance(r, dict) and isinstance(r.get("question"), str) and isinstance(r.get("answer"), str)):
            got = f"keys {sorted(r)}" if isinstance(r, dict) else type(r).__name__
            raise DataError(f"{record_at(rows, i, where)}: need string fields 'question' and 'answer'; got {got}")
        ref = reference(r["answer"])
        if ref is None:
            raise DataError(f"{record_at(rows, i, where)}: the answer has no '#### <number>' line: {r['answer'][-80:]!r}")
        out.append({**r, "reference": ref})
    return out
