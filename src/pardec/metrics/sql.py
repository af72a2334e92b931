"""Execution accuracy for text-to-SQL: run gold and predicted SQL read-only, compare the results.

Every query runs in a child process (:mod:`pardec.metrics.sql_child`, started by
:func:`pardec.metrics.sandbox.run_command`: namespaces, an address-space limit of ``memory_mb``, a hard
kill at ``timeout_s`` plus the interpreter's start-up), so a query that allocates a gigabyte or spins
inside one SQLite call costs this process nothing. Inside, three layers keep a database unchanged
whatever a model writes: the statement must start with SELECT / WITH / VALUES; the file is opened
read-only (``file:...?mode=ro``); and an authorizer allows only reads (SELECT, column reads, functions of a
read-only allow-list, recursive CTEs), so INSERT/UPDATE/DELETE/DROP/CREATE/ATTACH/DETACH/PRAGMA/transactions,
and functions such as ``fts3_tokenizer`` (a heap address) or ``load_extension``, are denied before they
run. A progress handler interrupts a query at its time limit between VM steps, and at most ``max_rows``
rows are returned.

:func:`check_sandbox` is the scorer's canary: a known-good query must return its rows and a known-bad one must fail
in the child, through :func:`execute` itself, before anything is scored (see :func:`pardec.metrics.sandbox.canary`).
"""

from __future__ import annotations

import json
import re
import sqlite3
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from pardec.metrics import sql_child
from pardec.metrics.sandbox import CANARY_TIMEOUT_S, canary, run_command
from pardec.metrics.sql_child import SQLError, connect_readonly

__all__ = ["SQLError", "check_sandbox", "connect_readonly", "execute", "extract_sql", "order_matters",
           "results_match", "run", "schema_sql"]

_READ_START = re.compile(r"^\s*(select|with|values)\b", re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(?:sql|sqlite)?[ \t]*\n?(.*?)(?:```|$)", re.IGNORECASE | re.DOTALL)
_ORDER_BY = re.compile(r"\border\s+by\b", re.IGNORECASE)
MEMORY_MB = 512
STARTUP_S = 0.25  # the child's interpreter start-up (~0.07 s), on top of the query's limit before the hard kill


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


_CHILD_SOURCE = Path(sql_child.__file__).read_text(encoding="utf-8")


def execute(db_path: str | Path, sql: str, timeout_s: float = 10.0, max_rows: int = 100_000,
            memory_mb: int = MEMORY_MB) -> list[tuple]:
    """Rows of ``sql`` run read-only on ``db_path`` in a child process; raises :class:`SQLError` naming the reason."""
    if not _READ_START.match(sql):
        raise SQLError(f"refused: not a read-only query (must start with SELECT, WITH or VALUES): {sql[:80]!r}")
    db = Path(db_path).resolve()
    if not db.is_file():
        raise FileNotFoundError(f"database {db} does not exist")
    # the child's own source goes into its working directory: the sandbox shows nothing of pardec's checkout
    argv = [sys.executable, "-I", "-B", "sql_child.py", str(db), str(max_rows), str(timeout_s)]
    r = run_command(argv, timeout_s=timeout_s + STARTUP_S, memory_mb=memory_mb, fsize_mb=256,
                    files={"query.sql": sql, "sql_child.py": _CHILD_SOURCE}, ro_paths=(str(db),),
                    read_back=("result.json",))
    if r.status == "timeout":
        raise SQLError(f"time limit {timeout_s}s exceeded (killed)")
    if "result.json" not in r.files:
        if "MemoryError" in r.stderr:
            raise SQLError("memory limit exceeded")
        raise SQLError(f"the SQL process ended without a result ({r.status}, exit {r.returncode}): {r.stderr[-300:]}")
    out = json.loads(r.files["result.json"])
    if "error" in out:
        raise SQLError(out["error"])
    return sql_child.decode_rows(out["rows"])


def run(db_path: str | Path, sql: str, timeout_s: float = 10.0) -> ExecResult:
    """Like :func:`execute` but returns the error as a value."""
    try:
        return ExecResult(execute(db_path, sql, timeout_s))
    except SQLError as e:
        return ExecResult(None, str(e))


def check_sandbox() -> str:
    """The canary of :func:`execute` (Spider's path), once per process and configuration: raises
    :class:`~pardec.metrics.sandbox.SandboxError` unless a known-good query returns its rows and a known-bad one fails
    in the child (no such table); returns the isolation."""
    return canary("sql", _sql_canary)


def _sql_canary() -> str | None:
    with tempfile.TemporaryDirectory(prefix="pardec_sql_canary_") as d:
        db = Path(d) / "canary.sqlite"
        conn = sqlite3.connect(db)
        try:
            conn.execute("CREATE TABLE t (x INTEGER)")
            conn.executemany("INSERT INTO t VALUES (?)", [(1,), (2,)])
            conn.commit()
        finally:
            conn.close()
        try:
            rows = execute(db, "SELECT x FROM t ORDER BY x", CANARY_TIMEOUT_S)
        except (SQLError, OSError) as e:  # OSError: the interpreter (or bwrap) cannot be started at all
            return f"a known-good query did not run ({' '.join(str(e).split())})"
        if rows != [(1,), (2,)]:
            return f"a known-good query returned {rows!r}, not [(1,), (2,)]"
        try:
            rows = execute(db, "SELECT x FROM no_such_table", CANARY_TIMEOUT_S)
        except SQLError as e:
            return None if "no such table" in str(e) else f"a known-bad query failed for another reason ({e})"
        return f"a known-bad query returned {rows!r}"


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
