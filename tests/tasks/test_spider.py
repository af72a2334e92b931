"""Spider: execution accuracy on a tiny database in the Spider layout, built in tmp_path."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import sys
import time
from pathlib import Path

import pytest

from pardec.config import DatasetConfig
from pardec.metrics import sql
from pardec.tasks import build_task
from pardec.tasks.base import DataError

SINGERS = [(1, "Ann", 30, "France"), (2, "Bob", 25, "France"), (3, "Cid", 41, "Peru"), (4, "Dee", 19, "Chile")]
DEV = [
    {"db_id": "concert", "question": "Names of singers from France?", "query": "SELECT name FROM singer WHERE country = 'France'"},
    {"db_id": "concert", "question": "Countries of all singers?", "query": "SELECT country FROM singer"},
    {"db_id": "concert", "question": "Names by age?", "query": "SELECT name FROM singer ORDER BY age"},
    {"db_id": "ghost", "question": "Anything?", "query": "SELECT 1"},
]


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("spider")
    (r / "database" / "concert").mkdir(parents=True)
    con = sqlite3.connect(r / "database" / "concert" / "concert.sqlite")
    con.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, age INTEGER, country TEXT)")
    con.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)", SINGERS)
    con.commit()
    con.close()
    (r / "dev.json").write_text(json.dumps(DEV, indent=1))
    (r / "tables.json").write_text("[]")
    return r


@pytest.fixture(scope="module")
def task(root):
    return build_task(DatasetConfig(name="spider", path=str(root / "dev.json")), timeout_s=0.5)


def db_file(root: Path) -> Path:
    return root / "database" / "concert" / "concert.sqlite"


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_docs_from_path_and_root(root, task):
    docs = task.docs()
    assert [d["db_id"] for d in docs] == [r["db_id"] for r in DEV]
    assert len({d["id"] for d in docs}) == len(docs)
    by_root = build_task(DatasetConfig(name="spider", extra={"root": str(root)})).docs()
    assert by_root == docs


def test_no_root_says_what_to_pass():
    with pytest.raises(DataError, match="extra.root"):
        build_task(DatasetConfig(name="spider")).docs()


@pytest.mark.parametrize(
    "completion",
    [
        "```sql\nSELECT name FROM singer WHERE country = 'France';\n```",
        "Sure:\n```SQL\nSELECT name FROM singer WHERE country='France'\n```\nThis selects...",
        " name FROM singer WHERE country = 'France';\n\n-- next question",  # base prompt ends with SELECT
        "SELECT name FROM singer WHERE age < 31 AND country != 'Chile'\n\nThat's it.",
    ],
)
def test_correct_sql_scores_one(task, completion):
    assert task.score(task.docs()[0], [completion])["exec"] == 1.0


@pytest.mark.parametrize("completion", ["SELECT name FROM singer", "SELECT nme FROM singer", "I don't know"])
def test_wrong_sql_scores_zero(task, completion):
    s = task.score(task.docs()[0], [completion])
    assert s["exec"] == 0.0


def test_unordered_results_compare_as_multisets(task):
    doc = task.docs()[1]  # gold has no ORDER BY; France appears twice
    assert task.score(doc, ["SELECT country FROM singer ORDER BY country DESC"])["exec"] == 1.0
    assert task.score(doc, ["SELECT DISTINCT country FROM singer"])["exec"] == 0.0


def test_order_by_gold_is_order_sensitive(task):
    doc = task.docs()[2]
    assert task.score(doc, ["SELECT name FROM singer ORDER BY age ASC"])["exec"] == 1.0
    assert task.score(doc, ["SELECT name FROM singer ORDER BY age DESC"])["exec"] == 0.0
    assert task.score(doc, ["SELECT name FROM singer"])["exec"] == 0.0  # right rows, wrong order


@pytest.mark.parametrize(
    "attack",
    [
        "INSERT INTO singer VALUES (9, 'Eve', 1, 'X')",
        "UPDATE singer SET name = 'pwned'",
        "DELETE FROM singer",
        "DROP TABLE singer",
        "CREATE TABLE t (x)",
        "ATTACH DATABASE '{dir}/evil.db' AS evil",
        "PRAGMA writable_schema = ON",
        "PRAGMA journal_mode = WAL",
        "VACUUM INTO '{dir}/copy.db'",
        "WITH x AS (SELECT 1) DELETE FROM singer",
        "SELECT name FROM singer; DROP TABLE singer",
        "SELECT * FROM pragma_table_info('singer')",
    ],
)
def test_writes_are_refused_and_change_nothing(root, task, attack):
    db = db_file(root)
    before, files = digest(db), sorted(db.parent.iterdir())
    s = task.score(task.docs()[0], [f"```sql\n{attack.format(dir=db.parent)}\n```"])
    assert s["exec"] == 0.0
    assert digest(db) == before
    assert sorted(db.parent.iterdir()) == files  # no attached / vacuumed / journal files appear


@pytest.mark.parametrize(
    "stmt", ["ATTACH DATABASE '{dir}/evil.db' AS evil", "DELETE FROM singer", "PRAGMA writable_schema = ON",
             "CREATE TEMP TABLE t (x)", "BEGIN IMMEDIATE", "VACUUM INTO '{dir}/copy.db'"],
)
def test_authorizer_alone_denies_writes(root, stmt):
    """Second layer: even past the SELECT/WITH check, the connection refuses anything but reads."""
    db = db_file(root)
    before, files = digest(db), sorted(db.parent.iterdir())
    con = sql.connect_readonly(db)
    with pytest.raises(sqlite3.DatabaseError):
        con.execute(stmt.format(dir=db.parent))
    con.close()
    assert digest(db) == before and sorted(db.parent.iterdir()) == files


def test_endless_query_times_out(root, task):
    before = digest(db_file(root))
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT count(*) FROM c"
    t0 = time.monotonic()
    s = task.score(task.docs()[0], [forever])
    assert s["exec"] == 0.0 and "time limit" in s["pred_error"]
    assert time.monotonic() - t0 < 5
    assert digest(db_file(root)) == before


def test_endless_rows_are_capped(root):
    with pytest.raises(sql.SQLError, match="rows"):
        sql.execute(db_file(root), "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c) SELECT x FROM c",
                    timeout_s=5, max_rows=1000)


def test_missing_database_is_marked_and_others_continue(task):
    docs = task.docs()
    scores = [task.score(d, [f"```sql\n{d['query']}\n```"]) for d in docs]
    assert scores[3]["exec"] is None and "missing database" in scores[3]["error"] and "ghost" in scores[3]["error"]
    assert [s["exec"] for s in scores[:3]] == [1.0, 1.0, 1.0]
    agg = task.aggregate(scores)
    assert agg["exec"] == 1.0 and agg["exec_n"] == 3 and agg["n_unscored"] == 1


def test_malformed_files_name_file_and_line(tmp_path):
    bad_json = tmp_path / "dev.json"
    bad_json.write_text('[\n {"db_id": "a",\n  "question": }\n]')
    with pytest.raises(DataError, match=r"dev\.json, line 3"):
        build_task(DatasetConfig(name="spider", path=str(bad_json))).docs()
    bad_jsonl = tmp_path / "dev.jsonl"
    bad_jsonl.write_text(json.dumps(DEV[0]) + "\n{oops\n")
    with pytest.raises(DataError, match=r"dev\.jsonl, line 2"):
        build_task(DatasetConfig(name="spider", path=str(bad_jsonl))).docs()
    missing = tmp_path / "fields.jsonl"
    missing.write_text(json.dumps({"db_id": "a", "question": "q"}) + "\n")
    with pytest.raises(DataError, match=r"fields\.jsonl, line 1: missing field\(s\) \['query'\]"):
        build_task(DatasetConfig(name="spider", path=str(missing))).docs()


def test_extract_sql():
    assert sql.extract_sql("```sql\nSELECT 1;\n```") == "SELECT 1"
    assert sql.extract_sql("SELECT a\nFROM t;\nSELECT b") == "SELECT a\nFROM t"
    assert sql.extract_sql("SELECT a FROM t\n\nExplanation: ...") == "SELECT a FROM t"
    assert sql.extract_sql(" a FROM t;", prefix="SELECT") == "SELECT a FROM t"
    assert sql.extract_sql("WITH x AS (SELECT 1) SELECT * FROM x", prefix="SELECT").startswith("WITH")


def test_prompts_hold_schema_and_question(task, tok):
    doc = task.docs()[0]
    chat = tok.decode(task.prompt_ids(doc, tok, chat=True))
    assert "CREATE TABLE singer" in chat and doc["question"] in chat and "```sql" in chat
    base = tok.decode(task.prompt_ids(doc, tok, chat=False))
    assert "CREATE TABLE singer" in base and base.rstrip().endswith(f"-- Question: {doc['question']}\nSELECT")
    assert task.stop_strings(chat=False) == [";", "\n\n"]


@pytest.fixture(scope="module")
def tok():
    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    return load_tokenizer_only(SMOLLM2)


def test_broken_sandbox_stops_scoring_instead_of_scoring_zero(task, monkeypatch):
    from pardec.metrics import sandbox

    sandbox.isolation()  # probed with the real interpreter
    sandbox.clear_canaries()
    monkeypatch.setattr(sys, "executable", "/nonexistent/pardec-venv/bin/python")  # the SQL child cannot start
    try:
        with pytest.raises(sandbox.SandboxError) as e:
            task.score(task.docs()[0], ["SELECT name FROM singer WHERE country = 'France'"])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("sandbox canary failed: a known-good query did not run (")
        assert "/nonexistent/pardec-venv/bin/python" in msg and "No such file or directory" in msg
    finally:
        monkeypatch.undo()
        sandbox.clear_canaries()
    assert task.score(task.docs()[0], ["SELECT name FROM singer WHERE country = 'France'"])["exec"] == 1.0
