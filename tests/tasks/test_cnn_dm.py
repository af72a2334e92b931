"""CNN/DailyMail: ROUGE on known strings, article truncation, local JSONL loading."""

from __future__ import annotations

import json

import pytest

from pardec.config import DatasetConfig
from pardec.metrics.text import bleu, rouge
from pardec.tasks import build_task
from pardec.tasks.base import DataError
from pardec.tasks.cnn_dm import truncate_words


@pytest.fixture(scope="module")
def tok():
    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    return load_tokenizer_only(SMOLLM2)


def make_task(tmp_path, rows, **extra):
    p = tmp_path / "cnn.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return build_task(DatasetConfig(name="cnn_dm", path=str(p), extra=extra))


def test_rouge_known_values():
    s = rouge("the cat sat on the mat", "the cat was on the mat")
    assert s["rouge1"] == pytest.approx(5 / 6)  # 5 of 6 unigrams shared both ways
    assert s["rouge2"] == pytest.approx(3 / 5)  # the-cat, on-the, the-mat
    assert s["rougeL"] == pytest.approx(5 / 6)  # LCS "the cat on the mat"
    assert rouge("identical words here", "identical words here") == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert rouge("nothing shared", "completely different")["rougeL"] == 0.0
    assert rouge("cats running", "cat runs")["rouge1"] == 1.0  # Porter stemming on


def test_bleu_known_values():
    assert bleu(["the cat sat on the mat"], ["the cat sat on the mat"]) == pytest.approx(100.0)
    assert bleu(["xyz"], ["the cat sat on the mat"]) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="1 predictions but 2 references"):
        bleu(["a"], ["a", "b"])


def test_score_and_aggregate(tmp_path):
    task = make_task(tmp_path, [{"article": "a", "highlights": "the cat was on the mat"}])
    doc = task.docs()[0]
    s = task.score(doc, ["  the cat sat on the mat\n"])
    assert s["rougeL"] == pytest.approx(5 / 6)
    agg = task.aggregate([s, task.score(doc, ["dog"])])
    assert agg[task.metric] == pytest.approx(5 / 12) and agg["rougeL_n"] == 2


def test_truncate_words():
    assert truncate_words("one  two\nthree four", 3) == "one two three"
    assert truncate_words("short", 400) == "short"


def test_prompt_truncates_article(tmp_path, tok):
    article = " ".join(f"w{i}" for i in range(1000))
    task = make_task(tmp_path, [{"article": article, "highlights": "h", "id": "abc"}], max_article_words=10)
    doc = task.docs()[0]
    assert doc["id"] == "abc"
    chat = tok.decode(task.prompt_ids(doc, tok, chat=True))
    assert "Summarize: w0 w1" in chat and " w9" in chat and "w10" not in chat
    base = tok.decode(task.prompt_ids(doc, tok, chat=False))
    assert base.startswith("Summarize: w0") and base.endswith("w9\nSummary:")
    default = make_task(tmp_path, [{"article": article, "highlights": "h"}])
    assert default.prompt_text(default.docs()[0]).split()[-1] == "w399"  # 400 words by default


def test_docs_ids_and_errors(tmp_path):
    task = make_task(tmp_path, [{"article": "a", "highlights": "b"}, {"article": "c", "highlights": "d"}])
    assert [d["id"] for d in task.docs()] == ["0", "1"]
    with pytest.raises(DataError, match=r"cnn\.jsonl, line 2: missing field\(s\) \['highlights'\]"):
        make_task(tmp_path, [{"article": "a", "highlights": "b"}, {"article": "c"}]).docs()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"article": "a", "highlights": "b"}\n{"article": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2"):
        build_task(DatasetConfig(name="cnn_dm", path=str(bad))).docs()
    with pytest.raises(DataError, match="max_article_words=0"):
        make_task(tmp_path, [{"article": "a", "highlights": "b"}], max_article_words=0).prompt_text({"article": "a"})
