"""`python -m train +experiment=<name> [stage=<stage>|all] [key=value ...]`: train what an experiment describes.

Every experiment names its kind (``conf/kind/<kind>.yaml``), a registered :class:`~pardec.training.kinds.Kind`
whose package under :mod:`pardec.training` holds its stages: ``cllm`` (collect | generate | train | eval), ``draft`` and ``drafter``
(generate | train | eval), ``sdsat`` (mask | train | eval); ``stage=all`` runs them in order. This module only
composes, validates, picks the kind and runs it; the summary goes to ``<run dir>/train_summary.json``.

Several processes (``torchrun --nproc_per_node N -m train ...``): data generation is sharded by prompt index and
merged by rank 0; training is data parallel (``trainer.deepspeed=zero2|zero3`` for DeepSpeed). All ranks must agree
on the run directory: every experiment fixes ``run_name: default`` (the last component of ``hydra.run.dir``), so
they do, and so does a relaunch; where ``run_name`` is left to ``conf/train.yaml`` it is a timestamp, or under a
launcher ``torchrun-<first 8 chars of TORCHELASTIC_RUN_ID>``, which a relaunch does not share. Only rank 0 writes
``.hydra/`` and the summary and creates the W&B run; every rank logs to ``train.log`` / ``train-rank<r>.log``.

Resume a killed run: rerun the same command (data generation skips what its part files hold) with the same
``run_name`` and ``trainer.resume_from_checkpoint=true`` (the newest complete ``checkpoint-*``, see
:mod:`pardec.training.checkpoints`) or ``=<checkpoint dir>``.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pardec import CONF_DIR
from pardec.config import ConfigError, Ranks, exit_with_error, launcher_argv, run_hydra_app, shared_launch_id
from pardec.config.cli import OLD_KEYS
from pardec.jsonl import read_json
from pardec.models.placement import set_tf32
from pardec.runlock import die_with_parent, run_dir_lock
from pardec.training.base import ranks_for
from pardec.training.checkpoints import resume_checkpoint
from pardec.training.kinds import Spec, experiments, load_kinds

log = logging.getLogger("pardec.train")

#: spellings of the previous release, refused with the new one named (:func:`check_old_spellings`): group options
OLD_OPTIONS = {("trainer", "distill"): "draft",
               **{("experiment", old): f"heads_{old}" for old in (
                   "medusa_tiny", "medusa_smollm2", "medusa_vicuna7b", "firp_tiny", "firp_smollm2", "firp_llama2_7b")}}


def _run_name() -> str:
    ranks = Ranks.from_env()
    if ranks.world == 1:
        return datetime.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    name = shared_launch_id()
    if name is None:
        raise ConfigError(f"{ranks.world} processes need one shared run directory: pass run_name=<name> "
                          "(or launch with `torchrun --standalone` or `deepspeed` on one node, which give every rank "
                          "the same launch id)")
    return name


def register_resolvers() -> None:
    resolvers = {
        "pardec_run_name": _run_name,
        "pardec_rank0": lambda value: value if Ranks.from_env().rank == 0 else None,
        "pardec_rank_suffix": lambda: "" if Ranks.from_env().rank == 0 else f"-rank{Ranks.from_env().rank}",
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()


def check_old_spellings(argv: list[str]) -> None:
    """Refuse a command-line override written with a spelling of the previous release, naming the new one
    (``trainer=distill`` -> ``trainer=draft``, ``distill.loss=...`` -> ``trainer.loss=...``)."""
    for arg in argv:
        prefix = arg[: len(arg) - len(arg.lstrip("+~"))]
        key, eq, value = arg[len(prefix):].partition("=")
        new_key, new_value = key, value
        if (key, value) in OLD_OPTIONS:
            new_value = OLD_OPTIONS[(key, value)]
        for old in sorted(OLD_KEYS, key=len, reverse=True):
            if key == old or key.startswith(old + "."):
                new_key = OLD_KEYS[old] + key[len(old):]
                break
        new = f"{prefix}{new_key}{eq}{new_value}"
        if new != arg:
            raise ConfigError(f"`{arg}` is an old spelling: write `{new}`")


def check_old_sections(cfg: DictConfig) -> None:
    """Refuse an experiment (its own YAML file) with a section of the previous release's name, naming the new one."""
    for old in ("distill", "heads"):
        if isinstance(cfg.get(old), DictConfig):
            moved = ", ".join(f"`{k}` -> `{v}`" for k, v in OLD_KEYS.items() if k.split(".")[0] == old)
            raise ConfigError(f"experiment {cfg.get('experiment_name')!r} has a `{old}:` section, an old spelling: "
                              f"rename it ({moved})")


