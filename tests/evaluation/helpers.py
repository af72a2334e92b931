"""Shared by the evaluation tests (and tests/test_draft_config.py, tests/metrics/test_energy.py): composed configs, a
tiny run's overrides, reading a run dir, and `python -m evaluate` as a subprocess."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

from pardec import CONF_DIR

TINY = ["model=tiny_random", "n_samples=3", "max_new_tokens=12", "bench.warmup=0", "perplexity.enabled=true"]


def cfg_of(*overrides: str):
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines() if x.strip()]


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m evaluate <args>` in ``cwd`` with ``env`` added to this environment."""
    return subprocess.run([sys.executable, "-m", "evaluate", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def strict_json(path: Path) -> list:
    """Parse JSON / JSONL refusing NaN and Infinity (Python's json accepts them by default)."""
    def refuse(token):
        raise AssertionError(f"{path} holds {token}")

    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(x, parse_constant=refuse) for x in text.splitlines() if x.strip()]
    return [json.loads(text, parse_constant=refuse)]


def hashes(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}
