"""WMT16 translation (default German -> English, test split) scored by corpus sacreBLEU.

Documents come from the hub (``wmt/wmt16``, config ``de-en``; rows ``{"translation": {"de": ..., "en": ...}}``)
or a local JSONL file (``dataset.path``) with the same ``translation`` dict or flat ``de`` / ``en`` fields,
plus an optional ``id``. ``dataset.extra.source`` / ``extra.target`` pick the direction (default de -> en).
Chat prompt: an instruction and the source sentence; base prompt: "German: <src>\\nEnglish:", stopped at
a newline. ``bleu`` is corpus BLEU over all documents (sacreBLEU defaults, 0-100), computed in
:meth:`aggregate` from each document's hypothesis and reference; ``sentence_bleu`` is per document.
"""

from __future__ import annotations

from typing import Any

from pardec.config import DatasetConfig
from pardec.jsonl import record_at
from pardec.metrics.text import bleu, sentence_bleu
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids

LANGUAGES = {"cs": "Czech", "de": "German", "en": "English", "fi": "Finnish", "ro": "Romanian", "ru": "Russian",
             "tr": "Turkish"}


@register_task("wmt16")
class Wmt16(Task):
    metric = "bleu"

    def __init__(self, cfg: DatasetConfig, timeout_s: float = 10.0):
        super().__init__(cfg, timeout_s)
        self.src, self.tgt = cfg.extra.get("source", "de"), cfg.extra.get("target", "en")
        for key, lang in (("source", self.src), ("target", self.tgt)):
            if lang not in LANGUAGES:
                raise DataError(f"dataset.extra.{key}={lang!r} is not valid; choose one of: {', '.join(LANGUAGES)}")

    def docs(self) -> list[dict]:
        if self.cfg.path:
            rows, where = read_jsonl(self.cfg.path), self.cfg.path
        else:
            where = self.cfg.hub_id or "wmt/wmt16"
            pair = self.cfg.hub_config or "-".join(sorted((self.src, self.tgt), key=lambda x: x == "en"))
            rows = load_hub(where, pair, self.cfg.split, "wmt16")
        docs = []
        for i, r in enumerate(rows):
            tr = r.get("translation", r)
            if self.src not in tr or self.tgt not in tr:
                raise DataError(f"{record_at(rows, i, where)}: needs {self.src!r} and {self.tgt!r} texts "
                                f"(in a 'translation' dict or as fields)")
            docs.append({"id": str(r.get("id", i)), "source": tr[self.src], "reference": tr[self.tgt]})
        return docs

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        s, t = LANGUAGES[self.src], LANGUAGES[self.tgt]
        if chat:
            msg = f"Translate the following {s} text into {t}. Reply with the translation only.\n\n{doc['source']}"
            return chat_ids(tokenizer, [{"role": "user", "content": msg}])
        return text_ids(tokenizer, f"{s}: {doc['source']}\n{t}:")

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else ["\n"]

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        hyp = completions[0].strip()
        return {"sentence_bleu": sentence_bleu(hyp, doc["reference"]), "hyp": hyp,
                "ref": doc["reference"]}

    def aggregate(self, scores: list[dict[str, Any]]) -> dict[str, Any]:
        """Corpus BLEU over every document, plus the mean sentence BLEU."""
        out = super().aggregate([{"sentence_bleu": s["sentence_bleu"]} for s in scores])
        out["bleu"] = bleu([s["hyp"] for s in scores], [s["ref"] for s in scores]) if scores else None
        out["bleu_n"] = len(scores)
        return out
