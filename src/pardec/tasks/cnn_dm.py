"""CNN/DailyMail 3.0.0 (test split): abstractive summarisation scored by ROUGE.

Documents come from the hub (``abisee/cnn_dailymail``, config ``3.0.0``) or a local JSONL file
(``dataset.path``) with fields ``article``, ``highlights`` and an optional ``id``. The prompt is
"Summarize: <article>" (chat: the user message; base: followed by "\\nSummary:"). Articles are cut to
their first ``dataset.extra.max_article_words`` (default 400) whitespace-separated words, joined by single
spaces, so that prompts fit small context windows; the reference highlights are never cut.
Scores: ROUGE-1/2/L F1 in [0, 1] (``rouge_score``, stemming on); the headline metric is ``rougeL``.
"""

from __future__ import annotations

from typing import Any

from pardec.jsonl import record_at
from pardec.metrics.text import rouge
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids


def truncate_words(text: str, max_words: int) -> str:
    """The first ``max_words`` whitespace-separated words of ``text``, joined by single spaces."""
    return " ".join(text.split()[:max_words])


@register_task("cnn_dm", aliases=("cnn_dailymail",))
class CnnDm(Task):
    metric = "rougeL"

    @property
    def max_words(self) -> int:
        n = self.cfg.extra.get("max_article_words", 400)
        if not isinstance(n, int) or n < 1:
            raise DataError(f"dataset.extra.max_article_words={n!r} is not valid; it must be an integer >= 1")
        return n

    def docs(self) -> list[dict]:
        if self.cfg.path:
            rows, where = read_jsonl(self.cfg.path), self.cfg.path
        else:
            hub = self.cfg.hub_id or "abisee/cnn_dailymail"
            rows, where = load_hub(hub, self.cfg.hub_config or "3.0.0", self.cfg.split, "cnn_dm"), hub
        docs = []
        for i, r in enumerate(rows):
            missing = [k for k in ("article", "highlights") if k not in r]
            if missing:
                raise DataError(f"{record_at(rows, i, where)}: missing field(s) {missing}; need article, highlights")
            docs.append({"id": str(r.get("id", i)), "article": r["article"], "highlights": r["highlights"]})
        return docs

    def prompt_text(self, doc: dict) -> str:
        return f"Summarize: {truncate_words(doc['article'], self.max_words)}"

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        if chat:
            return chat_ids(tokenizer, [{"role": "user", "content": self.prompt_text(doc)}])
        return text_ids(tokenizer, self.prompt_text(doc) + "\nSummary:")

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else ["\n\n"]

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        return rouge(completions[0].strip(), doc["highlights"])
