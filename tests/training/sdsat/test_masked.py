"""SDSAT data stage: window statistics, masking by hand, adaptive tokens on tiny Llamas (tied and untied), and
``run_masking`` end to end (files, completions, datasets), killed and resumed, sharded, and its one-line errors."""

from __future__ import annotations

import copy
import functools
import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from pardec.config import ConfigError, DatasetConfig, ModelConfig
from pardec.models.adaptive import (
    ADAPTIVE_TOKEN,
    adaptive_of,
    adaptive_tokens,
    add_adaptive_tokens,
    attach_adaptive,
)
from pardec.models.loading import load_tokenizer
from pardec.tasks.base import DataError, end_of_turn_id
from pardec.training.sdsat.masked import (
    MASK_SCHEMA_VERSION,
    MaskConfig,
    apply_mask,
    check_masked_dir,
    corpus_records,
    load_masked,
    mask_windows,
    merge,
    parse_sources,
    run_masking,
)
from pardec.training.stages import read_part

DATA = Path(__file__).parents[1] / "data"
TEXTS = ["Hello there, general Kenobi.",
         "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
         "The quick brown fox jumps over the lazy dog. " * 4, "Natalia sold clips to 48 of her friends in April.",
         "1 2 3 4 5 6 7 8 9 10 11 12", "x"]
ID = {"name": "tiny_random"}


@functools.cache
def _base_tokenizer():
    return load_tokenizer(ModelConfig(name="tiny_random", source="tiny_random"))


def tokenizer():
    """A fresh copy of SmolLM2's tokenizer (the stage adds tokens to it)."""
    return copy.deepcopy(_base_tokenizer())


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------------------------------- masking
def _synthetic(k: int, seed: int = 0) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(n, rng.randint(0, n)) for n in (rng.randint(2, 300) for _ in range(k))]  # (n, start), start may be n


def test_mask_windows_statistics():
    ratio, L = 0.15, 5
    lengths = [0] * (L + 1)
    rel = []
    for i, (n, start) in enumerate(_synthetic(2000)):
        rng = random.Random(f"0/doc{i}")
        windows = mask_windows(n, start, ratio, L, rng)
        eligible = max(0, n - 1 - start)
        assert len(windows) == round(ratio * eligible)  # per record, exactly
        starts = [s for s, _ in windows]
        assert len(set(starts)) == len(starts) and all(start <= s < n - 1 for s in starts)
        for s, length in windows:
            assert 1 <= length <= L
            lengths[length] += 1
            rel.append((s - start + 0.5) / eligible)
        assert windows == mask_windows(n, start, ratio, L, random.Random(f"0/doc{i}"))  # seeded: reproducible
    total = sum(lengths)
    assert total > 5000
    chi2 = sum((c - total / L) ** 2 / (total / L) for c in lengths[1:])
    assert chi2 < 18.47  # 4 degrees of freedom, p = 0.001: lengths ~ U{1..L}
    assert abs(sum(rel) / len(rel) - 0.5) < 0.02  # starts spread uniformly over the eligible positions


def test_mask_windows_edges():
    rng = random.Random(0)
    assert mask_windows(1, 0, 1.0, 3, rng) == [] and mask_windows(5, 4, 1.0, 3, rng) == []
    assert mask_windows(5, 7, 1.0, 3, rng) == []
    assert sorted(s for s, _ in mask_windows(6, 1, 1.0, 3, rng)) == [1, 2, 3, 4]  # ratio 1: every eligible one
    assert mask_windows(30, 0, 0.01, 3, rng) == []  # round(0.29) == 0


def test_apply_mask_by_hand():
    ids = list(range(10, 20))  # n = 10: eligible [2, 9)
    windows = [(8, 5), (3, 2), (4, 3)]  # covers 8 (clipped at n-1), 3-4, 4-6 (merged with 3-4)
    same, n_same = apply_mask(ids, windows, 2, [100, 101, 102], diverse=False)
    assert same == [10, 11, 12, 100, 100, 100, 100, 17, 100, 19] and n_same == 5
    div, n_div = apply_mask(ids, windows, 2, [100, 101, 102], diverse=True)
    # 4 lies in (3, 2) at offset 1 and in (4, 3) at offset 0: the latest-starting window wins
    assert div == [10, 11, 12, 100, 100, 101, 102, 17, 100, 19] and n_div == 5
    assert apply_mask(ids, [], 2, [100], False) == (ids, 0)
    for bad in [(1, 2), (9, 1)]:
        with pytest.raises(ValueError, match=r"outside the eligible positions \[2, 9\)"):
            apply_mask(ids, [bad], 2, [100], False)


