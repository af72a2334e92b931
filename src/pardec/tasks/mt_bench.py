"""MT-Bench: 80 two-turn questions graded 1-10 by an LLM judge (FastChat single-answer grading).

Questions come from the hub (``HuggingFaceH4/mt_bench_prompts``, split ``train``: fields ``prompt`` (two
turns), ``prompt_id``, ``category``) or a local FastChat ``question.jsonl`` (``dataset.path``; fields
``question_id``, ``category``, ``turns``). Turn 2's prompt is the conversation with the turn-1 question,
the method's own turn-1 answer (``history[0]``) and the turn-2 question.

Grading follows FastChat's ``gen_judgment.py --mode single``: ``single-v1`` for turn 1 and
``single-v1-multi-turn`` for turn 2; for math, reasoning and coding the ``single-math-v1`` prompts with
the GPT-4 reference answers. The judge is ``dataset.extra.judge`` (see :class:`JudgeConfig`); with
``base_url: null`` every score is None and ``judge`` says "not configured". Headline ``score`` is, as in
FastChat, the mean over all valid turn ratings; ``score_t1`` / ``score_t2`` per turn. The human-written
``reference`` field of the question files is not used (FastChat grades against the GPT-4 answers).
Answers are generated with the harness's sampling settings, not FastChat's per-category temperatures.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from pardec.config import DatasetConfig
from pardec.jsonl import record_at
from pardec.metrics.judge import Judge, JudgeConfig, Judgment
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids

DATA = Path(__file__).parent / "data" / "mt_bench"
NEED_REF_CATS = ("math", "reasoning", "coding")


@cache
def judge_prompts() -> dict[str, dict]:
    return {r["name"]: r for r in read_jsonl(DATA / "judge_prompts.jsonl")}


@cache
def reference_answers() -> dict[int, list[str]]:
    """GPT-4 reference answers (both turns) by FastChat question id."""
    return {r["question_id"]: r["choices"][0]["turns"] for r in read_jsonl(DATA / "reference_answer_gpt-4.jsonl")}


@cache
def _h4_ids() -> dict[str, int]:
    return json.loads((DATA / "h4_prompt_ids.json").read_text(encoding="utf-8"))


def _doc(r: dict, where: str, i: int) -> dict:
    """A FastChat (question_id, turns) or H4 (prompt_id, prompt) record as a doc (``where``: its file and line)."""
    if "turns" in r:
        qid, turns, fallback_id = r.get("question_id"), r["turns"], str(i)
    elif "prompt" in r:
        turns, fallback_id = r["prompt"], f"h4-{r.get('prompt_id', i)}"
        qid = _h4_ids().get(str(r.get("prompt_id")))  # FastChat's id, so the reference answers are found
    else:
        raise DataError(f"{where}: no 'turns' (FastChat) or 'prompt' (H4) field")
    if not isinstance(turns, list) or len(turns) != 2 or "category" not in r:
        raise DataError(f"{where}: need a 'category' and exactly 2 turns, got {str(turns)[:80]!r}")
    return {
        "id": str(qid) if qid is not None else fallback_id,
        "question_id": qid,
        "category": r["category"],
        "turns": list(turns),
        "reference": reference_answers().get(qid) if r["category"] in NEED_REF_CATS else None,
    }


def judge_messages(doc: dict, answers: list[str], turn: int) -> tuple[str, str]:
    """(system, user) judge messages for ``turn`` (0 or 1), as FastChat's ``run_judge_single`` builds them."""
    ref = doc["category"] in NEED_REF_CATS
    name = ("single-math-v1" if ref else "single-v1") + ("-multi-turn" if turn else "")
    p = judge_prompts()[name]
    kw: dict[str, str] = {}
    if ref:
        kw["ref_answer_1"] = doc["reference"][0]
        if turn:
            kw["ref_answer_2"] = doc["reference"][1]
    if turn:
        q1, q2 = doc["turns"]
        user = p["prompt_template"].format(question_1=q1, question_2=q2, answer_1=answers[0], answer_2=answers[1], **kw)
    else:
        user = p["prompt_template"].format(question=doc["turns"][0], answer=answers[0], **kw)
    return p["system_prompt"], user


@register_task("mt_bench")
class MtBench(Task):
    metric = "score"
    n_turns = 2

    def __init__(self, cfg: DatasetConfig, timeout_s: float = 10.0):
        super().__init__(cfg, timeout_s)
        jc = JudgeConfig.from_dict(cfg.extra.get("judge"))
        self.judge = Judge(jc) if jc.base_url else None

    def docs(self) -> list[dict]:
        if self.cfg.path:
            rows, where = read_jsonl(self.cfg.path), self.cfg.path
        else:
            where = self.cfg.hub_id or "HuggingFaceH4/mt_bench_prompts"
            rows = load_hub(where, self.cfg.hub_config, self.cfg.split, "mt_bench")
        return [_doc(r, record_at(rows, i, where), i) for i, r in enumerate(rows)]

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        turn = len(history)
        if turn >= self.n_turns:
            raise ValueError(f"mt_bench has {self.n_turns} turns; got a history of {turn} answers")
        messages = []
        for q, a in zip(doc["turns"][:turn], history):
            messages += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        messages.append({"role": "user", "content": doc["turns"][turn]})
        if chat:
            return chat_ids(tokenizer, messages)
        text = "".join(f"### {m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages)
        return text_ids(tokenizer, text + "### Assistant:\n")

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else ["\n### User:"]

    def _rate(self, doc: dict, answers: list[str], turn: int) -> Judgment:
        if len(answers) <= turn:
            return Judgment(None, error=f"no answer for turn {turn + 1}")
        if doc["category"] in NEED_REF_CATS and not doc["reference"]:
            return Judgment(None, error=f"no GPT-4 reference answer for question {doc['id']!r} ({doc['category']})")
        return self.judge.rate(*judge_messages(doc, answers, turn))

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        if self.judge is None:
            return {"score": None, "score_t1": None, "score_t2": None, "judge": "not configured"}
        out: dict[str, Any] = {}
        errors = []
        for t in range(self.n_turns):
            j = self._rate(doc, completions, t)
            out[f"score_t{t + 1}"], out[f"judgment_t{t + 1}"] = j.rating, j.text
            if j.error:
                errors.append(f"turn {t + 1}: {j.error}")
        valid = [out[k] for k in ("score_t1", "score_t2") if out[k] is not None]
        out["score"] = sum(valid) / len(valid) if valid else None
        if errors:
            out["judge_error"] = "; ".join(errors)
        return out

    def aggregate(self, scores: list[dict[str, Any]]) -> dict[str, Any]:
        """FastChat's averages: ``score`` over every valid turn rating, ``score_t1``/``score_t2`` per turn."""
        out = super().aggregate([{k: s.get(k) for k in ("score_t1", "score_t2")} for s in scores])
        turns = [s.get(k) for s in scores for k in ("score_t1", "score_t2") if s.get(k) is not None]
        out["score"] = sum(turns) / len(turns) if turns else None
        out["score_n"] = len(turns)
        out["n_judge_errors"] = sum("judge_error" in s for s in scores)
        if scores and all(s.get("judge") == "not configured" for s in scores):
            out["judge"] = "not configured"
        return out
