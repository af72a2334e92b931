"""MT-Bench: two-turn prompts and FastChat-style judging against a fake judge server on 127.0.0.1."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pardec.config import ConfigError, DatasetConfig
from pardec.metrics.judge import parse_rating
from pardec.tasks import build_task
from pardec.tasks.mt_bench import reference_answers

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["Write a haiku about rain.", "Now make it rhyme."]},
    {"question_id": 111, "category": "math", "turns": ["Area of the triangle?", "Area of the circumscribed circle?"]},
]


class FakeJudge(BaseHTTPRequestHandler):
    """Replies according to ``server.replies`` (a list consumed per request; the last one repeats)."""

    def do_POST(self):  # noqa: N802 (http.server's naming)
        srv = self.server
        srv.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        kind = srv.replies.pop(0) if len(srv.replies) > 1 else srv.replies[0]
        if isinstance(kind, int):
            self.send_response(kind)
            self.end_headers()
            self.wfile.write(b"server trouble")
            return
        body = json.dumps({"choices": [{"message": {"role": "assistant", "content": kind}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # keep test output quiet
        pass


@pytest.fixture(scope="module")
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), FakeJudge)
    srv.requests, srv.replies = [], ["Rating: [[8]]"]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def judge(server):
    """Reset the fake judge; ``judge(*replies)`` sets what it answers and returns the base_url."""

    def set_replies(*replies):
        server.requests.clear()
        server.replies[:] = list(replies)
        return f"http://127.0.0.1:{server.server_address[1]}/v1"

    return set_replies


@pytest.fixture(scope="module")
def qfile(tmp_path_factory):
    p = tmp_path_factory.mktemp("mt") / "question.jsonl"
    p.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return p


@pytest.fixture(scope="module")
def tok():
    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    return load_tokenizer_only(SMOLLM2)


def make_task(qfile, base_url=None, **judge):
    cfg = {"base_url": base_url, "model": "judge-x", "max_retries": 2, "backoff_s": 0.001, "timeout_s": 5, **judge}
    return build_task(DatasetConfig(name="mt_bench", path=str(qfile), extra={"judge": cfg}))


def test_docs(qfile):
    task = make_task(qfile)
    docs = task.docs()
    assert task.n_turns == 2 and [d["id"] for d in docs] == ["81", "111"]
    assert docs[0]["reference"] is None and docs[1]["reference"] == reference_answers()[111]


def test_hub_rows_map_to_fastchat_ids(tmp_path):
    p = tmp_path / "h4.jsonl"  # HuggingFaceH4/mt_bench_prompts layout; 22339468 is question 111's hash
    p.write_text(json.dumps({"prompt": QUESTIONS[1]["turns"], "prompt_id": 22339468, "category": "math",
                             "reference": ["human ref"]}) + "\n")
    (doc,) = make_task(p).docs()
    assert doc["id"] == "111" and doc["reference"] == reference_answers()[111]


def test_two_turn_prompt_uses_history(qfile, tok):
    task = make_task(qfile)
    doc = task.docs()[0]
    t1 = tok.decode(task.prompt_ids(doc, tok, chat=True))
    assert doc["turns"][0] in t1 and doc["turns"][1] not in t1
    t2 = tok.decode(task.prompt_ids(doc, tok, chat=True, history=["MY OWN HAIKU"]))
    i, j, k = (t2.index(s) for s in (doc["turns"][0], "MY OWN HAIKU", doc["turns"][1]))
    assert i < j < k and t2.rstrip().endswith("assistant")
    base = tok.decode(task.prompt_ids(doc, tok, chat=False, history=["MY OWN HAIKU"]))
    assert base.index("MY OWN HAIKU") < base.index(doc["turns"][1]) and base.endswith("### Assistant:\n")
    with pytest.raises(ValueError, match="2 turns"):
        task.prompt_ids(doc, tok, chat=True, history=["a", "b"])


def test_good_judge_reply_is_parsed(qfile, judge, server):
    task = make_task(qfile, judge("Fine answer. Rating: [[8.5]]"))
    s = task.score(task.docs()[0], ["haiku", "rhyming haiku"])
    assert (s["score_t1"], s["score_t2"], s["score"]) == (8.5, 8.5, 8.5) and "judge_error" not in s
    assert len(server.requests) == 2
    req1, req2 = server.requests
    assert req1["model"] == "judge-x" and req1["temperature"] == 0
    assert req1["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert "[The Start of Assistant's Answer]\nhaiku\n" in req1["messages"][1]["content"]
    assert "Reference" not in req1["messages"][1]["content"]
    assert "### Assistant A:\nrhyming haiku" in req2["messages"][1]["content"]  # single-v1-multi-turn


def test_garbage_is_retried_then_none(qfile, judge, server):
    task = make_task(qfile, judge("I refuse to rate.", "Rating: [[42]]", "no rating"))
    t0 = time.monotonic()
    s = task.score(task.docs()[0], ["a", "b"])
    assert s["score_t1"] is None and s["score_t2"] is None and s["score"] is None
    assert "turn 1: after 3 attempts" in s["judge_error"] and "no [[rating]]" in s["judge_error"]
    assert len(server.requests) == 6 and time.monotonic() - t0 < 5  # 1 + 2 retries per turn


def test_garbage_then_good_recovers(qfile, judge, server):
    task = make_task(qfile, judge("???", "Rating: [[7]]"))
    s = task.score(task.docs()[0], ["a", "b"])
    assert (s["score_t1"], s["score_t2"]) == (7.0, 7.0) and len(server.requests) == 3


def test_server_error_retried_then_none(qfile, judge, server):
    task = make_task(qfile, judge(500))
    s = task.score(task.docs()[0], ["a", "b"])
    assert s["score"] is None and "HTTP 500" in s["judge_error"] and len(server.requests) == 6


def test_client_error_is_not_retried(qfile, judge, server):
    task = make_task(qfile, judge(401))
    s = task.score(task.docs()[0], ["a", "b"])
    assert s["score"] is None and "HTTP 401" in s["judge_error"] and len(server.requests) == 2


def test_server_down_gives_none_after_retries(qfile):
    with socket.socket() as sock:  # a port with nobody listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    task = make_task(qfile, f"http://127.0.0.1:{port}/v1")
    scores = [task.score(d, ["a", "b"]) for d in task.docs()]
    assert all(s["score"] is None and "after 3 attempts" in s["judge_error"] for s in scores)
    agg = task.aggregate(scores)
    assert agg["score"] is None and agg["n_judge_errors"] == 2


def test_no_judge_scores_none(qfile):
    task = make_task(qfile)
    s = task.score(task.docs()[0], ["a", "b"])
    assert s == {"score": None, "score_t1": None, "score_t2": None, "judge": "not configured"}
    agg = task.aggregate([s, s])
    assert agg["score"] is None and agg["judge"] == "not configured" and agg["score_n"] == 0


def test_math_uses_reference_prompts(qfile, judge, server):
    task = make_task(qfile, judge("[[3]]"))
    doc = task.docs()[1]
    task.score(doc, ["It is 3.", "It is 5 pi."])
    ref1, ref2 = reference_answers()[111]
    t1, t2 = (r["messages"][1]["content"] for r in server.requests)
    assert "[The Start of Reference Answer]\n" + ref1 in t1 and "[Question]\nArea of the triangle?" in t1
    assert "<|The Start of Reference Answer|>" in t2 and "### Reference answer:\n" + ref2 in t2
    assert "evaluate the quality" in server.requests[1]["messages"][0]["content"]  # multi-turn system prompt


def test_aggregate_is_mean_over_valid_turns(qfile):
    task = make_task(qfile)
    agg = task.aggregate([{"score_t1": 8.0, "score_t2": None, "score": 8.0, "judge_error": "turn 2: x"},
                          {"score_t1": 4.0, "score_t2": 6.0, "score": 5.0}])
    assert agg["score"] == pytest.approx(6.0) and agg["score_n"] == 3
    assert agg["score_t1"] == 6.0 and agg["score_t2"] == 6.0 and agg["n_judge_errors"] == 1


def test_parse_rating():
    assert parse_rating("Rating: [[8]]") == 8.0
    assert parse_rating("[[8.5]] and later [[2]]") == 8.5
    assert parse_rating("Rating: [7]") == 7.0  # FastChat's fallback pattern
    assert parse_rating("Rating: [[11]]") is None and parse_rating("eight") is None


def test_bad_judge_config_names_valid_keys(qfile):
    with pytest.raises(ConfigError, match="unknown key.*'url'.*valid keys: api_key_env"):
        build_task(DatasetConfig(name="mt_bench", path=str(qfile), extra={"judge": {"url": "x"}}))
