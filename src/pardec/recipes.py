"""The recipe files, read without composing them: training experiments (``conf/experiment/<name>.yaml``, run by
``python -m train +experiment=<name>``) and evaluation recipes (``conf/recipe/<name>.yaml``, ``python -m evaluate
+recipe=<name>``). What the researcher tools that plan and rehearse them (:mod:`pardec.plan`,
:mod:`pardec.rehearse`) need to know of a recipe before composing it: its app, the config options its defaults
list picks, and the training run an evaluation recipe reads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from pardec import CONF_DIR

#: the shipped config.json of each hub model the paper recipes name: ``<dir>/<hub id with / as __>/config.json``
MODEL_CONFIGS = CONF_DIR / "model_configs"
#: a path inside a training experiment's run dir, ``.../train/runs/<experiment>/<run name>/...``
TRAINED_PATH = re.compile(r"train/runs/([\w.-]+)/")


def recipes() -> dict[str, str]:
    """Every recipe name -> ``train`` (conf/experiment/) or ``evaluate`` (conf/recipe/)."""
    stems = {group: sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")) for group in ("experiment", "recipe")}
    return {**{n: "train" for n in stems["experiment"]}, **{n: "evaluate" for n in stems["recipe"]}}


def recipe_file(name: str) -> Path:
    return CONF_DIR / ("experiment" if recipes()[name] == "train" else "recipe") / f"{name}.yaml"


def defaults(name: str) -> dict[str, str]:
    """``{group: option}`` of a recipe's defaults list (``- override /model: x``, ``- /kind: y``)."""
    out = {}
    for item in (yaml.safe_load(recipe_file(name).read_text()) or {}).get("defaults", []):
        if isinstance(item, dict):
            for k, v in item.items():
                out[k.replace("override ", "").strip().lstrip("/")] = v
    return out


def option(name: str, group: str) -> str:
    """The option of config group ``group`` (``model``, ``draft``, ...) a recipe runs with: its own override, else
    its app's default (``conf/train.yaml`` / ``conf/evaluate.yaml``)."""
    own = defaults(name).get(group)
    if own is not None:
        return own
    top = yaml.safe_load((CONF_DIR / f"{recipes()[name]}.yaml").read_text()) or {}
    picked = [v for item in top.get("defaults", []) if isinstance(item, dict) for k, v in item.items() if k == group]
    return str(picked[0]) if picked and picked[0] is not None else "none"


def stray_method_keys(name: str, keys: list[str]) -> str:
    """Where ``keys``, the parameters a run's method refused, were set by evaluation recipe ``name``'s own
    ``method:`` section for its method (a method group swapped on the command line keeps the recipe's body): a note
    naming them and how to drop them (empty when the recipe set none of them)."""
    body = (yaml.safe_load(recipe_file(name).read_text()) or {}).get("method") or {}
    stray = [k for k in keys if k in body]
    if not stray:
        return ""
    owner = option(name, "method")
    return (f" (recipe {name} sets {', '.join(f'method.{k}' for k in stray)} for method {owner}; drop them with "
            f"{' '.join(f'~method.{k}' for k in stray)}, or keep method={owner})")


def trained_experiment(name: str) -> str | None:
    """The training experiment whose run an evaluation recipe reads (a value under
    ``.../train/runs/<experiment>/``: ``model.path``, a method's trained artifact), or None."""
    body = {k: v for k, v in (yaml.safe_load(recipe_file(name).read_text()) or {}).items() if k != "defaults"}
    m = TRAINED_PATH.search(json.dumps(body))
    return m.group(1) if m and recipes().get(m.group(1)) == "train" else None


def hub_id(option: str, group: str = "model") -> str | None:
    """The hub id of config option ``group/option`` (``model/llama2_7b_chat`` -> ``meta-llama/Llama-2-7b-chat-hf``);
    None for a config that is no hub model (tiny_random, local, GGUF) or does not exist."""
    path = CONF_DIR / group / f"{option}.yaml"
    if not path.is_file():
        return None
    cfg = yaml.safe_load(path.read_text()) or {}
    return cfg.get("path") if cfg.get("source") == "hub" and cfg.get("path") else None


def shipped_config(hub: str) -> Path:
    """Where the config.json of hub model ``hub`` is shipped (:data:`MODEL_CONFIGS`; it may not be)."""
    return MODEL_CONFIGS / hub.replace("/", "__") / "config.json"
