"""Prompt-only corpora (code_search_net, sharegpt) read local files and build prompts."""

import json

import pytest

from pardec.config import DatasetConfig
from pardec.models.loading import SMOLLM2, load_tokenizer_only
from pardec.tasks.base import DataError, build_task


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer_only(SMOLLM2)


def test_code_search_net_local(tmp_path, tok):
    f = tmp_path / "csn.jsonl"
    f.write_text(json.dumps({"func_name": "utils.add", "func_documentation_string": "Add two numbers."}) + "\n"
                 + json.dumps({"func_name": "x", "func_documentation_string": "  "}) + "\n")
    task = build_task(DatasetConfig(name="code_search_net", path=str(f)))
    docs = task.docs()
    assert [d["name"] for d in docs] == ["add"]  # empty docstrings are skipped
    assert "Add two numbers." in tok.decode(task.prompt_ids(docs[0], tok, chat=True))
    assert tok.decode(task.prompt_ids(docs[0], tok, chat=False)).endswith("def add(")
    assert task.score(docs[0], ["..."]) == {}


def test_sharegpt_local_json_and_errors(tmp_path, tok):
    f = tmp_path / "sg.json"
    f.write_text(json.dumps([{"id": "a", "conversations": [{"from": "human", "value": "Hi there?"},
                                                            {"from": "gpt", "value": "Hello"}]},
                             {"id": "b", "conversations": [{"from": "gpt", "value": "no user first"}]}]))
    task = build_task(DatasetConfig(name="sharegpt", path=str(f)))
    docs = task.docs()
    assert [d["id"] for d in docs] == ["a"]
    assert "Hi there?" in tok.decode(task.prompt_ids(docs[0], tok, chat=True))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": 1}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl, line 1: no 'conversations' list"):
        build_task(DatasetConfig(name="sharegpt", path=str(bad))).docs()
    with pytest.raises(DataError, match="needs dataset.path"):
        build_task(DatasetConfig(name="sharegpt")).docs()
