"""pardec.jsonl: user data is read strictly (a malformed line anywhere, the last one included, and a byte that is not
UTF-8 are errors naming the file and the 1-based line, blank lines counted); only pardec's own append-only logs
(``torn_ok``) skip a last line a kill cut; JSON files name file, line and column; the datasets and run.json say
where."""

from __future__ import annotations

import json
import logging

import pytest

from pardec.config import ConfigError
from pardec.config.schema import DatasetConfig
from pardec.evaluation.spec import check_resume
from pardec.jsonl import read_json, read_jsonl, record_at
from pardec.tasks.base import DataError, build_task

GSM = {"question": "How many?", "answer": "It is 2.\n#### 2"}


def test_user_data_is_strict_and_names_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text(json.dumps(GSM) + "\n\n" + json.dumps(GSM) + "\n" + '{"question": "cut')
    with pytest.raises(ValueError, match=r"data\.jsonl, line 4: malformed JSON"):  # the last line too
        read_jsonl(f)
    with pytest.raises(DataError, match=r"data\.jsonl, line 4: malformed JSON"):
        build_task(DatasetConfig(name="gsm8k", path=str(f))).docs()
    f.write_bytes(json.dumps(GSM).encode() + b"\n" + b'{"question": "caf\xff", "answer": "#### 1"}\n')
    with pytest.raises(DataError, match=r"data\.jsonl, line 2: not UTF-8 \(byte 0xff\)"):
        build_task(DatasetConfig(name="gsm8k", path=str(f))).docs()
    f.write_text(json.dumps(GSM) + "\n\n\n" + json.dumps({"question": "q?", "answer": "no gold"}) + "\n")
    rows = read_jsonl(f)
    assert rows.lines == [1, 4] and record_at(rows, 1, f) == f"{f}, line 4"
    with pytest.raises(DataError, match=r"data\.jsonl, line 4: the answer has no '#### <number>' line"):
        build_task(DatasetConfig(name="gsm8k", path=str(f))).docs()
    assert record_at([GSM], 0, "hub/id") == "hub/id, record 1"  # rows without lines (the hub's)


def test_own_logs_skip_a_torn_last_line(tmp_path, caplog):
    f = tmp_path / "results.jsonl"
    f.write_text(json.dumps({"a": 1}) + "\n" + '{"a": ')
    with caplog.at_level(logging.WARNING):
        assert read_jsonl(f, torn_ok=True) == [{"a": 1}]
    assert "interrupted writer" in caplog.text
    read_jsonl(f, torn_ok=True, repair=True)
    assert f.read_text() == json.dumps({"a": 1}) + "\n"
    f.write_text(json.dumps({"a": 1}) + "\n" + json.dumps({"a": 2}))  # whole, only its newline missing: kept
    assert read_jsonl(f, torn_ok=True) == [{"a": 1}, {"a": 2}]


def test_json_files_name_file_line_and_column(tmp_path):
    f = tmp_path / "run.json"
    f.write_text('{\n  "method": "pld",\n  "max_new_tokens": \n')
    with pytest.raises(ValueError, match=r"run\.json, line 4 column 1: malformed JSON"):
        read_json(f)
    (tmp_path / "results.jsonl").write_text(json.dumps({"id": "a", "role": "baseline"}) + "\n")
    with pytest.raises(ConfigError, match=r"the run's identity .*run\.json, line 4 column 1: malformed JSON"):
        check_resume(tmp_path, {"method": "pld"})
    f.write_bytes(b'{"a": "\xfe"}')
    with pytest.raises(ValueError, match=r"run\.json, line 1: not UTF-8 \(byte 0xfe\)"):
        read_json(f)
