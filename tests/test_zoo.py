"""The zoo (pardec.zoo): stored forms and their inverse, manifests and their checks, ``zoo:<name>`` wherever a run
takes a drafter, and (slow tier) every artifact kept in the repository: complete, intact, exact when it decodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pardec import zoo
from pardec.config import ConfigError
from pardec.zoo.store import U_SUFFIX, V_SUFFIX, check_store, materialize, pack


@pytest.fixture
def tmp_zoo(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo, "ZOO_DIR", tmp_path / "zoo")
    monkeypatch.setattr("pardec.zoo.store.DATA_DIR", tmp_path / "data")
    return tmp_path / "zoo" / zoo.DEFAULT_TARGET


def _target(tmp_path: Path) -> tuple[Path, torch.Tensor]:
    d = tmp_path / "target"
    d.mkdir()
    emb = torch.randn(40, 8)
    save_file({"model.embed_tokens.weight": emb, "model.norm.weight": torch.ones(8)}, str(d / "model.safetensors"))
    return d, emb


def test_lowrank_store_keeps_only_the_delta_and_rebuilds_the_tensor(tmp_path, tmp_zoo, monkeypatch):
    weights, emb = _target(tmp_path)
    final = tmp_path / "final"
    (final / "trees").mkdir(parents=True)
    (final / "trees" / "T4.json").write_text("{}")
    (final / "drafter.json").write_text("{}")
    delta = torch.randn(40, 2) @ torch.randn(2, 8)  # rank 2
    heads = {"heads.0.1.weight": emb + delta, "heads.0.0.linear.weight": torch.randn(8, 8)}
    save_file(heads, str(final / "drafter.safetensors"))
    store = {"lowrank": {"tensors": r"heads\.\d+\.1\.weight", "base": ["lm_head.weight", "model.embed_tokens.weight"],
                         "rank": 2}}
    art = tmp_zoo / "medusa"
    info = pack(final, art, ["drafter.json", "drafter.safetensors", "trees"], store, weights)
    kept = load_file(str(art / "drafter.safetensors"))
    assert set(kept) == {"heads.0.1.weight" + U_SUFFIX, "heads.0.1.weight" + V_SUFFIX, "heads.0.0.linear.weight"}
    assert kept["heads.0.1.weight" + U_SUFFIX].shape == (40, 2)
    t = info["tensors"]["heads.0.1.weight"]
    assert t["base"] == "model.embed_tokens.weight" and t["rank"] == 2 and t["relative_error"] < 1e-5
    assert t["delta_energy_kept"] == pytest.approx(1.0)
    m = zoo.seal(art, {"name": "medusa", "target": {"name": "tiny"}, "store": info})
    monkeypatch.setattr("pardec.models.loading.weights_location", lambda cfg: weights)
    monkeypatch.setattr("pardec.models.loading.named_config", lambda name: name)
    full = materialize(art, m)
    assert full != art and (full / "trees" / "T4.json").is_file() and not (full / "manifest.json").exists()
    rebuilt = load_file(str(full / "drafter.safetensors"))
    assert set(rebuilt) == set(heads)
    torch.testing.assert_close(rebuilt["heads.0.1.weight"], heads["heads.0.1.weight"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rebuilt["heads.0.0.linear.weight"], heads["heads.0.0.linear.weight"], atol=0, rtol=0)
    assert materialize(art, m) == full  # built once


def test_target_delta_store_keeps_a_fine_tune_as_its_difference_from_the_target(tmp_path, tmp_zoo, monkeypatch):
    weights = tmp_path / "target"
    weights.mkdir()
    base = {"model.embed_tokens.weight": torch.randn(40, 8), "model.norm.weight": torch.ones(8),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8),
            "model.layers.0.mlp.up_proj.weight": torch.randn(12, 8)}
    save_file(base, str(weights / "model.safetensors"))
    final = tmp_path / "final"
    final.mkdir()
    (final / "config.json").write_text("{}")
    tuned = {**base,  # a merged LoRA of rank 2 on q_proj, a new token's embedding row, one layer of a new kind
             "model.layers.0.self_attn.q_proj.weight": base["model.layers.0.self_attn.q_proj.weight"]
             + torch.randn(8, 2) @ torch.randn(2, 8),
             "model.embed_tokens.weight": torch.cat([base["model.embed_tokens.weight"], torch.randn(1, 8)]),
             "model.extra.weight": torch.randn(3, 8)}
    save_file(tuned, str(final / "model.safetensors"))
    store = {"target_delta": {"tensors": r".*_proj\.weight", "rank": 2}}
    art = tmp_zoo / "sdsat"
    info = pack(final, art, ["*.json", "*.safetensors"], store, weights)
    kept = load_file(str(art / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj.weight"
    assert set(kept) == {q + U_SUFFIX, q + V_SUFFIX, "model.embed_tokens.weight.rows",
                         "model.embed_tokens.weight.row_ids", "model.extra.weight"}
    assert kept["model.embed_tokens.weight.row_ids"].tolist() == [40] and kept[q + U_SUFFIX].shape == (8, 2)
    assert sorted(info["unchanged"]) == ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert info["tensors"][q]["form"] == "lowrank" and info["tensors"][q]["relative_error"] < 1e-5
    assert info["tensors"]["model.embed_tokens.weight"] == {"base": "model.embed_tokens.weight", "form": "rows",
                                                            "rows": 41, "changed_rows": 1}
    m = zoo.seal(art, {"name": "sdsat", "target": {"name": "tiny"}, "store": info})
    monkeypatch.setattr("pardec.models.loading.weights_location", lambda cfg: weights)
    monkeypatch.setattr("pardec.models.loading.named_config", lambda name: name)
    full = materialize(art, m)
    assert (full / "config.json").is_file()
    rebuilt = load_file(str(full / "model.safetensors"))
    assert set(rebuilt) == set(tuned)
    for name, t in tuned.items():
        torch.testing.assert_close(rebuilt[name], t, atol=1e-5, rtol=1e-5)
    with pytest.raises(ConfigError, match="target_delta already reads every tensor"):
        check_store({**store, "from_target": {"a": "b"}}, "sdsat")
    with pytest.raises(ConfigError, match=r"store.target_delta=\{'rank': 0\} needs tensors"):
        check_store({"target_delta": {"rank": 0}}, "sdsat")


def test_bf16_store_casts_floating_tensors_only(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    save_file({"w": torch.randn(4, 4), "ids": torch.arange(4)}, str(final / "drafter.safetensors"))
    pack(final, tmp_path / "art", ["drafter.safetensors"], {"dtype": "bf16"}, None)
    kept = load_file(str(tmp_path / "art" / "drafter.safetensors"))
    assert kept["w"].dtype == torch.bfloat16 and kept["ids"].dtype == torch.int64


def _artifact(root: Path, name: str = "eagle3", target: str = "tiny") -> Path:
    d = root / name
    d.mkdir(parents=True)
    (d / "drafter.json").write_text("{}")
    (d / "drafter.safetensors").write_bytes(b"weights")
    zoo.seal(d, {"name": name, "target": {"name": target}})
    return d


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "drafter.safetensors").write_bytes(b"weightz"), "does not match the sha256"),
    (lambda d: (d / "drafter.safetensors").unlink(), "lacks drafter.safetensors"),
    (lambda d: (d / "extra.bin").write_bytes(b""), "does not list (extra.bin)"),
    (lambda d: (d / "manifest.json").unlink(), "is not in the zoo"),
    (lambda d: (d / "manifest.json").write_text("{"), "is not valid JSON"),
    (lambda d: (d / "manifest.json").write_text(json.dumps({"format": "pardec-zoo", "version": 99})), "version 99"),
])
def test_a_damaged_artifact_is_refused_in_one_line_naming_make_zoo(tmp_zoo, damage, message):
    d = _artifact(tmp_zoo)
    assert zoo.resolve("zoo:eagle3", "method.path", "tiny") == str(d)
    damage(d)
    with pytest.raises(zoo.ZooError) as e:
        zoo.resolve("zoo:eagle3", "method.path", "tiny")
    assert message in str(e.value) and "make zoo" in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("method.path: zoo:eagle3")


def test_an_artifact_of_another_target_or_a_bad_reference_is_refused(tmp_zoo):
    _artifact(tmp_zoo, target="smollm2_135m")
    with pytest.raises(zoo.ZooError, match="was trained for 'smollm2_135m'; this run's model is 'tiny_random'"):
        zoo.resolve("zoo:eagle3", "method.path", "tiny_random")
    with pytest.raises(zoo.ZooError, match="no zoo/nozoo|is not a zoo artifact"):
        zoo.resolve("zoo:nozoo/eagle3", "method.path", None)
    assert zoo.resolve("/a/dir", "method.path", None) == "/a/dir"  # not a reference: unchanged


def test_every_zoo_recipe_composes_and_names_known_methods():
    from hydra import compose, initialize_config_dir

    import pardec.decoding  # noqa: F401
    from pardec import CONF_DIR
    from pardec.decoding.base import METHODS
    from pardec.training.kinds import load_kinds
    from pardec.zoo.store import check_store

    for name in zoo.zoos():
        for e in zoo.entries(name).values():
            check_store(e.store, e.name)
            assert len(zoo.recipe_hash(e)) == 64 and zoo.recipe_hash(e) != zoo.recipe_hash(e, training_only=True)
            with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
                kind = compose("train", overrides=[f"+experiment={e.experiment}", *e.overrides]).kind
            assert tuple(e.stages) == tuple(load_kinds().get(kind).stages), e.name  # what the build runs
            cls = METHODS.get(e.reads["method"])
            if e.reads["key"] == "draft.path":
                assert cls.needs_draft, e.name
            elif e.reads["key"] == "model.path":  # a fine-tuned target: the method decodes with it alone
                assert not cls.needs_draft, e.name
            else:
                assert e.reads["key"] in cls.__init__.__code__.co_varnames, (e.name, e.reads)


def test_bench_method_specs_keep_a_zoo_reference_whole():
    from pardec.evaluation.spec import parse_also, split_method

    assert split_method("medusa:path=zoo:medusa:tree=T63") == ["medusa", "path=zoo:medusa", "tree=T63"]
    assert parse_also("eagle3:path=zoo:smollm2/eagle3:mode=chain") == ("eagle3", {"path": "zoo:smollm2/eagle3",
                                                                               "mode": "chain"})
    with pytest.raises(ConfigError):
        parse_also("sps:adaptive")


# ------------------------------------------------------------------------------------------- the kept artifacts
KEPT = [(z, n) for z in zoo.zoos() for n in zoo.entries(z) if (zoo.ZOO_DIR / z / n / zoo.MANIFEST).is_file()]
REQUIRED = ("name", "target", "recipe", "command", "commit", "host", "date", "stages", "data", "metrics", "store",
            "files", "reads")


def test_every_directory_of_the_zoo_is_a_recipe_with_a_manifest():
    for z in zoo.zoos():
        dirs = sorted(p.name for p in (zoo.ZOO_DIR / z).glob("*") if p.is_dir() and p.name != "corpora") \
            if (zoo.ZOO_DIR / z).is_dir() else []  # corpora/: kept corpora (tests/test_zoo_corpus.py)
        assert [d for d in dirs if (z, d) not in KEPT] == [], "an artifact without a recipe or a manifest"


@pytest.mark.parametrize("zoo_name, name", KEPT)
def test_every_kept_manifest_is_complete_and_every_file_matches_it(zoo_name, name):
    m = zoo.verify(name, zoo_name)
    assert [k for k in REQUIRED if not m.get(k)] == []
    assert m["command"].startswith("python -m train +experiment=" + m["recipe"]["experiment"])
    assert m["host"]["cpu"] and m["host"]["torch"] and all(s["wall_s"] > 0 for s in m["stages"].values())
    train = m["data"]["train"]
    assert train["records"] > 0 and len(train["sha256"]) == 64
    held = m["data"]["heldout"]
    assert {"gsm8k", "humaneval"} <= set(held) and set(held) & {"mt_bench", "spider", "cnn_dm"}
    assert all(h["records"] > 0 for h in held.values() if "dir" in h)  # a dataset read whole has no directory
    assert sum(f["bytes"] for f in m["files"].values()) < 100e6


#: GSM8K-style questions written for the test (a fresh clone holds no GSM8K file)
QUESTIONS = [
    {"question": "A baker makes 12 loaves an hour for 5 hours and sells 38 of them. How many loaves are left?",
     "answer": "He makes 12 * 5 = <<12*5=60>>60 loaves. 60 - 38 = <<60-38=22>>22 are left.\n#### 22"},
    {"question": "Tom has 3 boxes of 14 pencils and gives 9 pencils away. How many pencils does he have now?",
     "answer": "He has 3 * 14 = <<3*14=42>>42 pencils. 42 - 9 = <<42-9=33>>33.\n#### 33"},
]


def domain_dataset(manifest: dict, tmp_path: Path):
    """Prompts of the artifact's own domain: GSM8K-style questions where its corpus is GSM8K alone (CLLM trains one
    model per domain, and fast-forwards little outside it), else HumanEval (the corpora that hold code)."""
    from pardec.config import DatasetConfig

    sources = manifest["data"]["train"]["sources"]
    if all(s.get("dataset", {}).get("name") == "gsm8k" for s in sources):
        f = tmp_path / "gsm8k.jsonl"
        f.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
        return DatasetConfig(name="gsm8k", path=str(f), split="test")
    return DatasetConfig(name="humaneval")


@pytest.mark.heavy  # the real model
@pytest.mark.parametrize("zoo_name, name", KEPT)
def test_every_kept_drafter_loads_and_decodes_exactly(zoo_name, name, tmp_path):
    from pardec.config import ModelConfig
    from pardec.decoding import METHODS, Stopper, build_decoder
    from pardec.models.cached import CachedModel
    from pardec.models.loading import load_model, named_config
    from pardec.tasks.base import build_task

    m = zoo.verify(name, zoo_name)
    path = zoo.resolve(f"zoo:{zoo_name}/{name}", "test", m["target"]["name"])
    params, draft = {}, None
    if m["reads"]["key"] == "model.path":  # a fine-tuned target (SDSAT, CLLM): it decodes against its own ar
        lm = load_model(ModelConfig(name=name, source="local", path=path))
    else:
        lm = load_model(named_config(m["target"]["name"]))
    if m["reads"]["key"] == "draft.path":  # a draft model
        draft = CachedModel(load_model(ModelConfig(name="draft", source="local", path=path)).model)
    elif m["reads"]["key"] != "model.path":
        params[m["reads"]["key"]] = path
    if (Path(path) / "trees" / "T16.json").is_file():
        params["tree"] = "T16"
    tok, cm = lm.tokenizer, CachedModel(lm.model)
    task = build_task(domain_dataset(m, tmp_path))
    stop = Stopper(tok, [tok.eos_token_id], task.stop_strings(True))
    for doc in task.docs()[:2]:
        ids = task.prompt_ids(doc, tok, True, [])
        ref = build_decoder("ar", cm, tok).generate(ids, 24, stop)
        method = METHODS.current(m["reads"]["method"])  # (a manifest keeps the method's name at its build)
        res = build_decoder(method, cm, tok, draft, **params).generate(ids, 24, stop)
        assert res.tokens == ref.tokens, (name, doc["id"])
        assert res.target_forwards < ref.target_forwards  # it drafted something the target accepted


def test_from_target_store_drops_what_equals_the_target_and_refuses_what_does_not(tmp_path, monkeypatch):
    weights, emb = _target(tmp_path)
    final = tmp_path / "final"
    final.mkdir()
    save_file({"model.embed_tokens.weight": emb.clone(), "model.layers.0.w": torch.randn(8, 8)},
              str(final / "model.safetensors"))
    store = {"dtype": "bf16", "from_target": {"model.embed_tokens.weight": "model.embed_tokens.weight"}}
    art = tmp_path / "zoo" / "draft"
    info = pack(final, art, ["*.safetensors"], store, weights)
    assert list(load_file(str(art / "model.safetensors"))) == ["model.layers.0.w"]
    m = zoo.seal(art, {"name": "draft", "target": {"name": "tiny"}, "store": info})
    monkeypatch.setattr("pardec.zoo.store.DATA_DIR", tmp_path / "data")
    monkeypatch.setattr("pardec.models.loading.weights_location", lambda cfg: weights)
    monkeypatch.setattr("pardec.models.loading.named_config", lambda name: name)
    full = load_file(str(materialize(art, m) / "model.safetensors"))
    assert torch.equal(full["model.embed_tokens.weight"], emb) and full["model.layers.0.w"].dtype == torch.bfloat16
    save_file({"model.embed_tokens.weight": emb + 1}, str(final / "model.safetensors"))
    with pytest.raises(ValueError, match="differs from the target's model.embed_tokens.weight"):
        pack(final, tmp_path / "other", ["*.safetensors"], store, weights)


def test_an_evaluate_run_reads_a_zoo_drafter_by_name(tmp_zoo, tmp_path):
    from pardec.evaluation import validate
    from pardec.models.loading import load_model, named_config
    from pardec.testing.drafters import untrained_drafters
    from tests.evaluation.helpers import TINY, cfg_of

    lm = load_model(named_config("tiny_random"))
    _, params = untrained_drafters(lm.model, tmp_path / "work")
    import shutil

    shutil.copytree(params["medusa"]["path"], tmp_zoo / "medusa")
    zoo.seal(tmp_zoo / "medusa", {"name": "medusa", "target": {"name": "tiny_random"}})
    spec = validate(cfg_of("+method=medusa", "method.path=zoo:medusa", "method.tree=chain",
                           'bench.also=["medusa:path=zoo:smollm2/medusa:k=2"]', *TINY))
    assert spec.method_params["path"] == str(tmp_zoo / "medusa")
    assert spec.also[0][2] == {"path": str(tmp_zoo / "medusa"), "k": 2}
    (tmp_zoo / "medusa" / "drafter.json").write_text("{}")
    with pytest.raises(ConfigError, match=r"^method.path: zoo:medusa's drafter.json does not match the sha256"):
        validate(cfg_of("+method=medusa", "method.path=zoo:medusa", *TINY))


def test_the_data_section_reads_a_run_whose_paths_name_the_experiment(tmp_path):
    """A recipe whose corpus directories use ${experiment_name} (draft_smollm2's eval.out_dir): outside the Hydra app
    the manifest's data section takes the experiment from the run's .hydra/hydra.yaml."""
    from pardec.zoo.build import data_section

    hydra = tmp_path / "run" / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "config.yaml").write_text(
        "experiment_name: ${hydra:runtime.choices.experiment}\n"
        f"eval:\n  out_dir: {tmp_path}/data/${{experiment_name}}/eval\n"
        "  sources:\n  - dataset: {name: gsm8k, split: test}\n    max_prompts: 2\n")
    (hydra / "hydra.yaml").write_text("hydra:\n  runtime:\n    choices:\n      experiment: draft_smollm2\n")
    held = tmp_path / "data" / "draft_smollm2" / "eval" / "gsm8k"
    held.mkdir(parents=True)
    (held / "completions.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    out = data_section(tmp_path / "run")
    assert out["heldout"]["gsm8k"]["records"] == 2 and out["heldout"]["gsm8k"]["sha256"]


def _run_dir(tmp_path, config: str, experiment: str, corpora: dict):
    """A finished run's ``.hydra`` (its composed ``config`` and the experiment Hydra chose) and its corpora
    (directory -> (file name, records)), as :func:`pardec.zoo.build.data_section` reads them."""
    hydra = tmp_path / "run" / ".hydra"
    hydra.mkdir(parents=True)
    (hydra / "config.yaml").write_text(config)
    (hydra / "hydra.yaml").write_text(f"hydra:\n  runtime:\n    choices:\n      experiment: {experiment}\n")
    for d, (name, n) in corpora.items():
        d.mkdir(parents=True)
        (d / name).write_text('{"a": 1}\n' * n)
    return tmp_path / "run"


def test_the_data_section_of_a_masked_corpus_and_completions_read_as_they_are(tmp_path):
    """SDSAT: the training corpus is the mask stage's masked.jsonl; held out are completions directories (by their
    names) and human text read from a dataset."""
    from pardec.zoo.build import data_section

    masked, held = tmp_path / "sdsat", tmp_path / "eval" / "mt_bench"
    run = _run_dir(tmp_path,
                   f"mask:\n  out_dir: {masked}\n  sources:\n  - completions: {tmp_path}/train\n"
                   f"eval:\n  sources:\n  - completions: {held}\n  - dataset: {{name: gsm8k, split: test}}\n"
                   "    max_docs: 4\n", "sdsat_smollm2", {masked: ("masked.jsonl", 3), held: ("completions.jsonl", 2)})
    out = data_section(run)
    assert out["train"]["records"] == 3 and out["train"]["sources"] == [{"completions": f"{tmp_path}/train"}]
    assert out["heldout"]["mt_bench"]["records"] == 2 and len(out["heldout"]["mt_bench"]["sha256"]) == 64
    assert out["heldout"]["gsm8k_reference"] == {"sources": [{"dataset": {"name": "gsm8k", "split": "test"},
                                                              "max_docs": 4}]}


def test_the_data_section_of_cllm_names_its_trajectories_and_the_prompts_it_decodes_held_out(tmp_path):
    """CLLM: trained on the target's whole answers and on Jacobi trajectories of the same prompts; held out are
    dataset prompts its eval Jacobi-decodes itself (named by the dataset, not as reference text)."""
    from pardec.zoo.build import data_section

    answers, traj = tmp_path / "completions", tmp_path / "trajectories"
    run = _run_dir(tmp_path,
                   f"dataset: {{name: gsm8k, split: train}}\ncollect:\n  out_dir: {traj}\n  max_prompts: 3\n"
                   f"completions:\n  out_dir: {answers}\n  sources:\n  - dataset: {{name: gsm8k, split: train}}\n"
                   "eval:\n  sources:\n  - dataset: {name: gsm8k, split: test}\n    max_prompts: 4\n",
                   "cllm_x", {answers: ("completions.jsonl", 3), traj: ("trajectories.jsonl", 5)})
    out = data_section(run)
    assert out["train"]["records"] == 3 and out["trajectories"]["records"] == 5
    assert out["trajectories"]["sources"] == [{"dataset": {"name": "gsm8k", "split": "train"}, "max_prompts": 3}]
    assert out["heldout"] == {"gsm8k": {"sources": [{"dataset": {"name": "gsm8k", "split": "test"},
                                                    "max_prompts": 4}]}}


def test_the_headline_and_stored_form_of_a_fine_tuned_target():
    from pardec.zoo.__main__ import headline, stored_form

    sdsat = {"overall": {"ppl_ratio": 0.9512, "adaptive": {"expected_tokens_per_loop_vs_model": 1.734}},
             "per_source": {}}
    assert headline(sdsat) == "E[tokens/loop] 1.73, ppl x0.951"
    assert headline({"adaptive": {"expected_tokens_per_loop_vs_model": 2.0}, "ppl_ratio": None}) == "E[tokens/loop] 2.00"
    # CLLM: the summary's fast-forward (the base model's beside it where measured); per held-out set, the trained's
    assert headline({"fast_forward": 1.8234, "tokens_per_forward": 1.7}) == "fast-forward 1.82"
    assert headline({"fast_forward": 1.8234, "base_fast_forward": 1.049}) == "fast-forward 1.82 (base 1.05)"
    assert headline({"trained": {"fast_forward": 1.9}, "base": {"fast_forward": 1.01}}) == "fast-forward 1.90 (base 1.01)"
    assert headline({"trained": {"fast_forward": 1.9}}) == "fast-forward 1.90"
    store = {"dtype": "bf16", "target_delta": {"tensors": ".*", "rank": 16}, "unchanged": ["a", "b"],
             "tensors": {"q": {"form": "lowrank"}, "k": {"form": "lowrank"}, "emb": {"form": "rows"}}}
    assert stored_form(store) == ("bf16, the target + rank-16 deltas of 2 linears, 1 tensor(s) by changed rows, "
                                  "0 whole, 2 unchanged (not stored)")


class _StubEntry:
    name, stages, keep_corpus = "stub", ("train", "eval"), False

    def __init__(self, run_dir):
        self.run_dir = run_dir

    def command(self, stage):
        return [f"stage={stage}"]


def test_a_killed_stage_keeps_its_time_and_the_resumed_one_adds_it(tmp_path, monkeypatch):
    """A build killed mid-stage keeps what the stage had run (its heartbeat in zoo_stages.json); the rerun's stage
    time is the sum of both processes, each listed."""
    from pardec.zoo import build

    entry = _StubEntry(tmp_path / "run")

    def killed(entry, stage, argv, log, beat=None):
        beat(12.5)
        raise KeyboardInterrupt  # the build dies mid-stage

    monkeypatch.setattr(build, "run_stage", killed)
    with pytest.raises(KeyboardInterrupt):
        build.run_stages(entry, "r1", lambda msg: None)
    saved = json.loads((entry.run_dir / build.STAGES_FILE).read_text())
    assert saved["stages"] == {} and [(r["stage"], r["wall_s"]) for r in saved["killed"]] == [("train", 12.5)]

    def finished(entry, stage, argv, log, beat=None):
        beat(1.0)
        return {"wall_s": 7.0, "started": "later"}

    monkeypatch.setattr(build, "run_stage", finished)
    stages = build.run_stages(entry, "r1", lambda msg: None)
    assert stages["train"]["wall_s"] == 19.5 and [p["wall_s"] for p in stages["train"]["processes"]] == [12.5, 7.0]
    assert stages["eval"]["wall_s"] == 7.0 and "processes" not in stages["eval"]
    assert json.loads((entry.run_dir / build.STAGES_FILE).read_text())["killed"] == []


def test_a_run_dir_of_another_recipe_is_cleared_before_its_checkpoints_could_be_resumed(tmp_path, monkeypatch):
    """A recipe changed since its run dir was written (a stale artifact): the old checkpoints go, so training starts
    afresh instead of resuming the old recipe's; under the same recipe they stay and training resumes."""
    from pardec.zoo import build

    entry = _StubEntry(tmp_path / "run")
    seen = []
    monkeypatch.setattr(build, "run_stage", lambda entry, stage, argv, log, beat=None: seen.append(argv) or
                        {"wall_s": 1.0, "started": "now"})
    (entry.run_dir / "checkpoint-300").mkdir(parents=True)
    (entry.run_dir / "checkpoint-300" / "trainer_state.json").write_text("{}")
    (entry.run_dir / build.STAGES_FILE).write_text(json.dumps({"recipe_sha256": "old", "stages": {}}))
    build.run_stages(entry, "new", lambda msg: None)
    assert seen[0] == ["stage=train"] and not (entry.run_dir / "checkpoint-300").exists()
    (entry.run_dir / "checkpoint-20").mkdir()
    (entry.run_dir / "checkpoint-20" / "trainer_state.json").write_text("{}")
    saved = json.loads((entry.run_dir / build.STAGES_FILE).read_text())
    (entry.run_dir / build.STAGES_FILE).write_text(json.dumps({**saved, "stages": {}}))  # killed during training
    seen.clear()
    build.run_stages(entry, "new", lambda msg: None)
    assert seen[0] == ["stage=train", "trainer.resume_from_checkpoint=true"]


