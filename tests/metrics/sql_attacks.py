"""Queries that try to exhaust the evaluating process's time or memory (fixtures, not tests).

Each starts like a read query, so only the child process's limits stand between it and the harness:
before queries ran in a child, ``randomblob(1e9)`` grew the evaluating process by ~950 MB and ran past
its limit, and a 900 MB ``printf`` ran 10 s inside one SQLite call where no progress handler fires.
"""

from __future__ import annotations

import resource
import sqlite3
import time
from pathlib import Path

_FOREVER = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c)"

SQL_ATTACKS: dict[str, str] = {
    "randomblob 1e9": "SELECT length(randomblob(1000000000))",
    "zeroblob 1e9 hex": "SELECT length(hex(zeroblob(1000000000)))",
    "printf 900 MB": "SELECT length(printf('%.*c', 900000000, 'x'))",
    "replace doubling": "SELECT length(replace(replace(replace(hex(zeroblob(10000000)), '0', '00'), '0', '00'), '0', '00'))",
    "group_concat of a huge CTE": f"{_FOREVER} SELECT length(group_concat(x)) FROM c",
    "count forever": f"{_FOREVER} SELECT count(*) FROM c",
    "max forever": f"{_FOREVER} SELECT max(x) FROM c",
    "rows forever": f"{_FOREVER} SELECT x FROM c",
    "sum of a cross join": ("WITH a(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM a WHERE x < 100000) "
                            "SELECT sum(a.x * b.x) FROM a, a AS b"),
    "sorted huge CTE": f"{_FOREVER} SELECT x FROM c ORDER BY random() LIMIT 1",
    "distinct huge CTE": f"{_FOREVER} SELECT count(DISTINCT x) FROM c",
    "string growth CTE": ("WITH RECURSIVE s(t) AS (SELECT 'x' UNION ALL SELECT t || t FROM s WHERE length(t) < 2000000000) "
                          "SELECT max(length(t)) FROM s"),
    "blob growth CTE": ("WITH RECURSIVE s(t) AS (SELECT zeroblob(1024) UNION ALL SELECT t || t FROM s) "
                        "SELECT length(t) FROM s LIMIT 1 OFFSET 40"),
    "like backtracking": ("SELECT count(*) FROM (WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                          "WHERE x < 2000000) SELECT x FROM c) WHERE printf('%.*c', 20000, 'a') "
                          "LIKE '%a%a%a%a%a%a%a%a%a%a%b'"),
    "group by huge CTE": f"{_FOREVER} SELECT x % 7, count(*) FROM c GROUP BY x % 7",
    "window over huge CTE": f"{_FOREVER} SELECT sum(x) OVER (ORDER BY x) FROM c LIMIT 1",
    "json array growth": ("WITH RECURSIVE s(j) AS (SELECT json_array(1) UNION ALL SELECT json_array(j, j) FROM s) "
                          "SELECT length(j) FROM s LIMIT 1 OFFSET 40"),
    "nested hex": "SELECT length(hex(hex(hex(hex(zeroblob(200000000))))))",
    "upper of 900 MB": "SELECT length(upper(printf('%.*c', 900000000, 'x')))",
    "many wide rows": ("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 90000) "
                       "SELECT x, printf('%.*c', 100000, 'x') FROM c"),
    "substr of randomblob": "SELECT substr(randomblob(900000000), 1, 1)",
}


def make_db(path: Path) -> Path:
    """A one-table database to run the attacks against."""
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE t (x INTEGER)")
    con.executemany("INSERT INTO t VALUES (?)", [(i,) for i in range(10)])
    con.commit()
    con.close()
    return path


def run_sql_attack(execute, db: Path, name: str, timeout_s: float, grace_s: float) -> tuple[bool, str]:
    """(within limits, what happened): ``execute(db, sql, timeout_s)`` ended within ``timeout_s + grace_s``
    and this process's peak memory grew by less than 100 MB."""
    peak0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    t0 = time.monotonic()
    try:
        rows = execute(db, SQL_ATTACKS[name], timeout_s=timeout_s)
        what = f"{len(rows)} row(s)"
    except Exception as e:  # noqa: BLE001 - the outcome is reported, not raised
        what = f"{type(e).__name__}: {str(e)[:80]}"
    wall = time.monotonic() - t0
    grew_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak0) / 1024
    ok = wall <= timeout_s + grace_s and grew_mb < 100
    return ok, f"{what}; {wall:.2f}s, harness peak +{grew_mb:.0f} MB"