def validate(cfg: DictConfig) -> Spec:
    """Check every name and value before anything heavy loads; errors name the key and the valid choices."""
    name = cfg.get("experiment_name")
    if not name:
        raise ConfigError(f"no experiment given: pass +experiment=<name>; valid experiments: {', '.join(experiments())}")
    check_old_sections(cfg)
    if cfg.get("kind") is None:
        raise ConfigError(f"experiment {name!r} names no kind: add `- /kind: <kind>` to its defaults; valid kinds: "
                          f"{', '.join(load_kinds().names())}")
    kind = load_kinds().get(cfg.kind)
    if cfg.stage not in kind.stage_choices():
        raise ConfigError(f"stage={cfg.stage!r} is not valid for a {kind.name} experiment; choose one of: "
                          f"{', '.join(kind.stage_choices())}")
    return kind().validate(cfg, name)


def run(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run the stages ``cfg.stage`` names; returns (and on rank 0 writes) ``train_summary.json``."""
    spec = validate(cfg)
    ranks = ranks_for(spec.trainer)
    torch.set_num_threads(spec.threads)
    set_tf32(bool(cfg.get("tf32", True)))
    kind = load_kinds().get(cfg.kind)
    if "train" in (kind.stages if spec.stage == "all" else (spec.stage,)):  # before any stage runs or model loads
        spec = replace(spec, resume=resume_checkpoint(spec.resume, run_dir, warn=ranks.rank == 0))
    summary: dict[str, Any] = {"experiment": spec.experiment, "kind": kind.name, "stage": spec.stage,
                               "dtype": cfg.get("dtype"), "run_dir": str(run_dir)}
    if ranks.world > 1:
        die_with_parent()  # a rank whose launcher is killed trains, saves and evaluates nothing more
    with run_dir_lock(run_dir, ranks.rank):  # one writer per run dir (and rank)
        summary.update(kind().run(spec, run_dir, ranks))
        if ranks.rank == 0:
            path = run_dir / "train_summary.json"
            summary = merge_stage_summaries(read_json(path) if path.is_file() else {}, summary,
                                            kind.stages)
            path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def merge_stage_summaries(previous: dict[str, Any], current: dict[str, Any],
                          stages: tuple[str, ...]) -> dict[str, Any]:
    """The run dir's summary after a run of some stages: run stage by stage (``stage=generate``, then ``train``,
    then ``eval``), each stage's section stays beside the next one's. An earlier run's section is kept only for a
    stage before the first one run now (a retrained draft makes its old ``eval`` stale, so that goes)."""
    ran = [i for i, s in enumerate(stages) if s in current]
    if not ran:
        return current
    sections = {s: previous[s] for s in stages[:min(ran)] if s in previous}
    sections.update({s: current[s] for s in stages if s in current})
    head = {k: v for k, v in current.items() if k not in stages}
    return {**head, "stages": list(sections), **sections}


def main() -> None:
    argv = launcher_argv(sys.argv[1:])
    sys.argv[1:] = argv
    try:
        check_old_spellings(argv)
    except ConfigError as e:
        exit_with_error(e)

    @hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
    def _app(cfg: DictConfig) -> None:
        try:
            run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ConfigError, KeyError, FileNotFoundError, FileExistsError, ValueError) as e:
            exit_with_error(e)

    run_hydra_app(_app)
