"""Spider (dev set): text-to-SQL scored by execution accuracy on the local SQLite databases.

Questions come from the hub (``xlangai/spider``, split ``validation``) or from the standard Spider layout:
``dataset.path=<root>/dev.json`` (a JSON list, or a ``.jsonl`` file, of records with ``db_id``,
``question``, ``query``) or ``dataset.extra.root=<root>`` (reads ``<root>/dev.json``). Databases always
come from the local root, ``<root>/database/<db_id>/<db_id>.sqlite``; the root is ``extra.root`` if set,
else the folder of ``dataset.path``. ``tables.json`` is not needed: the prompt's schema is the database's
own CREATE TABLE statements (``sqlite_master``).

Prompts. Chat: one user message with the schema and the question, asking for one SQLite query in a
```sql block. Base: the "CREATE TABLE ...; -- Question: ...; SELECT" prompt of Rajkumar et al. (2022); the
completion continues after ``SELECT``, so when the extracted SQL does not start with SELECT/WITH/VALUES,
``SELECT`` is prepended (stateless: :meth:`score` need not know which prompt was used).

Scores: ``exec`` is 1.0 when the predicted rows equal the gold rows (as multisets; as lists when the gold
query has ORDER BY), else 0.0; a prediction that fails, writes or times out scores 0. A sample whose
database is missing, or whose gold query fails, scores ``exec=None`` with an ``error``; the others go on. Before
the first score, a canary checks that the SQL child runs a known-good query and fails a known-bad one
(:func:`pardec.metrics.sql.check_sandbox`); a broken sandbox stops scoring with one line naming the cause.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path
from typing import Any

from pardec.jsonl import read_json, record_at
from pardec.metrics import sql
from pardec.tasks.base import DataError, Task, chat_ids, load_hub, read_jsonl, register_task, text_ids

log = logging.getLogger(__name__)

CHAT_TEMPLATE = (
    "Here is the schema of a SQLite database:\n\n{schema}\n\n"
    "Write one SQLite query that answers this question: {question}\n"
    "Reply with the query only, in a ```sql code block."
)
BASE_TEMPLATE = (
    "{schema}\n\n-- Using valid SQLite, answer the following question for the tables provided above.\n"
    "-- Question: {question}\nSELECT"
)


@cache
def _schema(db_path: str) -> str:
    return sql.schema_sql(db_path)


def _read_json_list(path: Path) -> list[dict]:
    """Records of a JSON list file (Spider's dev.json); malformed JSON names the file and line."""
    if not path.is_file():
        raise DataError(f"dataset file {path} does not exist")
    rows = read_json(path, DataError)
    if not isinstance(rows, list):
        raise DataError(f"{path}: expected a JSON list of records, got {type(rows).__name__}")
    return rows


@register_task("spider")
class Spider(Task):
    metric = "exec"
    sandboxed = True

    def _root(self) -> Path | None:
        root = self.cfg.extra.get("root")
        if root:
            return Path(root)
        return Path(self.cfg.path).parent if self.cfg.path else None

    def db_path(self, db_id: str) -> Path:
        root = self._root()
        if root is None:
            raise DataError("spider needs the local databases: pass dataset.extra.root=<spider root>")
        return root / "database" / db_id / f"{db_id}.sqlite"

    def docs(self) -> list[dict]:
        root = self._root()
        if root is None:
            raise DataError(
                "spider scores by executing SQL on the local databases: pass dataset.extra.root=<spider root> "
                "(holding database/<db_id>/<db_id>.sqlite) or dataset.path=<root>/dev.json"
            )
        if self.cfg.path:
            p = Path(self.cfg.path)
            rows = read_jsonl(p) if p.suffix == ".jsonl" else _read_json_list(p)
            where = str(p)
        elif (root / "dev.json").is_file():
            rows, where = _read_json_list(root / "dev.json"), str(root / "dev.json")
        else:
            rows = load_hub(self.cfg.hub_id or "xlangai/spider", self.cfg.hub_config, self.cfg.split, "spider")
            where = self.cfg.hub_id or "xlangai/spider"
        docs = []
        for i, r in enumerate(rows):
            missing = [k for k in ("db_id", "question", "query") if k not in r]
            if missing:
                raise DataError(f"{record_at(rows, i, where)}: missing field(s) {missing}; need db_id, question, query")
            docs.append({"id": str(r.get("id", i)), "db_id": r["db_id"], "question": r["question"],
                         "query": r["query"]})
        return docs

    def schema(self, db_id: str) -> str:
        p = self.db_path(db_id)
        if not p.is_file():
            log.warning("spider: missing database %s; prompting without a schema", p)
            return f"-- schema unavailable: missing database {p}"
        return _schema(str(p))

    def prompt_ids(self, doc: dict, tokenizer, chat: bool, history: list[str] = ()) -> list[int]:
        fields = {"schema": self.schema(doc["db_id"]), "question": doc["question"]}
        if chat:
            return chat_ids(tokenizer, [{"role": "user", "content": CHAT_TEMPLATE.format(**fields)}])
        return text_ids(tokenizer, BASE_TEMPLATE.format(**fields))

    def stop_strings(self, chat: bool) -> list[str]:
        return [] if chat else [";", "\n\n"]

    def check_sandbox(self) -> None:
        """The canary of :func:`pardec.metrics.sql.execute` (see :meth:`Task.check_sandbox`)."""
        sql.check_sandbox()

    def score(self, doc: dict, completions: list[str]) -> dict[str, Any]:
        """A sandbox that cannot run a known-good query raises :class:`~pardec.metrics.sandbox.SandboxError` instead
        of scoring 0."""
        self.check_sandbox()
        p = self.db_path(doc["db_id"])
        if not p.is_file():
            return {"exec": None, "error": f"missing database {p} for db_id {doc['db_id']!r}"}
        gold = sql.run(p, doc["query"], self.timeout_s)
        if gold.rows is None:
            return {"exec": None, "error": f"gold query failed: {gold.error}"}
        pred_sql = sql.extract_sql(completions[0], prefix="SELECT")
        pred = sql.run(p, pred_sql, self.timeout_s)
        ok = pred.rows is not None and sql.results_match(gold.rows, pred.rows, sql.order_matters(doc["query"]))
        out: dict[str, Any] = {"exec": float(ok), "sql": pred_sql}
        if pred.error:
            out["pred_error"] = pred.error
        return out

    def aggregate(self, scores: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean execution accuracy over scored samples, plus how many could not be scored."""
        out = super().aggregate([{"exec": s.get("exec")} for s in scores])
        out["n_unscored"] = sum(s.get("exec") is None for s in scores)
        out["n_pred_errors"] = sum("pred_error" in s for s in scores)
        return out