def test_run_stage_beats_while_its_process_runs(tmp_path, monkeypatch):
    import subprocess
    import sys

    from pardec.zoo import build

    monkeypatch.setattr(build, "HEARTBEAT_S", 0.05)
    real = subprocess.Popen
    monkeypatch.setattr(build.subprocess, "Popen", lambda cmd, **kw: real(
        [sys.executable, "-c", "import time; time.sleep(0.4)"], **kw))
    beats = []
    out = build.run_stage(_StubEntry(tmp_path), "train", ["stage=train"], lambda msg: None, beats.append)
    assert len(beats) >= 2 and beats == sorted(beats) and out["wall_s"] >= 0.4
    monkeypatch.setattr(build.subprocess, "Popen", lambda cmd, **kw: real([sys.executable, "-c", "raise SystemExit(3)"],
                                                                          **kw))
    with pytest.raises(build.ZooError, match="stage train exited with status 3; rerun"):
        build.run_stage(_StubEntry(tmp_path), "train", ["stage=train"], lambda msg: None)


# ------------------------------------------------------------------------------- a drafter trained over several runs
def test_an_entry_continues_its_base_run_and_goes_stale_when_the_base_recipe_changes(monkeypatch):
    """``base:``: the continuing recipe's training starts from the base's run (``drafter.init_from``; its other stages
    and the base's own commands do not), and a change of the base's recipe changes the continuing one's hash."""
    from pardec.zoo.build import status

    known = zoo.entries()
    e = known["dflash"]  # three runs: blocks of 4, blocks of 8, the grown corpus
    assert e.base == "dflash_b8" and known["dflash_b8"].base == "dflash_b4"
    assert not known["dflash_b4"].kept and status(known["dflash_b4"]) == "not kept" and not known["dflash_b8"].kept
    init = f"+drafter.init_from={e.run_root}/dflash_b8/final"
    assert init in e.command("train") and init in e.command() and init not in e.command("eval")
    assert f"+drafter.init_from={e.run_root}/dflash_b4/final" in known["dflash_b8"].command("train")
    assert not any(a.startswith("+drafter.init_from") for a in known["dflash_b4"].command("train"))
    assert [b.name for b in zoo.base_chain(e)] == ["dflash_b4", "dflash_b8"] and zoo.base_chain(known["dflash_b4"]) == []
    before = zoo.recipe_hash(e, training_only=True)  # the first run's recipe changes the last one's, through the second
    changed = dict(known, dflash_b4=zoo.Entry(**{**vars(known["dflash_b4"]),
                                                "overrides": [*known["dflash_b4"].overrides, "trainer.max_steps=10"]}))
    monkeypatch.setattr(zoo, "entries", lambda z=zoo.DEFAULT_TARGET: changed)
    assert zoo.recipe_hash(e, training_only=True) != before


