"""`python -m evaluate +method=<m> [dataset=<d>] [model=<model>]`: the Hydra entry of :mod:`pardec.evaluation`
(what a run does, writes and prints is described there). A user error (a bad config value, a refused resume, a
broken sandbox, ...) is one ``error: ...`` line on stderr and exit status 2.

Under ``torchrun --nproc_per_node N -m evaluate ...`` (:mod:`pardec.evaluation.ranks`) every rank must write into
one run dir: its last component is ``torchrun-<run id>`` instead of a timestamp (``--standalone`` gives each launch
its own id; else pass ``hydra.run.dir=<dir>``), so a killed launch resumes with ``resume=true
hydra.run.dir=<its run dir>``; only rank 0 writes ``.hydra/``; rank r > 0 logs to ``evaluate-rank<r>.log``."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from pardec import CONF_DIR
from pardec.config import ConfigError, exit_with_error, launcher_argv, run_hydra_app
from pardec.decoding.base import METHODS, check_renamed
from pardec.evaluation import run
from pardec.evaluation.ranks import Ranks, check_launch, launch_name
from pardec.metrics.sandbox import SandboxError


def _hydra_subdir(output_dir: str, subdir: str) -> str | None:
    """``hydra.output_subdir`` of ``conf/evaluate.yaml``: None (Hydra writes no config files) when ``output_dir``
    already holds a run (``run.json``), so a resumed or a refused attempt leaves the first one's as they were, and on
    every rank but rank 0 of several."""
    if Ranks.from_env().rank != 0:
        return None
    return None if (Path(output_dir) / "run.json").is_file() else subdir


def _rank_suffix() -> str:
    """The job log's suffix: none on rank 0 (``evaluate.log``), ``-rank<r>`` on the others."""
    rank = Ranks.from_env().rank
    return f"-rank{rank}" if rank else ""


for _name, _fn in {"pardec_hydra_subdir": _hydra_subdir, "pardec_launch_name": launch_name,
                   "pardec_eval_rank_suffix": _rank_suffix}.items():
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_new_resolver(_name, _fn)


def check_renamed_params(argv: list[str]) -> None:
    """``method.heads=`` / ``method.projections=`` (the previous release's keys of Medusa's and FIRP's drafters) on the
    command line: one line naming ``method.path`` (Hydra would only say the key is not in the config)."""
    renamed = {old: new for name in METHODS.names() for old, new in METHODS.get(name).renamed.items()}
    given = dict(arg.lstrip("+~").partition("=")[::2] for arg in argv)
    check_renamed(renamed, {k[len("method."):]: v for k, v in given.items() if k.startswith("method.")})


def main() -> None:
    sys.argv[1:] = launcher_argv(sys.argv[1:])  # the deepspeed launcher's --local_rank=N

    try:
        check_renamed_params(sys.argv[1:])
        check_launch(sys.argv[1:])  # several ranks: one run dir for all
    except ConfigError as e:
        exit_with_error(e)

    @hydra.main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
    def _app(cfg: DictConfig) -> float | None:
        try:
            summary = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ConfigError, SandboxError, KeyError, FileNotFoundError, FileExistsError, ValueError) as e:
            exit_with_error(e)
        return summary.get("speedup")

    run_hydra_app(_app)
