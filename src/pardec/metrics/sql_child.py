"""The SQL runner that :mod:`pardec.metrics.sql` starts in a sandboxed child process, and the read-only
connection it shares with it. Imports nothing from pardec: run as a script it starts in milliseconds.

``python -I -B sql_child.py DB MAX_ROWS TIMEOUT_S`` reads ``query.sql`` from the working directory and
writes ``result.json``: ``{"rows": [...]}`` (bytes as ``{"$bytes": hex}``) or ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import sqlite3
import sys
import time
from pathlib import Path

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_RECURSIVE}
# SQL functions a query may call (SQLITE_FUNCTION is allowed only for these; the operators LIKE and GLOB call
# like() and glob()): SQLite's core scalar, aggregate, window, date/time and math functions, none of which touches
# the engine, the file system or memory addresses. Left out on purpose: fts3_tokenizer (returns a heap pointer; its
# two-argument form registers one), load_extension, readfile/writefile, the sqlite_* introspection functions,
# changes/last_insert_rowid/total_changes, zeroblob, subtype, the JSON, FTS and R-tree functions (and -> / ->>).
ALLOWED_FUNCTIONS = frozenset("""
    abs char coalesce concat concat_ws format glob hex ifnull iif instr length like likelihood likely lower ltrim
    max min nullif octet_length printf quote random randomblob replace round rtrim sign soundex substr substring
    trim typeof unhex unicode unlikely upper
    avg count group_concat string_agg sum total
    row_number rank dense_rank percent_rank cume_dist ntile lag lead first_value last_value nth_value
    date time datetime julianday unixepoch strftime timediff current_date current_time current_timestamp
    acos acosh asin asinh atan atan2 atanh ceil ceiling cos cosh degrees exp floor ln log log10 log2 mod pi pow
    power radians sin sinh sqrt tan tanh trunc
""".split())


class SQLError(RuntimeError):
    """A query was refused, failed, ran out of time or memory, or returned too many rows; the message says which."""


def _authorize(action: int, _arg1: str | None = None, arg2: str | None = None, *_args) -> int:
    if action == sqlite3.SQLITE_FUNCTION:  # arg2 is the function's name
        allowed = arg2 is not None and arg2.lower() in ALLOWED_FUNCTIONS
    else:
        allowed = action in _ALLOWED
    return sqlite3.SQLITE_OK if allowed else sqlite3.SQLITE_DENY


def connect_readonly(db_path: str | Path) -> sqlite3.Connection:
    """A read-only connection (``mode=ro``) with an authorizer that allows only reads and the functions of
    :data:`ALLOWED_FUNCTIONS` (another function fails the query: "not authorized to use function: NAME")."""
    p = Path(db_path).resolve()
    if not p.is_file():
        raise FileNotFoundError(f"database {p} does not exist")
    conn = sqlite3.connect(f"{p.as_uri()}?mode=ro", uri=True, check_same_thread=False)
    conn.text_factory = lambda b: b.decode(errors="replace")  # some Spider databases hold non-UTF-8 text
    conn.set_authorizer(_authorize)
    return conn


def query(db_path: str | Path, sql: str, timeout_s: float, max_rows: int) -> list[tuple]:
    """Rows of ``sql`` on a read-only connection, interrupted (between VM steps) at ``timeout_s``."""
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
    except MemoryError:
        raise SQLError("memory limit exceeded") from None
    finally:
        conn.close()


def encode_rows(rows: list[tuple]) -> list[list]:
    return [[{"$bytes": v.hex()} if isinstance(v, bytes) else v for v in row] for row in rows]


def decode_rows(rows: list[list]) -> list[tuple]:
    return [tuple(bytes.fromhex(v["$bytes"]) if isinstance(v, dict) else v for v in row) for row in rows]


def main(argv: list[str]) -> int:
    db, max_rows, timeout_s = argv[0], int(argv[1]), float(argv[2])
    sql = Path("query.sql").read_text(encoding="utf-8")
    try:
        out = {"rows": encode_rows(query(db, sql, timeout_s, max_rows))}
    except SQLError as e:
        out = {"error": str(e)}
    except MemoryError:
        out = {"error": "memory limit exceeded"}
    with open("result.json", "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
