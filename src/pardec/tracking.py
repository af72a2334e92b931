"""Experiment tracking: W&B (``logger=wandb``, offline unless configured) or nothing (``logger=none``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
LOGGERS = ("none", "wandb")


class Tracker:
    """Context manager: ``with Tracker(cfg.logger, ...) as t: t.log_summary(...)``; ``wandb.finish()``
    always runs, also when the job fails."""

    def __init__(self, logger_cfg: dict | None, run_dir: Path, config: dict, prefix: str, group: str | None = None,
                 name: str | None = None):
        self.cfg = dict(logger_cfg or {"name": "none"})
        if self.cfg.get("name", "none") not in LOGGERS:
            raise ValueError(f"logger={self.cfg.get('name')!r} is not valid; choose one of: {', '.join(LOGGERS)}")
        self.run_dir, self.config, self.prefix = run_dir, config, prefix
        self.group, self.name = self.cfg.get("group") or group, name
        self.run = None

    def __enter__(self) -> Tracker:
        if self.cfg.get("name") == "wandb":
            import wandb  # heavy: wandb

            self.run = wandb.init(
                project=self.cfg.get("project", "pardec"),
                entity=self.cfg.get("entity"),
                mode=self.cfg.get("mode", "offline"),
                group=self.group,
                name=self.name,
                tags=list(self.cfg.get("tags") or []),
                dir=str(self.run_dir),
                config=self.config,
                reinit="finish_previous",
            )
        return self

    def log(self, metrics: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({f"{self.prefix}/{k}": v for k, v in metrics.items()})

    def log_summary(self, summary: dict[str, Any]) -> None:
        if self.run is None:
            return
        for k, v in summary.items():
            if isinstance(v, (int, float, str)) or v is None:
                self.run.summary[f"{self.prefix}/{k}"] = v
            elif k == "peers" and isinstance(v, dict):  # peers.<role>.<stat>, e.g. jacobi/peers/hf_pld/speedup
                for role, stats in v.items():
                    for stat, x in stats.items():
                        if isinstance(x, (int, float, str)) or x is None:
                            self.run.summary[f"{self.prefix}/peers/{role}/{stat}"] = x

    def log_table(self, key: str, rows: list[dict]) -> None:
        if self.run is None or not rows:
            return
        import wandb  # heavy: wandb

        cols = sorted({k for r in rows for k in r})
        table = wandb.Table(columns=cols, data=[[_cell(r.get(c)) for c in cols] for r in rows])
        self.run.log({f"{self.prefix}/{key}": table})

    def __exit__(self, *exc) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if exc[0] else 0)
            self.run = None


def _cell(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else str(v)