@pytest.mark.parametrize("diverse", [False, True])
def test_masked_positions_on_many_sequences(diverse):
    L, adaptive = 4, [900, 901, 902, 903]
    eligible = masked_total = 0
    for i, (n, start) in enumerate(_synthetic(500, seed=1)):
        ids = list(range(n))  # adaptive ids never occur in ids
        windows = mask_windows(n, start, 0.2, L, random.Random(i))
        masked, count = apply_mask(ids, windows, start, adaptive, diverse)
        where = [t for t in range(n) if masked[t] != ids[t]]
        covered = {t for s, length in windows for t in range(s, min(s + length, n - 1))}
        assert set(where) == covered and count == len(covered)  # overlaps merged, counted once
        assert all(start <= t < n - 1 for t in where)
        for t in where:
            j = adaptive.index(masked[t])
            assert j == (t - max(s for s, length in windows if s <= t < s + length) if diverse else 0) and j < L
            if t == 0 or masked[t - 1] == ids[t - 1]:
                assert j == 0  # the first adaptive token after a real one
        eligible += max(0, n - 1 - start)
        masked_total += count
    assert 0.2 < masked_total / eligible < 0.6  # ~ ratio * E[l] minus overlaps and clipping


# ------------------------------------------------------------------------------------------- adaptive tokens
def test_adaptive_token_strings_and_ids():
    assert adaptive_tokens(5, False) == [ADAPTIVE_TOKEN]
    assert adaptive_tokens(3, True) == ["<|sdsat_adaptive_1|>", "<|sdsat_adaptive_2|>", "<|sdsat_adaptive_3|>"]
    tok = tokenizer()
    n = len(tok)
    ids = add_adaptive_tokens(tok, adaptive_tokens(3, True))
    assert ids == [n, n + 1, n + 2] and len(tok) == n + 3
    assert add_adaptive_tokens(tok, adaptive_tokens(3, True)) == ids and len(tok) == n + 3  # idempotent
    assert add_adaptive_tokens(tok, [ADAPTIVE_TOKEN]) == [n + 3]
    assert n + 1 in tok("a <|sdsat_adaptive_2|> b", add_special_tokens=False)["input_ids"]  # never split
    assert tok.decode([n, 42], skip_special_tokens=True) == tok.decode([42])


def _model(vocab: int, tied: bool) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("diverse", [False, True])
def test_attach_adaptive(tmp_path, tied, diverse):
    tok = tokenizer()
    n = len(tok)
    model = _model(n, tied)
    emb0 = model.get_input_embeddings().weight.detach().clone()
    head0 = model.get_output_embeddings().weight.detach().clone()
    tokens = adaptive_tokens(3, diverse)
    ids = attach_adaptive(model, tok, tokens, 3, diverse)
    assert ids == list(range(n, n + len(tokens))) and len(tok) == n + len(tokens)
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.shape[0] == head.shape[0] == len(tok) == model.config.vocab_size
    assert (head is emb) == tied
    assert torch.equal(emb[:n], emb0) and torch.equal(head[:n], head0)  # ordinary rows untouched
    for w, w0 in ((emb, emb0), (head, head0)):
        assert torch.allclose(w[ids], w0.mean(0).expand(len(ids), -1), atol=1e-6)
    want = {"schema_version": 1, "adaptive_tokens": tokens, "adaptive_ids": ids, "max_span": 3, "diverse": diverse}
    assert adaptive_of(model.config) == want and adaptive_of(model.config.to_dict()) == want

    snapshot = {k: v.clone() for k, v in model.state_dict().items()}
    assert attach_adaptive(model, tok, tokens, 3, diverse) == ids and len(tok) == n + len(tokens)  # idempotent
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())

    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    assert adaptive_of(json.loads((tmp_path / "config.json").read_text())) == want
    loaded, tok2 = LlamaForCausalLM.from_pretrained(tmp_path).eval(), AutoTokenizer.from_pretrained(tmp_path)
    assert adaptive_of(loaded.config) == want and tok2.convert_tokens_to_ids(tokens) == ids
    assert (loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight) == tied
    assert attach_adaptive(loaded, tok2, tokens, 3, diverse) == ids  # a saved SDSAT model: nothing to do
    x = torch.tensor([[1, 2, ids[0], ids[-1]]])
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, model(x).logits, atol=1e-5)
    # the base tokenizer with a saved SDSAT model: the same ids come back
    assert attach_adaptive(loaded, tokenizer(), tokens, 3, diverse) == ids