@pytest.mark.parametrize("base, message", [("nope", "base='nope'"), ("self", "base='self'"),
                                           ("other_kind", "same experiment")])
def test_a_base_that_is_no_other_entry_of_the_same_experiment_is_refused(tmp_path, monkeypatch, base, message):
    (tmp_path / "zoo").mkdir()
    (tmp_path / "zoo" / "t.yaml").write_text(json.dumps({"target": "smollm2_135m", "artifacts": {
        "self": {"experiment": "a", "base": base}, "first": {"experiment": "a"},
        "other_kind": {"experiment": "b"}}}))
    monkeypatch.setattr(zoo, "CONF_DIR", tmp_path)
    with pytest.raises(zoo.ZooError, match=message):
        zoo.entries("t")


def test_the_build_trains_the_base_first_keeps_only_the_continuing_artifact_and_records_both(tmp_path, monkeypatch):
    from pardec.zoo import build

    base = zoo.Entry(name="b", target="t", experiment="x", run_root="r", kept=False)
    top = zoo.Entry(name="top", target="t", experiment="x", run_root="r", base="b")
    monkeypatch.setattr(zoo, "entries", lambda z=zoo.DEFAULT_TARGET: {"b": base, "top": top})
    monkeypatch.setattr(build, "recipe_hash", lambda e, training_only=False: f"{e.name}-{training_only}")
    ran, stored = [], []
    monkeypatch.setattr(build, "run_stages", lambda e, recipe, log: ran.append((e.name, recipe)) or
                        {"train": {"wall_s": 2.0 if e.name == "b" else 1.0}})
    monkeypatch.setattr(build, "data_section", lambda run_dir: {"train": {"records": 3}})
    monkeypatch.setattr(build, "eval_metrics", lambda run_dir: {"expected_tokens_per_forward": 1.5})
    monkeypatch.setattr(build, "check_store", lambda store, where: None)
    monkeypatch.setattr(build, "status", lambda e, recipe=None: "missing")
    monkeypatch.setattr("pardec.models.loading.named_config", lambda name: None)
    monkeypatch.setattr(build, "_store", lambda e, recipe, stages, final, cfg, tmp, log, bases=None:
                        stored.append((e.name, stages, bases)) or {})
    assert build.build_one(base, log=lambda m: None) is None and ran == [("b", "b-True")] and stored == []
    ran.clear()
    build.build_one(top, log=lambda m: None)
    assert ran == [("b", "b-True"), ("top", "top-True")]
    [(name, stages, bases)] = stored
    assert name == "top" and stages == {"train": {"wall_s": 1.0}}
    assert [b["name"] for b in bases] == ["b"] and bases[0]["stages"]["train"]["wall_s"] == 2.0
    assert bases[0]["metrics"] == {"expected_tokens_per_forward": 1.5} and "+drafter.init_from" not in bases[0]["command"]


