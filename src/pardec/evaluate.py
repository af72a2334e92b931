"""`python -m evaluate +method=<m> [dataset=<d>] [model=<model>]`: the Hydra entry of :mod:`pardec.evaluation`
(what a run does, writes and prints is described there). A user error (a bad config value, a refused resume, a
broken sandbox, ...) is one ``error: ...`` line on stderr and exit status 2."""

from __future__ import annotations

import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.evaluation import run
from pardec.metrics.sandbox import SandboxError


def _hydra_subdir(output_dir: str, subdir: str) -> str | None:
    """``hydra.output_subdir`` of ``conf/evaluate.yaml``: None (Hydra writes no config files) when ``output_dir``
    already holds a run (``run.json``), so a resumed or a refused attempt leaves the first one's as they were."""
    return None if (Path(output_dir) / "run.json").is_file() else subdir


if not OmegaConf.has_resolver("pardec_hydra_subdir"):
    OmegaConf.register_new_resolver("pardec_hydra_subdir", _hydra_subdir)


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig

    from pardec.config import check_overrides, exit_with_error, launcher_argv

    sys.argv[1:] = launcher_argv(sys.argv[1:])  # the deepspeed launcher's --local_rank=N

    try:
        check_overrides(sys.argv[1:], "evaluate")
    except ConfigError as e:
        exit_with_error(e)

    @hydra.main(config_path=str(CONF_DIR), config_name="evaluate", version_base="1.3")
    def _app(cfg: DictConfig) -> float | None:
        try:
            summary = run(cfg, Path(HydraConfig.get().runtime.output_dir))
        except (ConfigError, SandboxError, KeyError, FileNotFoundError, FileExistsError, ValueError) as e:
            exit_with_error(e)
        return summary.get("speedup")

    _app()
