"""SQL in a child process: hard time and memory limits, results carried back intact, the parent untouched."""

from __future__ import annotations

import pytest

from pardec.metrics import sql
from tests.metrics.sql_attacks import SQL_ATTACKS, make_db, run_sql_attack


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_db(tmp_path_factory.mktemp("sqlattack") / "a.db")


@pytest.mark.parametrize("name", list(SQL_ATTACKS))
def test_query_stays_within_time_and_memory_limits(db, name):
    ok, what = run_sql_attack(sql.execute, db, name, timeout_s=1.0, grace_s=sql.STARTUP_S + 0.5)
    assert ok, what


def test_values_round_trip_through_the_child(db):
    rows = sql.execute(db, "SELECT 1, 2.5, 'tÿt', x'00ff', NULL, 1e999, -9223372036854775808")
    assert rows == [(1, 2.5, "tÿt", b"\x00\xff", None, float("inf"), -9223372036854775808)]
    assert sql.execute(db, "SELECT x FROM t ORDER BY x DESC LIMIT 3") == [(9,), (8,), (7,)]


def test_errors_and_refusals_name_the_reason(db):
    with pytest.raises(sql.SQLError, match="no such table: nope"):
        sql.execute(db, "SELECT * FROM nope")
    with pytest.raises(sql.SQLError, match="refused: not a read-only query"):
        sql.execute(db, "DELETE FROM t")
    with pytest.raises(sql.SQLError, match="memory limit exceeded"):
        sql.execute(db, "SELECT length(randomblob(400000000))", memory_mb=128)
    with pytest.raises(sql.SQLError, match=r"time limit 0.5s exceeded \(killed\)"):
        sql.execute(db, "SELECT length(printf('%.*c', 900000000, 'x'))", timeout_s=0.5, memory_mb=4096)
    assert sql.run(db, "SELECT * FROM nope").error.startswith("OperationalError")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        sql.execute(db.parent / "ghost.db", "SELECT 1")