def test_a_base_kept_in_the_zoo_is_continued_from_its_stored_form_not_trained_again(tmp_path, monkeypatch):
    """A kept artifact built from exactly a base's recipe (whatever its name: the entry that was kept before a
    continuation took its name) becomes that base's run: its stored form is the run's ``final/``, the runs before
    it are not trained, and the manifest's ``bases`` are the artifact's own plus its record, marked where it came
    from; a resumed build reuses the seed, and a base whose recipe changed since is trained."""
    from pardec.zoo import build

    run_root = str(tmp_path / "runs")
    first = zoo.Entry(name="a", target="t", experiment="x", run_root=run_root, kept=False)
    mid = zoo.Entry(name="b", target="t", experiment="x", run_root=run_root, base="a", kept=False)
    top = zoo.Entry(name="top", target="t", experiment="x", run_root=run_root, base="b")
    hashes = {"a": "ha", "b": "hb", "top": "ht"}
    monkeypatch.setattr(zoo, "entries", lambda z=zoo.DEFAULT_TARGET: {"a": first, "b": mid, "top": top})
    monkeypatch.setattr(build, "recipe_hash", lambda e, training_only=False: hashes[e.name] + ("-t" * training_only))
    kept = tmp_path / "zoo" / top.zoo / "top"
    kept.mkdir(parents=True)
    (kept / "drafter.json").write_text("{}")
    manifest = {"name": "top", "recipe": {"sha256": "hb"}, "stages": {"train": {"wall_s": 7.0}}, "date": "d0",
                "commit": "c0", "host": {"cpu": "cpu0"}, "store": {"dtype": "bf16"}, "metrics": {"e": 2.0},
                "bases": [{"name": "a", "stages": {"train": {"wall_s": 9.0}}}]}
    (kept / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(build, "ZOO_DIR", tmp_path / "zoo")
    monkeypatch.setattr(build, "verify", lambda name, z: json.loads((tmp_path / "zoo" / z / name / "manifest.json")
                                                                     .read_text()))
    monkeypatch.setattr(build, "materialize", lambda artifact, m: artifact)
    ran, stored = [], []
    monkeypatch.setattr(build, "run_stages", lambda e, recipe, log: ran.append(e.name) or {"train": {"wall_s": 1.0}})
    monkeypatch.setattr(build, "data_section", lambda run_dir: {})
    monkeypatch.setattr(build, "eval_metrics", lambda run_dir: {})
    monkeypatch.setattr(build, "check_store", lambda store, where: None)
    monkeypatch.setattr(build, "status", lambda e, recipe=None: "stale")
    monkeypatch.setattr("pardec.models.loading.named_config", lambda name: None)
    monkeypatch.setattr(build, "_store", lambda e, recipe, stages, final, cfg, tmp, log, bases=None:
                        stored.append(bases) or {})
    build.build_one(top, log=lambda m: None)
    assert ran == ["top"]  # neither a nor b trained again
    [bases] = stored
    assert [b["name"] for b in bases] == ["a", "b"] and bases[0]["stages"]["train"]["wall_s"] == 9.0
    assert bases[1]["stages"] == {"train": {"wall_s": 7.0}} and bases[1]["metrics"] == {"e": 2.0}
    assert bases[1]["seeded_from"]["artifact"] == f"zoo/{top.zoo}/top" and bases[1]["seeded_from"]["commit"] == "c0"
    assert (mid.run_dir / "final" / "drafter.json").is_file() and not (mid.run_dir / "final" / "manifest.json").exists()
    done = json.loads((mid.run_dir / build.STAGES_FILE).read_text())
    assert done["recipe_sha256"] == "hb-t" and set(done["stages"]) == set(mid.stages)
    # resumed (or the artifact since replaced by the continuation): the seed is reused, not copied again
    (kept / "manifest.json").write_text(json.dumps({**manifest, "recipe": {"sha256": "ht"}}))
    ran.clear(), stored.clear()
    build.build_one(top, log=lambda m: None)
    assert ran == ["top"] and [b["name"] for b in stored[0]] == ["a", "b"]
    hashes["b"] = "hb2"  # the base's recipe changed: its seeded run no longer counts, and nothing kept matches it
    ran.clear(), stored.clear()
    build.build_one(top, log=lambda m: None)
    assert ran == ["a", "b", "top"]

def _as_built_before_the_rename(e) -> dict:
    """``e``'s composed recipe as the configs of the previous release spelled it (kind ``heads``, a ``heads:``
    section): what ``python -m pardec.zoo rehash --at <commit>`` reads at a commit before the rename."""
    from pardec.zoo import recipe_config

    cfg = recipe_config(e)
    cfg["heads"], cfg["kind"] = cfg.pop("drafter"), "heads"
    return {"hash": "h0", "config": {**cfg, "stage": "all", "measure_memory": False}, "keep": e.keep,
            "store": e.store}


def test_rehash_carries_a_pure_rename_over_and_refuses_anything_more():
    from pardec.zoo import entries
    from pardec.zoo.rehash import check

    e = entries()["eagle3"]
    at = {"eagle3": _as_built_before_the_rename(e)}
    assert check(e, at, {"recipe": {"sha256": "h0"}}) == ["heads: -> drafter:", "kind heads -> drafter"]
    with pytest.raises(zoo.ZooError, match="not the one it was built from"):  # that commit's recipe is not the build's
        check(e, at, {"recipe": {"sha256": "h1"}})
    at["eagle3"]["config"]["trainer"] = {**at["eagle3"]["config"]["trainer"], "max_steps": 7}
    with pytest.raises(zoo.ZooError, match=r"the recipe changed, not only its spelling: trainer\.max_steps: 7 -> "):
        check(e, at, {"recipe": {"sha256": "h0"}})


def test_a_run_that_continues_another_is_carried_over_only_with_its_base():
    from pardec.zoo import entries
    from pardec.zoo.rehash import check

    recipes = entries()
    e, base = recipes["dflash_b8"], recipes[recipes["dflash_b8"].base]  # (the run the rename found kept as dflash)
    at = {e.name: _as_built_before_the_rename(e), base.name: _as_built_before_the_rename(base)}
    assert check(e, at, {"recipe": {"sha256": "h0"}}) == ["heads: -> drafter:", "kind heads -> drafter"]
    at[base.name]["config"]["heads"] = {**at[base.name]["config"]["heads"], "block_size": 16}
    with pytest.raises(zoo.ZooError, match=rf"its base {base.name}: the recipe changed.*drafter\.block_size: 16 -> 4"):
        check(e, at, {"recipe": {"sha256": "h0"}})


def test_what_a_run_only_records_is_not_its_recipe():
    from dataclasses import replace

    from pardec.zoo import entries, recipe_hash

    e = entries()["draft"]
    assert recipe_hash(replace(e, overrides=[*e.overrides, "measure_memory=true"])) == recipe_hash(e)
    assert recipe_hash(replace(e, overrides=[*e.overrides, "trainer.max_steps=3"])) != recipe_hash(e)
