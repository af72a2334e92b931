"""The paper recipes the plan covers, composed as on a CUDA machine."""

from __future__ import annotations

import contextlib
import fnmatch
import re
from collections.abc import Iterator, Sequence
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.plan.shapes import DEFAULT_WORLD
from pardec.recipes import (
    TRAINED_PATH,
    hub_id,
    option,
    recipes,
    shipped_config,
    trained_experiment,
)
from pardec.registry import Registry, UnknownNameError


# ------------------------------------------------------------------------------------------- recipes
def _trained_hub(path: str | None) -> str | None:
    """The hub id of the model a training experiment (named in ``path``, :data:`~pardec.recipes.TRAINED_PATH`)
    starts from: a model it trains keeps that architecture (CLLM, SDSAT), so the plan reads that model's
    config.json."""
    m = TRAINED_PATH.search(path or "")
    return hub_id(option(m.group(1), "model")) if m and recipes().get(m.group(1)) == "train" else None


def _recipe_hub(name: str) -> str | None:
    """The hub id of a recipe's model, without composing: its model config's, or the architecture of the run dir it
    reads (an evaluation recipe of a trained model)."""
    hub = hub_id(option(name, "model"))
    if hub is None and recipes()[name] == "evaluate" and (exp := trained_experiment(name)):
        hub = hub_id(option(exp, "model"))
    return hub


def paper_recipes() -> list[str]:
    """The recipes whose model has a shipped config.json: every evaluation recipe and the GPU-scale experiments
    (the CPU-sized ones train tiny_random / SmolLM2 and are not planned)."""
    return [n for n in recipes() if (h := _recipe_hub(n)) and shipped_config(h).is_file()]


def matching(patterns: Sequence[str]) -> list[str]:
    """Training recipes whose name matches any of the glob ``patterns`` (e.g. ``*7b*``)."""
    return [n for n, app in recipes().items() if app == "train" and any(fnmatch.fnmatch(n, p) for p in patterns)]


def check_name(name: str) -> str:
    reg: Registry[str] = Registry("recipe")
    for n, app in recipes().items():
        reg.add(n, app)
    try:
        return reg.canonical(name)
    except UnknownNameError as e:
        raise ConfigError(str(e)) from None


def launch_world(name: str) -> int:
    """The ``--nproc_per_node N`` of a training recipe's documented launch line, else DEFAULT_WORLD."""
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    m = re.search(r"--nproc_per_node[ =](\d+)", text)
    return int(m.group(1)) if m else DEFAULT_WORLD


@contextlib.contextmanager
def _as_on_cuda() -> Iterator[None]:
    """Resolve the GPU defaults (``dtype`` bf16, ``trainer.bf16`` true) whatever this machine has."""
    import torch  # heavy: torch

    saved = torch.cuda.is_available
    torch.cuda.is_available = lambda: True  # what pardec.on_cuda() asks; only while the values resolve
    try:
        yield
    finally:
        torch.cuda.is_available = saved


def compose(name: str, overrides: Sequence[str] = ()) -> tuple[str, dict[str, Any]]:
    """(``train`` | ``evaluate``, the recipe's composed config as a plain dict, GPU defaults; no hydra keys)."""
    name = check_name(name)
    app = recipes()[name]
    key = "experiment" if app == "train" else "recipe"
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        try:
            cfg = hydra_compose(app, overrides=[f"+{key}={name}", *overrides])
        except HydraException as e:  # a bad --set: one line
            raise ConfigError(f"recipe {name!r} with {list(overrides)}: {' '.join(str(e).split())}") from None
    keep = ("model", "draft", "dataset", "dtype", "max_new_tokens", "method", "trainer", "kind", "drafter", "collect",
            "perplexity", "completions", "eval", "ar_answer")  # (the last three: the data stages' plans)
    with _as_on_cuda():
        return app, {k: _plain(cfg, k) for k in keep if k in cfg}


def _plain(cfg, key: str) -> Any:
    """``cfg[key]`` as plain Python, resolved leaf by leaf; a leaf that cannot resolve outside a Hydra run (the run
    dir, ``${hydra:...}``) becomes None: the plan never reads one."""
    node = OmegaConf.select(cfg, key, throw_on_resolution_failure=False)
    if isinstance(node, DictConfig):
        return {str(k): _plain(cfg, f"{key}.{k}") for k in node.keys()}
    if isinstance(node, ListConfig):
        return [_plain(cfg, f"{key}[{i}]") for i in range(len(node))]
    return node
