"""The paper recipes a rehearsal finds, their composed configs, and what a rehearsal swaps in them."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf

from pardec import CONF_DIR
from pardec.config import ModelConfig, composed
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
    "model": (r"model(\..*)?", r"drafter\.mask_token_id"),  # (a row of the real target's embedding)
    "draft": (r"draft(\..*)?",),  # evaluation only (in training, ``draft`` is the draft kind's shape: kept)
    "device": (r"device", r"threads"),  # (training's switch; an evaluation keeps its devices: virtual GPUs)
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
    import pardec.evaluate  # noqa: F401  (its resolvers; heavy: torch, transformers)
    import pardec.train  # noqa: F401  (heavy: torch, transformers)

    return OmegaConf.to_container(composed(app, overrides), resolve=True)


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


def model_yaml(group: str, name: str) -> dict:
    path = CONF_DIR / group / f"{name}.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def real_layers(group: str, name: str) -> int:
    """The number of layers of a model config's real model (``conf/model_configs/<hub id with __>/config.json``);
    2 where that file is not in the repository."""
    hub = hub_id(name, group)
    cfg = shipped_config(hub) if hub else None
    return int(json.loads(cfg.read_text())["num_hidden_layers"]) if cfg and cfg.is_file() else 2
