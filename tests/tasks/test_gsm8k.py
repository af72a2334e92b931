"""GSM8K task: answer extraction, scoring, local files, few-shot exemplars and prompts. No network."""

from __future__ import annotations

import json

import pytest

from pardec.config import ConfigError, DatasetConfig
from pardec.tasks import build_task
from pardec.tasks.base import DataError
from pardec.tasks.gsm8k import INSTRUCTION, extract_answer, reference, same_number

ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72"},
    {"question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
                 "How much did she earn?",
     "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nShe earned 0.2 x 50 = $<<0.2*50=10>>10.\n#### 10"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total is 2+1=<<2+1=3>>3 bolts\n#### 3"},
    {"question": "James writes a 3-page letter to 2 different friends twice a week. How many pages a year?",
     "answer": "He writes 3*2=<<3*2=6>>6 pages each time\nSo 6*2=<<6*2=12>>12 a week\n"
               "That means 12*52=<<12*52=624>>624 pages\n#### 624"},
    {"question": "A company's loss grew from $1,000 to $2,234 dollars. How much did it grow?",
     "answer": "2,234 - 1,000 = 1,234\n#### 1,234"},
    {"question": "The temperature was 4 degrees and fell by 7 degrees. What is it now?",
     "answer": "4 - 7 = -3\n#### -3"},
]


def _write(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture
def data(tmp_path) -> str:
    return _write(tmp_path / "gsm8k_test.jsonl", ROWS)


@pytest.fixture(scope="module")
def tok():
    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    return load_tokenizer_only(SMOLLM2)


@pytest.mark.parametrize("text, expected", [
    ("She sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("The total is 1,234 dollars.\n#### 1,234", "1234"),
    ("#### $1,234.50", "1234.50"),
    ("So she pays $18.", "18"),
    ("The answer is 42.", "42"),
    ("The final answer is $1,000.00.", "1000.00"),
    ("the answer is: 8 apples, since 4 * 2 = 8", "8"),
    ("The answer is 12. Check: 12 * 2 = 24", "12"),
    ("#### 72\n\nQuestion: Tom has 5 apples", "72"),  # "####" wins over later numbers
    ("4 - 7 = -3 degrees", "-3"),
    ("The temperature drops to \u22127 degrees", "-7"),
    ("It takes 10-20 minutes, so 20", "20"),
    ("It takes 10-20 minutes", "20"),  # a hyphen between numbers is not a minus sign
    ("Half of it is 0.5 of a pie", "0.5"),
    ("He pays 50% of 80, which is 40", "40"),
    ("The answer is 5%.", "5"),
    ("x = 3 and y = 4, so x*y = 12.", "12"),
    ("**Answer:** 15", "15"),
    ("In 2023 there were 1,200,000 people and 7 cities.", "7"),
    ("Total = 3 + 4 = 7\n####", "7"),  # "####" without a number falls back to the last number
    ("I do not know.", None),
    ("", None),
])
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_numeric_comparison_and_reference():
    assert same_number("18.00", "18") and same_number("-3", "-3.0") and not same_number("18.5", "18")
    assert reference(ROWS[0]["answer"]) == "72" and reference(ROWS[4]["answer"]) == "1234"
    assert reference("no marker 5") is None


def test_local_file_docs_and_scoring(data):
    task = build_task(DatasetConfig(name="gsm8k", path=data, split="test"))
    docs = task.docs()
    assert [d["id"] for d in docs] == [f"gsm8k/test/{i}" for i in range(len(ROWS))]
    assert [d["reference"] for d in docs] == ["72", "10", "3", "624", "1234", "-3"]
    d = docs[0]
    assert task.score(d, ["48 + 24 = 72\n#### 72"]) == {"correct": 1.0}
    assert task.score(d, ["The answer is 72.00."]) == {"correct": 1.0}
    assert task.score(d, ["So 72 clips in total, 24 in May."]) == {"correct": 0.0}  # last number: 24
    assert task.score(d, ["I am not sure."]) == {"correct": 0.0}
    assert task.score(docs[4], ["#### $1,234"]) == {"correct": 1.0}
    assert task.score(docs[5], ["It is now -3 degrees."]) == {"correct": 1.0}
    scores = [task.score(d, ["#### 72"]), task.score(d, ["#### 71"])]
    assert task.aggregate(scores)["correct"] == 0.5 and task.metric == "correct"


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps(ROWS[1]) + "\n{\"question\": oops}\n")
    with pytest.raises(DataError, match=r"broken\.jsonl, line 3: malformed JSON"):
        build_task(DatasetConfig(name="gsm8k", path=str(path))).docs()


def test_bad_records_name_the_record(tmp_path):
    no_gold = _write(tmp_path / "a.jsonl", [ROWS[0], {"question": "q?", "answer": "it is 5"}])
    with pytest.raises(DataError, match=r"a\.jsonl, line 2: the answer has no '#### <number>' line"):
        build_task(DatasetConfig(name="gsm8k", path=no_gold)).docs()
    no_field = _write(tmp_path / "b.jsonl", [{"prompt": "q?", "answer": "#### 5"}])
    with pytest.raises(DataError, match=r"line 1: need string fields 'question' and 'answer'; got keys"):
        build_task(DatasetConfig(name="gsm8k", path=no_field)).docs()


def test_offline_hub_failure_says_which_path_to_pass(monkeypatch):
    import datasets

    calls = []

    def offline(*args, **kwargs):
        calls.append((args, kwargs))
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"dataset\.path=<file>.*conf/dataset/gsm8k\.yaml"):
        build_task(DatasetConfig(name="gsm8k")).docs()
    assert calls == [(("openai/gsm8k", "main"), {"split": "test"})]


