"""SQL in a child process: hard time and memory limits, results carried back intact, the parent untouched."""

from __future__ import annotations

import pytest

from pardec.metrics import sql
from tests.metrics.sql_attacks import SQL_ATTACKS, make_db, run_sql_attack


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return make_db(tmp_path_factory.mktemp("sqlattack") / "a.db")


@pytest.mark.slow
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


@pytest.mark.parametrize("query", ["SELECT fts3_tokenizer('simple')", "SELECT FTS3_Tokenizer('simple')",
                                   "SELECT x FROM t WHERE fts3_tokenizer('porter') IS NOT NULL",
                                   "SELECT load_extension('/nonexistent/evil.so')", "SELECT zeroblob(8)"])
def test_functions_off_the_allow_list_are_refused(db, query):
    """fts3_tokenizer('simple') returned a heap address (its two-argument form is a code-execution vector)."""
    name = query.split("(")[0].split()[-1].lower()
    with pytest.raises(sql.SQLError, match=f"(?i)not authorized to use function: {name}"):
        sql.execute(db, query)
    r = sql.run(db, query)
    assert r.rows is None and "not authorized to use function" in r.error


@pytest.fixture(scope="module")
def singers(tmp_path_factory):
    import sqlite3

    path = tmp_path_factory.mktemp("singers") / "concert.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE singer (name TEXT, age INTEGER, country TEXT, debut TEXT)")
    con.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", [
        ("Ann", 30, "France", "2001-05-17"), ("Abe", 25, "France", "2010-01-02"),
        ("Cid", 41, "Peru", "1999-12-31"), ("Dee", 19, "Chile", "2019-07-04"),
    ])
    con.commit()
    con.close()
    return path


@pytest.mark.parametrize(("query", "expected"), [
    ("SELECT count(*), AVG(age), max(age), min(age), sum(age) FROM singer", [(4, 28.75, 41, 19, 115)]),
    ("SELECT name FROM singer WHERE name LIKE 'a%' ORDER BY name", [("Abe",), ("Ann",)]),
    ("SELECT count(*) FROM singer WHERE country NOT LIKE '%e%'", [(0,)]),
    ("SELECT name FROM singer WHERE name GLOB 'C*'", [("Cid",)]),
    ("SELECT strftime('%Y', debut) FROM singer WHERE name = 'Ann'", [("2001",)]),
    ("SELECT name FROM singer WHERE debut > date('2005-01-01') ORDER BY julianday(debut)", [("Abe",), ("Dee",)]),
    ("SELECT country, group_concat(name) FROM singer WHERE country = 'France' GROUP BY country",
     [("France", "Ann,Abe")]),
    ("SELECT round(avg(age), 1) FROM singer WHERE country = 'France'", [(27.5,)]),
    ("SELECT upper(substr(name, 1, 2)), length(country), coalesce(NULL, age) FROM singer WHERE age = 19",
     [("DE", 5, 19)]),
    ("SELECT country FROM singer GROUP BY country HAVING count(*) > 1", [("France",)]),
    ("SELECT name, rank() OVER (ORDER BY age DESC) FROM singer ORDER BY age DESC LIMIT 2", [("Cid", 1), ("Ann", 2)]),
])
def test_spider_style_functions_still_work(singers, query, expected):
    assert sql.execute(singers, query) == expected


def test_schema_sql_still_reads_sqlite_master(singers):
    assert sql.schema_sql(singers).startswith("CREATE TABLE singer")
