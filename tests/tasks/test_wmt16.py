"""WMT16: local loading, prompts, corpus BLEU."""

from __future__ import annotations

import json

import pytest

from pardec.config import DatasetConfig
from pardec.tasks import build_task
from pardec.tasks.base import DataError

ROWS = [{"translation": {"de": "Die Katze sitzt auf der Matte.", "en": "The cat sits on the mat."}},
        {"de": "Guten Morgen.", "en": "Good morning.", "id": "x"}]


@pytest.fixture
def task(tmp_path):
    p = tmp_path / "wmt.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return build_task(DatasetConfig(name="wmt16", path=str(p)))


def test_docs_and_bleu(task):
    docs = task.docs()
    assert [d["id"] for d in docs] == ["0", "x"] and docs[1]["source"] == "Guten Morgen."
    perfect = task.aggregate([task.score(d, [" " + d["reference"] + "\n"]) for d in docs])
    assert perfect["bleu"] == pytest.approx(100.0) and perfect["bleu_n"] == 2
    worse = task.aggregate([task.score(docs[0], ["A dog sits on the mat."]), task.score(docs[1], ["Good morning."])])
    assert 0 < worse["bleu"] < 100


def test_prompts(task):
    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    tok = load_tokenizer_only(SMOLLM2)
    doc = task.docs()[0]
    assert tok.decode(task.prompt_ids(doc, tok, chat=False)) == f"German: {doc['source']}\nEnglish:"
    assert "into English" in tok.decode(task.prompt_ids(doc, tok, chat=True))


def test_bad_direction_and_fields(tmp_path):
    with pytest.raises(DataError, match="extra.source='xx' is not valid; choose one of"):
        build_task(DatasetConfig(name="wmt16", extra={"source": "xx"}))
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"de": "Hallo"}) + "\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 1: needs 'de' and 'en'"):
        build_task(DatasetConfig(name="wmt16", path=str(p))).docs()