def _fewshot_task(data: str, k: int, seed: int = 1234):
    extra = {"num_fewshot": k, "fewshot_seed": seed, "train_path": data}
    return build_task(DatasetConfig(name="gsm8k", path=data, extra=extra))


def test_fewshot_is_deterministic_and_never_the_doc(data):
    task = _fewshot_task(data, k=len(ROWS) - 1)  # every other row: the doc itself is the one left out
    for d in task.docs():
        shots = task.fewshot(d)
        assert len(shots) == len(ROWS) - 1 and d["question"] not in [s["question"] for s in shots]
    task2 = _fewshot_task(data, k=2)
    again = _fewshot_task(data, k=2)
    docs = task2.docs()
    picks = [[s["question"] for s in task2.fewshot(d)] for d in docs]
    assert picks == [[s["question"] for s in again.fewshot(d)] for d in reversed(docs)][::-1]  # order-free
    other_seed = _fewshot_task(data, k=2, seed=7)
    assert picks != [[s["question"] for s in other_seed.fewshot(d)] for d in docs]
    assert all(d["question"] not in p for d, p in zip(docs, picks))


def test_fewshot_errors(data):
    task = _fewshot_task(data, k=len(ROWS))
    with pytest.raises(DataError, match=f"num_fewshot={len(ROWS)} but the train split has only {len(ROWS) - 1}"):
        task.fewshot(task.docs()[0])
    with pytest.raises(ConfigError, match="num_fewshot=-1"):
        build_task(DatasetConfig(name="gsm8k", extra={"num_fewshot": -1}))
    with pytest.raises(ConfigError, match=r"unknown dataset.extra key\(s\) \['n_shot'\]"):
        build_task(DatasetConfig(name="gsm8k", extra={"n_shot": 3}))


def test_base_prompt(data, tok):
    task = _fewshot_task(data, k=2)
    doc = task.docs()[3]
    text = tok.decode(task.prompt_ids(doc, tok, chat=False))
    assert text.endswith(f"Question: {doc['question']}\nAnswer:") and text.count("Question: ") == 3
    assert text.count("\n#### ") == 2 and "<<" not in text  # exemplar solutions, calculator notes removed
    zero = build_task(DatasetConfig(name="gsm8k", path=data))
    assert tok.decode(zero.prompt_ids(doc, tok, chat=False)) == f"Question: {doc['question']}\nAnswer:"
    assert task.stop_strings(chat=False) == ["\n\nQuestion:", "Question:"]


def test_chat_prompt(data, tok):
    task = _fewshot_task(data, k=2)
    doc = task.docs()[3]
    text = tok.decode(task.prompt_ids(doc, tok, chat=True))
    assert text.count("<|im_start|>user") == 3 and text.count("<|im_start|>assistant") == 3  # 2 shots + answer
    assert text.endswith(f"{doc['question']}\n\n{INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n")
    shots = task.fewshot(doc)
    assert all(s["question"] in text for s in shots) and "<<" not in text
    assert task.stop_strings(chat=True) == []