def test_attach_adaptive_refuses_other_tokens_and_counts():
    tok = tokenizer()
    model = _model(len(tok), False)
    attach_adaptive(model, tok, adaptive_tokens(2, False), 2, False)
    with pytest.raises(ValueError, match="already carries other SDSAT adaptive tokens") as e:
        attach_adaptive(model, tok, adaptive_tokens(2, True), 2, True)
    _one_line(e)
    with pytest.raises(ValueError, match="need 3 token"):
        attach_adaptive(model, tok, adaptive_tokens(2, True), 3, True)
    assert adaptive_of({}) is None and adaptive_of(LlamaConfig()) is None
    with pytest.raises(ValueError, match="schema_version 0, this pardec reads 1"):
        adaptive_of({"sdsat": {"schema_version": 0}})


def test_attach_adaptive_keeps_a_padded_vocabulary():
    tok = tokenizer()
    model = _model(len(tok) + 64, True)  # more rows than the tokenizer has tokens (padded vocabulary)
    ids = attach_adaptive(model, tok, adaptive_tokens(1, False), 1, False)
    w = model.get_input_embeddings().weight
    assert w.shape[0] == len(tok) + 63 and torch.allclose(w[ids[0]], w[: ids[0]].mean(0), atol=1e-6)


# ------------------------------------------------------------------------------------------- the stage
def _corpus(tmp_path: Path) -> Path:
    f = tmp_path / "corpus.jsonl"
    rows = [{"text": t} for t in TEXTS] + [{"ids": list(range(5, 45)), "start": 10}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _cfg(tmp_path: Path, out: str = "masked", **kw) -> MaskConfig:
    base = {"out_dir": str(tmp_path / out), "ratio": 0.3, "max_span": 3, "batch_size": 2, "max_length": 24,
            "sources": [{"file": str(_corpus(tmp_path))}]}
    return MaskConfig(**{**base, **kw})


def _text(out: Path) -> str:
    return (out / "masked.jsonl").read_text()


def test_run_masking_file_end_to_end(tmp_path):
    tok = tokenizer()
    stats = run_masking(_cfg(tmp_path), tok, ID)
    meta, records = load_masked(tmp_path / "masked")
    n = len(TEXTS) + 1
    assert stats["complete"] and stats["records"] == stats["expected"] == n
    assert meta["adaptive_tokens"] == [ADAPTIVE_TOKEN] and meta["adaptive_ids"] == [len(tok) - 1]
    assert meta["model"] == ID and meta["sources"] == [{"file": str(tmp_path / "corpus.jsonl"), "max_docs": None}]
    assert [r["index"] for r in records] == list(range(n))
    assert [r["id"] for r in records] == [f"file:corpus/{i}" for i in range(1, n + 1)]
    assert stats["per_source"] == {"file:corpus": n}
    base = _base_tokenizer()
    for r, text in zip(records, TEXTS):
        full = base(text, add_special_tokens=False)["input_ids"]
        assert r["ids"] == full[-24:] and r["start"] == 0  # cut from the left to max_length
    last = records[-1]
    assert last["ids"] == list(range(21, 45)) and last["start"] == 0  # 40 ids cut to 24: the start (10) moved off
    for r in records:
        assert (r["masked_ids"], r["masked"]) == apply_mask(r["ids"], [tuple(w) for w in r["windows"]], r["start"],
                                                            meta["adaptive_ids"], False)
        assert len(r["windows"]) == round(0.3 * max(0, len(r["ids"]) - 1 - r["start"]))
    assert stats["eligible_positions"] == sum(max(0, len(r["ids"]) - 1 - r["start"]) for r in records)
    assert stats["masked_positions"] == sum(r["masked"] for r in records) > 0
    assert stats["masked_fraction"] == stats["masked_positions"] / stats["eligible_positions"]
    assert sum(stats["window_length_histogram"].values()) == stats["windows"] == sum(len(r["windows"]) for r in records)
    assert set(stats["window_length_histogram"]) <= {"1", "2", "3"}
    assert check_masked_dir(tmp_path / "masked") == meta


def test_run_masking_resumes_after_kill(tmp_path):
    ref = _cfg(tmp_path, "ref", diverse=True)
    run_masking(ref, tokenizer(), ID)
    cfg = _cfg(tmp_path, diverse=True)
    assert run_masking(cfg, tokenizer(), ID, stop_after=3) is None  # "killed" after 3 records
    part = tmp_path / "masked" / "part-0.jsonl"
    with part.open("a") as f:
        f.write('{"schema_version": 1, "id": "file:corpus/4", "ids": [1, ')  # and a half-written line
    with pytest.raises(FileNotFoundError, match=r"stats\.json does not exist.*stage=mask"):
        load_masked(cfg.out_dir)
    stats = run_masking(cfg, tokenizer(), ID)
    assert stats["complete"] and len(read_part(part)) == stats["records"] == 7  # no duplicates, no drops
    assert _text(tmp_path / "masked") == _text(tmp_path / "ref")
    assert load_masked(cfg.out_dir)[1] == load_masked(ref.out_dir)[1]

    other = _cfg(tmp_path, diverse=True, ratio=0.5)
    with pytest.raises(FileExistsError, match=r"other settings \(ratio was 0.3, now 0.5\).*mask\.overwrite=true"):
        run_masking(other, tokenizer(), ID)
    stats = run_masking(_cfg(tmp_path, diverse=True, ratio=0.5, overwrite=True), tokenizer(), ID)
    assert stats["complete"] and _text(tmp_path / "masked") != _text(tmp_path / "ref")


def test_two_ranks_equal_one(tmp_path):
    one = _cfg(tmp_path, "one")
    run_masking(one, tokenizer(), ID)
    two = _cfg(tmp_path, "two", batch_size=1)  # batch_size changes no record
    assert run_masking(two, tokenizer(), ID, rank=1, world=2) is None
    stats = run_masking(two, tokenizer(), ID, rank=0, world=2)
    assert stats["complete"] and _text(tmp_path / "two") == _text(tmp_path / "one")
    parts = [read_part(tmp_path / "two" / f"part-{r}.jsonl") for r in (0, 1)]
    assert [r["index"] % 2 for r in parts[0]] == [0] * 4 and [r["index"] % 2 for r in parts[1]] == [1] * 3
    assert merge(tmp_path / "two", 7) == stats


def _distill_dir(tmp_path: Path) -> Path:
    d = tmp_path / "distill"
    d.mkdir()
    rows = [{"schema_version": 1, "id": f"gsm8k/gsm8k/test/{i}", "source": "gsm8k", "index": i,
             "prompt_ids": list(range(100 + i, 110 + i)), "completion_ids": list(range(200, 205 + 3 * i)),
             "stop_reason": "eos", "seconds": 0.1} for i in range(4)]
    (d / "meta.json").write_text(json.dumps({"schema_version": 1}))
    (d / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "stats.json").write_text(json.dumps({"schema_version": 1, "prompts": 4, "complete": True}))
    return d


def test_run_masking_completions_and_file(tmp_path):
    d = _distill_dir(tmp_path)
    sources = [{"completions": str(d)}, {"file": str(_corpus(tmp_path)), "max_docs": 2}]
    stats = run_masking(_cfg(tmp_path, sources=sources, ratio=0.5), tokenizer(), ID)
    _, records = load_masked(tmp_path / "masked")
    assert stats["per_source"] == {"gsm8k": 4, "file:corpus": 2} and stats["records"] == 6
    for i, r in enumerate(records[:4]):
        full = list(range(100 + i, 110 + i)) + list(range(200, 205 + 3 * i))
        assert r["id"] == f"gsm8k/gsm8k/test/{i}" and r["ids"] == full[-24:]
        assert r["start"] == max(0, 10 - (len(full) - len(r["ids"])))  # the completion's start, moved by the cut
        assert all(s >= r["start"] for s, _ in r["windows"])
        assert r["masked_ids"][: r["start"]] == r["ids"][: r["start"]]  # the prompt is never masked
    assert [r["id"] for r in records[4:]] == ["file:corpus/1", "file:corpus/2"]


def test_completions_fraction(tmp_path):
    """``fraction`` keeps the first share of each source's completions (by prompt index), like the draft and drafter
    kinds' ``corpus_fraction``; the whole corpus keeps the normal form older meta.json files recorded."""
    d = _distill_dir(tmp_path)
    assert parse_sources([{"completions": str(d), "fraction": 1.0}]) == [{"completions": str(d)}]
    half = parse_sources([{"completions": str(d), "fraction": 0.5}])
    assert half == [{"completions": str(d), "fraction": 0.5}] and parse_sources(half) == half
    stats = run_masking(_cfg(tmp_path, sources=half), tokenizer(), ID)
    _, records = load_masked(tmp_path / "masked")
    assert stats["records"] == 2 and [r["id"] for r in records] == ["gsm8k/gsm8k/test/0", "gsm8k/gsm8k/test/1"]
    assert [r.id for r in corpus_records([{"completions": str(d), "fraction": 0.6}], tokenizer(), True)] == [
        f"gsm8k/gsm8k/test/{i}" for i in range(3)]  # ceil(0.6 * 4)


@pytest.mark.parametrize("chat", [True, False])
def test_corpus_records_from_datasets(chat):
    from pardec.tasks.base import build_task

    tok = _base_tokenizer()
    gsm = {"name": "gsm8k", "path": str(DATA / "gsm8k_tiny.jsonl")}
    records = corpus_records([{"dataset": gsm, "max_docs": 2}, {"dataset": {"name": "humaneval"}, "max_docs": 2}],
                             tok, chat)
    assert [r.id for r in records] == ["ref:gsm8k/gsm8k/test/0", "ref:gsm8k/gsm8k/test/1", "ref:humaneval/HumanEval/0",
                                       "ref:humaneval/HumanEval/1"]
    assert [r.index for r in records] == [0, 1, 2, 3] and records[0].source == "ref:gsm8k"
    tasks = {"ref:gsm8k": build_task(DatasetConfig(**gsm)), "ref:humaneval": build_task(DatasetConfig("humaneval"))}
    for r in records:
        task = tasks[r.source]
        doc = next(d for d in task.docs() if r.id == f"{r.source}/{d['id']}")
        assert r.ids[: r.start] == task.prompt_ids(doc, tok, chat)
    answer = tok.decode(records[0].ids[records[0].start :])
    assert "#### 8" in answer and "<<" not in answer  # calculator annotations removed
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tok) == end
    assert all((r.ids[-1] == end) == chat for r in records)  # a chat answer ends its turn, as the model's do
    code = tok.decode(records[2].ids[records[2].start :], skip_special_tokens=True)
    assert "return" in code and code.endswith("```") == chat and code.startswith("from typing") == chat


