"""A rehearsal's plan: the overrides that make a paper recipe run on the CPU with tiny models."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pardec.plan.shapes import DTYPE_BYTES
from pardec.rehearse.data import LOCAL_ALREADY
from pardec.rehearse.discovery import (
    EVAL_NEW_TOKENS,
    MAX_NEW_TOKENS,
    MAX_STEPS,
    N_EVAL,
    N_TRAIN,
    TINY_VOCAB,
    Recipe,
    compose,
    model_yaml,
    real_layers,
)
from pardec.training.kinds import load_kinds

# ------------------------------------------------------------------------------------------- plans
#: a split target's virtual devices each say they have this share of its loaded weights free: it fits on two, not on
#: one, so ``device_map=auto`` splits it as it splits a 34B target over two 80 GB GPUs
SPLIT_FREE = 0.9
#: a split target's tiny stand-in: deeper and wider than tiny_random's 2 x 64, so its layers, not its embeddings,
#: make up most of it and accelerate splits it between layers as it splits a real target
SPLIT_LAYERS, SPLIT_HIDDEN = 8, 128


@dataclass
class Plan:
    recipe: Recipe
    work: Path  # the rehearsal's work dir: data/, out/, models/, launch.log
    overrides: dict[str, list[str]]  # what is swapped, by class: model, device, data, size
    location: list[str]  # where it writes (paths.*, hydra.run.dir): not a config change
    data_files: dict[str, str] = field(default_factory=dict)  # dataset -> tiny file written by prepare()
    # dir -> the tiny model prepare() saves there (``layers``, ``hidden``)
    saved_models: dict[str, dict[str, int]] = field(default_factory=dict)
    expect: dict[str, Any] = field(default_factory=dict)
    #: an evaluation runs as on GPUs (:mod:`pardec.testing.virtual_gpus`): each rank's virtual CUDA devices (2 for
    #: a target split with ``model.device_map``); 0: on the CPU (training)
    gpus_per_rank: int = 0
    #: a split target: the saved tiny model (``split_model``) loads in ``split_bytes`` bytes per weight; each virtual
    #: device then says it has free :data:`SPLIT_FREE` of the loaded target's size (``prepare`` measures it)
    split_model: str | None = None
    split_bytes: int = 4

    @property
    def name(self) -> str:
        return self.recipe.name

    def all_overrides(self) -> list[str]:
        return [o for group in self.overrides.values() for o in group]

    def command_args(self) -> list[str]:
        head = [f"+{self.recipe.group}={self.name}"] + (["stage=all"] if self.recipe.app == "train" else [])
        return head + self.all_overrides() + self.location


def _model_swap(key: str, group: str, name: str, work: Path, saved: dict[str, dict[str, int]], layers: int | None,
                vocab: int | None = TINY_VOCAB) -> list[str]:
    """Overrides swapping config group ``group`` (model | draft), now ``name``, for a tiny random Llama (``layers``
    layers; None: tiny_random's own 2; ``vocab`` ids, None: SmolLM2's whole vocabulary); a split one
    (``device_map``) is saved to disk (:data:`SPLIT_LAYERS` x :data:`SPLIT_HIDDEN` unless the recipe names layers)
    and loaded as ``local``, its map kept."""
    device_map = model_yaml(group, name).get("device_map")
    if device_map:
        layers = layers or SPLIT_LAYERS
        path = work / "models" / f"{key}_tiny_{layers}l"
        saved[str(path)] = {"layers": layers, "hidden": SPLIT_HIDDEN}
        return [f"{key}=local", f"{key}.path={path}", f"+{key}.device_map={device_map}"]
    # (the vocabulary stated: a draft's follows its target's model.vocab, which a target saved to disk has not)
    return [f"{key}=tiny_random", f"{key}.vocab={'null' if vocab is None else vocab}"] + (
        [f"{key}.layers={layers}"] if layers else [])


def named_layers(cfg: dict) -> list[int]:
    """Layer indices of the target a training recipe names (the draft kind's kept layers, FIRP's layers)."""
    for section in ("draft", "drafter"):
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
    saved: dict[str, dict[str, int]] = {}
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
                      (base.get("drafter") or {}).get("draft_vocab_size") or 0)
        model = _model_swap("model", "model", recipe.model, work, saved, layers,
                            TINY_VOCAB if drafted <= TINY_VOCAB else None)
    data: list[str] = []
    size: list[str] = []
    expect: dict[str, Any] = {}
    if recipe.app == "evaluate":
        if recipe.draft:
            model += _model_swap("draft", "draft", recipe.draft, work, saved, None)
        device = ["threads=1"]  # (model.device as the recipe says: the launch runs on virtual CUDA devices)
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
        elif kind in ("draft", "drafter"):
            if (base.get("drafter") or {}).get("mask_token_id") is not None:  # a row of the real vocabulary: row 0
                model.append("drafter.mask_token_id=0")                     # of the tiny one stands in
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
    gpus, split, split_bytes = 0, None, 4
    if recipe.app == "evaluate":
        gpus = 2 if base["model"].get("device_map") else 1
        split = next((path for path in saved if "/model_tiny_" in path), None) if gpus == 2 else None
        dtype = base["model"].get("dtype")
        split_bytes = DTYPE_BYTES.get(dtype, 2)  # (auto: bf16 on CUDA)
    return Plan(recipe, work, {"model": model, "device": device, "data": data, "size": size}, location,
                files, saved, expect, gpus, split, split_bytes)


def deepspeed_stage(p: Plan) -> str:
    if p.recipe.app == "evaluate":
        return "-"
    return {"zero2": "ZeRO-2", "zero3": "ZeRO-3", None: "none"}.get(p.expect.get("deepspeed"), str(p.expect.get("deepspeed")))


def stages_of(p: Plan) -> list[str]:
    if p.recipe.app == "evaluate":
        return ["evaluate"]

    return list(load_kinds().get(p.expect["kind"]).stages)
