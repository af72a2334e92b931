"""scripts/attention_ab.py on the tiny model: both versions timed per context and row count, each checked bitwise
against its own one-row steps, and the result file says what it compared."""

from __future__ import annotations

import json

import pytest

from scripts import attention_ab


def test_both_versions_are_timed_and_checked_and_the_file_is_written(tmp_path):
    out = tmp_path / "ab.json"
    result = attention_ab.main(["--base", "HEAD", "--model", "tiny_random", "--contexts", "20,530", "--rows", "1,3",
                                "--rounds", "1", "--repeats", "1", "--out", str(out)])
    timed = [c for c in result["cells"] if "rows" in c]
    assert [(c["context"], c["rows"]) for c in timed] == [(20, 1), (20, 3), (530, 1), (530, 3)]
    assert all(c["base_ms"] > 0 and c["this_ms"] > 0 for c in timed)
    checks = [c["bitwise_11_rows"] for c in result["cells"] if "bitwise_11_rows" in c]
    assert checks == [{"base": True, "this": True}] * 2
    saved = json.loads(out.read_text())
    assert saved["base"] == saved["commit"] and saved["n"] == 1 and saved["host"]["cores"] >= 1


def test_a_base_without_the_attention_is_refused():
    with pytest.raises(SystemExit):
        attention_ab.main(["--base", "not-a-commit", "--model", "tiny_random"])
