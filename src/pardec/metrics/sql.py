"""Execution accuracy for text-to-SQL: run gold and predicted SQL read-only, compare the results.

Three layers keep a database unchanged whatever a model writes: the statement must start with
SELECT / WITH / VALUES; the file is opened read-only (``file:...?mode=ro``); and an authorizer allows
only reads (SELECT, column reads, functions, recursive CTEs), so INSERT/UPDATE/DELETE/DROP/CREATE/
ATTACH/DETACH/PRAGMA/transactions are denied before they run. A progress handler interrupts a query
past its time limit, and at most ``max_rows`` rows are fetched.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_READ_START = re.compile(r"^\s*(select|with|values)\b", re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n?(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)


class SQLError(RuntimeError):
    """A query was refused, failed, ran out of time or returned too many rows; the message says which."""


@dataclass
class ExecResult:
    rows: list[tuple] | None
    error: str | None = None


def extract_sql(completion: str, prefix: str = "") -> str:
    """The SQL in a completion: a ```sql fenced block if any, else the text up to ';' or a blank line.

    ``prefix`` (e.g. "SELECT" for base prompts that end with it) is prepended when the extracted text
    does not already start a read statement.
    """
    m = _FENCE.search(completion)
    text = m.group(1) if m else completion
    text = text.strip()
    text = re.split(r"\n\s*\n", text, maxsplit=1)[0]
    text = text.split(";", 1)[0].strip()
    if prefix and not _READ_START.match(text):
        text = f"{prefix} {text}".strip()
    return text


def order_matters(gold_sql: str) -> bool:
    """Spider's rule: row order counts only when the gold query has ORDER BY."""
    return bool(_ORDER_BY.search(gold_sql))


def _authorize(action: int, *_args) -> int:
    return sqlite3.SQLITE_OK if action in _ALLOWED else sqlite3.SQLITE_DENY


def connect_readonly(db_path: str | Path) -> sqlite3.Connection:
    """A read-only connection with the read-only authorizer installed."""
    p = Path(db_path).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"database {p} does not exist")
    conn = sqlite3.connect(f"{p.as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.text_factory = lambda b: b.decode(errors="replace")  # some Spider databases hold non-UTF-8 text
    conn.set_authorizer(_authorize)
    return conn


def execute(db_path: str | Path, sql: str, timeout_s: float = 10.0, max_rows: int = 100_000) -> list[tuple]:
    """Rows of ``sql`` run read-only on ``db_path``; raises :class:`SQLError` naming the reason."""
    if not _READ_START.match(sql):
        raise SQLError(f"refused: not a read-only query (must start with SELECT, WITH or VALUES): {sql[:80]!r}")
    conn = connect_readonly(db_path)
    deadline = time.monotonic() + timeout_s
    conn.set_progress_handler(lambda: int(time.monotonic() > deadline), 1000)
    try:
        cur = conn.execute(sql)
        rows: list[tuple] = []
        while batch := cur.fetchmany(1000):
            rows.extend(batch)
            if len(rows) > max_rows:
                raise SQLError(f"more than {max_rows} rows")
        return rows
    except sqlite3.Error as e:
        reason = f"time limit {timeout_s}s exceeded" if time.monotonic() > deadline else f"{type(e).__name__}: {e}"
        raise SQLError(reason) from None
    finally:
        conn.close()


def run(db_path: str | Path, sql: str, timeout_s: float = 10.0) -> ExecResult:
    """Like :func:`execute` but returns the error as a value."""
    try:
        return ExecResult(execute(db_path, sql, timeout_s))
    except SQLError as e:
        return ExecResult(None, str(e))


def results_match(gold: list[tuple], pred: list[tuple], ordered: bool) -> bool:
    """Equal as lists when ``ordered``, else as multisets of rows."""
    return gold == pred if ordered else Counter(gold) == Counter(pred)


def schema_sql(db_path: str | Path) -> str:
    """The CREATE TABLE statements of a database, in creation order, from ``sqlite_master``."""
    conn = connect_readonly(db_path)
    try:
        rows = conn.execute(
            "SELECT sql FROM sqlite_master WHERE type = 'table' AND sql IS NOT NULL "
            "AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
        ).fetchall()
    finally:
        conn.close()
    return "\n\n".join(r[0].strip() + ";" for r in rows)