def test_end_of_turn_id_falls_back_to_eos():
    """A template that renders no special token after an assistant message: the tokenizer's EOS."""
    tok = tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    assert end_of_turn_id(tok) == tok.eos_token_id
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} <|im_start|><|im_end|>{% endfor %}"
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|im_start|>")  # the first special token after it


def test_dataset_without_reference_answers():
    with pytest.raises(ConfigError, match=r"mask\.sources\[0\]\.dataset\.name='cnn_dm' has no reference") as e:
        corpus_records([{"dataset": {"name": "cnn_dm"}}], _base_tokenizer(), True)
    _one_line(e)


# ------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(("kw", "msg"), [
    ({"max_span": 0}, "mask.max_span=0 is out of range: it must be an integer >= 1"),
    ({"ratio": 0.0}, "mask.ratio=0.0 is out of range: it must be in (0, 1]"),
    ({"ratio": 1.5}, "mask.ratio=1.5 is out of range: it must be in (0, 1]"),
    ({"max_length": 1}, "mask.max_length=1 is out of range: it must be an integer >= 2"),
    ({"batch_size": 0}, "mask.batch_size=0 is out of range: it must be an integer >= 1"),
    ({"sources": [{"file": "a.jsonl"}, {"text": "a"}]}, "mask.sources[1] must be one of {completions: <dir>, fraction: f}"),
    ({"sources": [{"file": "a.jsonl", "completions": "d"}]}, "mask.sources[0] must be one of"),
    ({"sources": [{"completions": "d", "max_docs": 3}]}, "mask.sources[0] must be one of"),
    ({"sources": [{"completions": "d", "fraction": 0}]}, "mask.sources[0].fraction=0 is out of range: it must be in (0, 1]"),
    ({"sources": [{"completions": "d", "fraction": 1.5}]}, "mask.sources[0].fraction=1.5 is out of range"),
    ({"sources": [{"file": "a.jsonl", "max_docs": 0}]}, "mask.sources[0].max_docs=0 is out of range"),
    ({"sources": [{"dataset": {"name": "gsm8k", "bogus": 1}}]}, "unknown key(s) ['bogus'] in mask.sources[0].dataset"),
])
def test_config_errors_are_one_line(kw, msg):
    with pytest.raises(ConfigError) as e:
        MaskConfig(**kw)
    assert msg in _one_line(e)


