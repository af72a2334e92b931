"""HumanEval task: offline loading, prompts in both styles (real SmolLM2 tokenizer), scoring by execution."""

from __future__ import annotations

import gzip
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from pardec.config import ConfigError, DatasetConfig
from pardec.tasks import build_task
from pardec.tasks.base import DataError
from pardec.tasks.humaneval import CHAT_STOP, STOP


@pytest.fixture(scope="module")
def task():
    return build_task(DatasetConfig(name="humaneval"), timeout_s=5.0)


@pytest.fixture(scope="module")
def docs(task):
    return {d["id"]: d for d in task.docs()}


@pytest.fixture(scope="module")
def tok():
    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    return load_tokenizer_only(SMOLLM2)


def test_all_164_problems_load_offline(docs):
    assert len(docs) == 164 and list(docs)[0] == "HumanEval/0" and "HumanEval/163" in docs
    for d in docs.values():
        assert {"prompt", "test", "entry_point", "canonical_solution"} <= set(d)


@pytest.mark.slow  # 164 programs in the sandbox
def test_every_canonical_solution_passes(task, docs):
    """Also proves the sandbox's guard lets ordinary test code (hashlib, math, ...) run."""
    with ThreadPoolExecutor(2) as pool:
        scores = list(pool.map(lambda d: task.score(d, [d["canonical_solution"]]), docs.values()))
    failed = [i for i, s in zip(docs, scores) if s != {"pass": 1.0}]
    assert failed == []
    assert task.aggregate(scores)["pass"] == 1.0


def test_wrong_body_fails(task, docs):
    assert task.score(docs["HumanEval/0"], ["    return not True\n"]) == {"pass": 0.0}
    assert task.score(docs["HumanEval/2"], ["    return number\n"]) == {"pass": 0.0}  # 3.5 -> 3.5, not 0.5
    assert task.score(docs["HumanEval/2"], ["    return number % 1.0\n"]) == {"pass": 1.0}
    assert task.score(docs["HumanEval/0"], ["    return (\n"]) == {"pass": 0.0}  # syntax error


def test_code_that_never_ends_scores_zero_in_bounded_time(docs):
    task = build_task(DatasetConfig(name="humaneval"), timeout_s=1.0)
    t0 = time.monotonic()
    assert task.score(docs["HumanEval/0"], ["    while True:\n        pass\n"]) == {"pass": 0.0}
    assert time.monotonic() - t0 < 3.0


def test_program_assembly(task, docs):
    d = docs["HumanEval/0"]
    module, check = task.program(d, "    return False\n")
    assert module.startswith(d["prompt"] + "    return False\n") and module.endswith(d["test"] + "\n")
    assert check == "check(has_close_elements)"


def test_stop_strings():
    assert set(STOP) == {"\nclass", "\ndef", "\n#", "\nif __name__", "\nprint("}
    assert CHAT_STOP == ["\n```"]


def test_base_prompt_is_the_raw_problem(task, docs, tok):
    d = docs["HumanEval/10"]
    ids = task.prompt_ids(d, tok, chat=False)
    assert ids == tok(d["prompt"])["input_ids"] and tok.decode(ids) == d["prompt"]


def test_chat_prompt_prestarts_the_answer(task, docs, tok):
    d = docs["HumanEval/10"]
    text = tok.decode(task.prompt_ids(d, tok, chat=True))
    assert text.count(d["prompt"]) == 1  # in the user's request; the answer starts an empty code block
    assert text.endswith("<|im_start|>assistant\n```python\n")
    assert "Complete the following Python function" in text


def test_one_turn_and_one_completion(task, docs, tok):
    with pytest.raises(ValueError, match="one turn"):
        task.prompt_ids(docs["HumanEval/0"], tok, chat=True, history=["x"])
    with pytest.raises(ValueError, match="one completion"):
        task.score(docs["HumanEval/0"], ["a", "b"])


def _problem(i: int) -> dict:
    return {"task_id": f"Local/{i}", "prompt": f"def f{i}(x):\n", "entry_point": f"f{i}",
            "test": f"def check(c):\n    assert c(2) == {i} + 2\n", "canonical_solution": f"    return x + {i}\n"}


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_local_file_override(tmp_path, suffix):
    path = tmp_path / f"he{suffix}"
    text = "".join(json.dumps(_problem(i)) + "\n" for i in range(3))
    path.write_bytes(gzip.compress(text.encode()) if suffix.endswith(".gz") else text.encode())
    task = build_task(DatasetConfig(name="humaneval", path=str(path)))
    docs = task.docs()
    assert [d["id"] for d in docs] == ["Local/0", "Local/1", "Local/2"]
    assert task.score(docs[1], [docs[1]["canonical_solution"]]) == {"pass": 1.0}


def test_bad_local_files_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_problem(0)) + "\n{not json\n")
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: malformed JSON"):
        build_task(DatasetConfig(name="humaneval", path=str(bad))).docs()
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"task_id": "x", "prompt": "p"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: missing HumanEval field\(s\) \['test', 'entry_point'\]"):
        build_task(DatasetConfig(name="humaneval", path=str(missing))).docs()
    with pytest.raises(DataError, match="does not exist"):
        build_task(DatasetConfig(name="humaneval", path=str(tmp_path / "nope.jsonl.gz"))).docs()


def test_bad_extra_options_raise():
    with pytest.raises(ConfigError, match="memory_mbb"):
        build_task(DatasetConfig(name="humaneval", extra={"memory_mbb": 10}))
    with pytest.raises(ConfigError, match="memory_mb=8"):
        build_task(DatasetConfig(name="humaneval", extra={"memory_mb": 8}))


def test_chat_completion_with_the_whole_function_is_scored(task, docs):
    d = docs["HumanEval/2"]  # truncate_number
    whole = "def truncate_number(number: float) -> float:\n    return number % 1.0"
    assert task.score(d, [whole]) == {"pass": 1.0}
    assert task.score(d, [whole.replace("% 1.0", "// 1.0")]) == {"pass": 0.0}


def test_broken_sandbox_stops_scoring_instead_of_scoring_zero(task, docs, monkeypatch):
    from pardec.metrics import sandbox

    d = docs["HumanEval/0"]
    sandbox.isolation()  # probed with the real interpreter
    sandbox.clear_canaries()
    monkeypatch.setattr(sys, "executable", "/nonexistent/pardec-venv/bin/python")  # no program can start
    try:
        with pytest.raises(sandbox.SandboxError) as e:
            task.score(d, [d["canonical_solution"]])
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("sandbox canary failed: a known-good program ")
        assert "/nonexistent/pardec-venv/bin/python" in msg and "No such file or directory" in msg
    finally:
        monkeypatch.undo()
        sandbox.clear_canaries()
    assert task.score(d, [d["canonical_solution"]]) == {"pass": 1.0}


def test_canary_runs_with_the_task_memory_limit(monkeypatch):
    from pardec.tasks import humaneval

    seen = []
    monkeypatch.setattr(humaneval, "check_programs", lambda memory_mb=1024: seen.append(memory_mb))
    build_task(DatasetConfig(name="humaneval", extra={"memory_mb": 256})).check_sandbox()
    assert seen == [256]
