"""Prompt-only corpora for CLLM trajectory collection (no reference to score against):

* ``code_search_net``: Python functions from Code-Search-Net (hub ``code-search-net/code_search_net``, config
  ``python``; or ``dataset.path=<jsonl>`` with fields ``func_name``, ``func_documentation_string``); the prompt
  asks for the function its docstring describes (the CLLM paper's code-generation training data).
* ``sharegpt``: the first user turn of each ShareGPT conversation (``dataset.path=<json or jsonl>`` of records
  ``{"id", "conversations": [{"from": "human", "value": ...}, ...]}``; or a hub id via ``dataset.hub_id``).

``score`` returns no metric: these tasks feed ``python -m train`` (and speed-only evaluation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pardec.jsonl import read_json, record_at
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids


class PromptOnlyTask(Task):
    metric = "none"

    def _rows(self, default_hub: str | None, default_config: str | None) -> tuple[list[dict], str]:
        if self.cfg.path:
            p = Path(self.cfg.path)
            rows = read_json(p, DataError) if p.suffix == ".json" and p.is_file() else read_jsonl(p)
            return rows, str(p)
        hub = self.cfg.hub_id or default_hub
        if not hub:
            raise DataError(f"dataset {self.name!r} needs dataset.path=<local file> (or dataset.hub_id)")
        return load_hub(hub, self.cfg.hub_config or default_config, self.cfg.split, self.name), hub

    def _ids(self, tokenizer, chat: bool, request: str, base_text: str) -> list[int]:
        if chat:
            return chat_ids(tokenizer, [{"role": "user", "content": request}])
        return text_ids(tokenizer, base_text)

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        return {}


@register_task("code_search_net", aliases=("codesearchnet",))
class CodeSearchNet(PromptOnlyTask):
    def docs(self) -> list[dict]:
        rows, where = self._rows("code-search-net/code_search_net", "python")
        out = []
        for i, r in enumerate(rows):
            if "func_documentation_string" not in r or "func_name" not in r:
                raise DataError(f"{record_at(rows, i, where)}: need fields func_name and func_documentation_string")
            if r["func_documentation_string"].strip():
                out.append({"id": f"csn/{i}", "name": r["func_name"].split(".")[-1],
                            "doc": r["func_documentation_string"].strip()})
        return out

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        request = f"Write a Python function `{doc['name']}` that does the following:\n\n{doc['doc']}"
        return self._ids(tokenizer, chat, request, f'def {doc["name"]}(')

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else ["\ndef ", "\nclass "]


@register_task("sharegpt")
class ShareGPT(PromptOnlyTask):
    def docs(self) -> list[dict]:
        rows, where = self._rows(None, None)
        out = []
        for i, r in enumerate(rows):
            conv = r.get("conversations")
            if not isinstance(conv, list):
                raise DataError(f"{record_at(rows, i, where)}: no 'conversations' list")
            if conv and conv[0].get("from") in ("human", "user") and str(conv[0].get("value", "")).strip():
                out.append({"id": str(r.get("id", i)), "question": conv[0]["value"]})
        return out

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        return self._ids(tokenizer, chat, doc["question"], f"USER: {doc['question']}\nASSISTANT:")

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else ["\nUSER:"]