def test_source_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"mask\.sources is empty"):
        run_masking(MaskConfig(out_dir=str(tmp_path / "m")), tokenizer(), ID)
    corpus = str(_corpus(tmp_path))
    with pytest.raises(ConfigError, match=r"mask\.sources\[1\] repeats id 'file:corpus/1' of mask\.sources\[0\]"):
        corpus_records([{"file": corpus}, {"file": corpus}], _base_tokenizer(), True)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"ids": [1, 2], "start": 3}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl, line 2: need") as e:
        corpus_records([{"file": str(bad)}], _base_tokenizer(), True)
    _one_line(e)


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"run `python -m train \+experiment=<name> stage=mask`") as e:
        load_masked(tmp_path / "nothing")
    _one_line(e)
    cfg = _cfg(tmp_path)
    run_masking(cfg, tokenizer(), ID, rank=0, world=2)  # rank 1 never ran: merged but unfinished
    with pytest.raises(ConfigError, match="unfinished masked corpus") as e:
        check_masked_dir(cfg.out_dir)
    _one_line(e)
    run_masking(cfg, tokenizer(), ID, rank=1, world=2)
    merge(Path(cfg.out_dir), 7)
    out = Path(cfg.out_dir)
    lines = _text(out).splitlines()
    good = json.loads(lines[0])
    old = (rf"masked\.jsonl, line 1: schema_version 0, this pardec reads {MASK_SCHEMA_VERSION}; regenerate it with stage=mask "
           r"\(mask\.overwrite=true\)")
    no_windows = {k: v for k, v in good.items() if k != "windows"}
    missing = r"line 1: missing field\(s\) \['windows'\]"
    for broken, msg in [({**good, "schema_version": 0}, old), (no_windows, missing)]:
        (out / "masked.jsonl").write_text("\n".join([json.dumps(broken), *lines[1:]]) + "\n")
        with pytest.raises(ValueError, match=msg) as e:
            load_masked(out)
        _one_line(e)
    meta = json.loads((out / "meta.json").read_text())
    (out / "meta.json").write_text(json.dumps({**meta, "schema_version": 0}))
    with pytest.raises(ValueError, match=rf"meta\.json: schema_version 0, this pardec reads {MASK_SCHEMA_VERSION}; regenerate") as e:
        check_masked_dir(out)
    _one_line(e)
