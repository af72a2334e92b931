"""Kept corpora (pardec.zoo.corpus): a corpus written over several builds, each going on from the records the zoo
keeps, none generated twice; what the repository keeps matches its record of it."""

from __future__ import annotations

import gzip
import json

import pytest

from pardec import REPO_ROOT, zoo
from pardec.training.completions import GenerateConfig, generate, generation_meta, load_completions
from pardec.training.stages import Prompt, read_part
from pardec.zoo import corpus
from tests.conftest import tiny

TEXTS = ["Hello", "def f(n):\n    return", "The quick brown fox. " * 3, "Natalia sold clips.", "1 2 3"]


def _prompts(tok) -> list[Prompt]:
    return [Prompt(i, f"src/doc{i}", tok(t)["input_ids"]) for i, t in enumerate(TEXTS)]


def _gen(out_dir) -> GenerateConfig:
    return GenerateConfig(max_new_tokens=5, batch_size=2, out_dir=str(out_dir))


def _plain(records):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


def test_a_corpus_is_written_over_two_machines_through_the_zoo_and_nothing_twice(tmp_path):
    lm = tiny()
    prompts = _prompts(lm.tokenizer)
    meta = generation_meta(_gen(tmp_path), {"name": "tiny", "data": f"{REPO_ROOT}/data/x.jsonl"}, set())
    ref = tmp_path / "ref"
    generate(_gen(ref), lm.model, 0, set(), prompts, meta)

    first = tmp_path / "machine1" / "train"  # the build of one machine: killed after 3 of 5 records
    assert generate(_gen(first), lm.model, 0, set(), prompts, meta, stop_after=3) is None
    with (first / "part-0.jsonl").open("a") as f:
        f.write('{"schema_version": 1, "id": "src/doc4", "pro')  # cut mid-line by the kill
    kept = tmp_path / "zoo" / "corpora" / "c" / "train"
    info = corpus.keep(first, kept, log=lambda m: None)
    assert info["records"] == 3 and json.loads((kept / corpus.KEPT).read_text()) == info
    assert f"{corpus.HERE}/data/x.jsonl" in (kept / corpus.META).read_text()  # no machine's own path
    assert str(REPO_ROOT) not in (kept / corpus.META).read_text()

    second = tmp_path / "machine2" / "train"  # a fresh machine: the zoo's records, then the rest
    assert corpus.restore(kept, second, log=lambda m: None) == 3
    assert json.loads((second / corpus.META).read_text()) == meta
    assert corpus.restore(kept, second, log=lambda m: None) == 0  # already there: nothing added
    stats = generate(_gen(second), lm.model, 0, set(), prompts, meta)
    assert stats["complete"] and stats["prompts"] == 5
    assert len(read_part(second / "part-0.jsonl")) == 2  # only the two the first machine had not written
    assert _plain(load_completions(second)) == _plain(load_completions(ref))
    assert corpus.keep(second, kept, log=lambda m: None)["records"] == 5  # the grown corpus replaces the kept one
    with gzip.open(kept / corpus.RECORDS, "rt") as f:
        assert [json.loads(line)["index"] for line in f] == [0, 1, 2, 3, 4]


def test_a_kept_corpus_that_does_not_match_its_record_or_the_run_is_not_restored(tmp_path):
    lm = tiny()
    meta = generation_meta(_gen(tmp_path), {"name": "tiny"}, set())
    out = tmp_path / "run" / "train"
    generate(_gen(out), lm.model, 0, set(), _prompts(lm.tokenizer), meta, stop_after=2)
    kept = tmp_path / "kept" / "train"
    corpus.keep(out, kept, log=lambda m: None)
    assert corpus.restore(tmp_path / "nothing", tmp_path / "fresh", log=lambda m: None) == 0
    assert not (tmp_path / "fresh").exists()

    other = tmp_path / "other" / "train"  # generated with other settings: left to the generation's own check
    other.mkdir(parents=True)
    (other / "meta.json").write_text(json.dumps({**meta, "max_new_tokens": 9}))
    said = []
    assert corpus.restore(kept, other, log=said.append) == 0 and "other settings" in said[0]
    assert sorted(p.name for p in other.iterdir()) == ["meta.json"]

    with gzip.open(kept / corpus.RECORDS, "at") as f:
        f.write('{"id": "forged"}\n')
    with pytest.raises(zoo.ZooError, match=r"does not match its kept.json.*git checkout"):
        corpus.restore(kept, tmp_path / "fresh", log=lambda m: None)
    assert corpus.keep(tmp_path / "empty", tmp_path / "k2", log=lambda m: None) is None


def test_the_build_restores_the_kept_corpus_before_generating_and_keeps_it_after(tmp_path, monkeypatch):
    from pardec.zoo import build

    out, kept = tmp_path / "data" / "c" / "train", tmp_path / "zoo" / "smollm2" / "corpora" / "c" / "train"

    class Entry:
        name, stages, zoo, keep_corpus, run_dir = "stub", ("generate", "train"), "smollm2", True, tmp_path / "run"

        def command(self, stage):
            return [f"stage={stage}"]

    record = {"id": "a", "index": 0, "completion_ids": [1]}
    kept.mkdir(parents=True)
    (kept / corpus.META).write_text('{"m": 1}')
    with gzip.open(kept / corpus.RECORDS, "wt") as f:
        f.write(json.dumps(record) + "\n")
    (kept / corpus.KEPT).write_text(json.dumps({"records": 1, "sha256": zoo.sha256_file(kept / corpus.RECORDS)}))
    monkeypatch.setattr(zoo, "ZOO_DIR", tmp_path / "zoo")
    monkeypatch.setattr(corpus, "out_dir_of", lambda entry: out)
    seen = []

    def stage(entry, name, argv, log, beat=None):  # the generation: what it finds, then one more record
        seen.append((name, sorted(p.name for p in out.iterdir()) if out.is_dir() else None))
        if name == "generate":
            with (out / "part-0.jsonl").open("a") as f:
                f.write(json.dumps({**record, "id": "b", "index": 1}) + "\n")
        return {"wall_s": 1.0, "started": "now"}

    monkeypatch.setattr(build, "run_stage", stage)
    build.run_stages(Entry(), "r", lambda m: None)
    assert seen[0] == ("generate", ["meta.json", corpus.KEPT_PART])
    assert json.loads((kept / corpus.KEPT).read_text())["records"] == 2


def test_keep_corpus_names_the_entries_that_keep_one():
    from pardec.zoo.__main__ import main

    assert main(["keep-corpus", "medusa"]) == 2


def test_every_kept_corpus_matches_its_record_and_belongs_to_an_entry_that_keeps_it():
    for z in zoo.zoos():
        owners = {corpus.kept_dir(e, corpus.out_dir_of(e)) for e in zoo.entries(z).values() if e.keep_corpus}
        for d in sorted((zoo.ZOO_DIR / z / "corpora").glob("*/*")):
            info = json.loads((d / corpus.KEPT).read_text())
            assert d in owners, f"{d}: no entry of conf/zoo/{z}.yaml keeps this corpus"
            assert zoo.sha256_file(d / corpus.RECORDS) == info["sha256"]
            with gzip.open(d / corpus.RECORDS, "rt") as f:
                assert sum(1 for _ in f) == info["records"]
