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
    """``conf/evaluate.yaml`` composed with ``overrides``; ``threads`` (a run's torch threads; auto by default: the
    free cores) is the test's own (tests/conftest.py: 1 per pytest-xdist worker) unless given: a run sets it for its
    whole process, and two workers' runs of 2 threads each on 2 cores wait on each other's threads (many times slower
    on a busy machine)."""
    from tests.conftest import THREADS

    if not any(o.split("=")[0].lstrip("+~") == "threads" for o in overrides):
        overrides = (*overrides, f"threads={THREADS}")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return compose("evaluate", overrides=list(overrides))


def lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines() if x.strip()]


def run_cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m evaluate <args>` in ``cwd`` with ``env`` added to this environment."""
    return subprocess.run([sys.executable, "-m", "evaluate", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


#: runs the `python -m evaluate` command lines read from stdin (JSON: args, cwd, env, hash) one after another through
#: :func:`pardec.evaluate.main` (Hydra and all) in this one process; prints a JSON list of {returncode, stdout, stderr}
#: (+ hashes: :func:`hashes` of the case's ``hash`` dir after it ran)
_CLI_RUNNER = """
import contextlib, io, json, os, sys, traceback
from pathlib import Path
from hydra.core.global_hydra import GlobalHydra
from pardec.evaluate import main as evaluate_main
from pardec.train import main as train_main
from tests.evaluation.helpers import hashes
base, out = dict(os.environ), []
for case in json.load(sys.stdin):
    os.environ.clear()
    os.environ.update({**base, **case["env"]})
    os.chdir(case["cwd"])
    app = case.get("app", "evaluate")
    sys.argv = [app, *case["args"]]
    GlobalHydra.instance().clear()
    err, std, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(std):
        try:
            (train_main if app == "train" else evaluate_main)()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
    r = {"returncode": code, "stdout": std.getvalue(), "stderr": err.getvalue()}
    if case.get("hash"):
        r["hashes"] = hashes(Path(case["hash"]))
    out.append(r)
print(json.dumps(out))
"""


def run_cli_in_one_process(cases: list[dict], prelude: str = "", env: dict | None = None) -> list[dict]:
    """Several `python -m evaluate` (or, with "app": "train", `python -m train`) command lines run in turn in one
    child process (a fresh process each costs ~5-10 s of imports): each case is {"args": [...], "cwd": dir, "env":
    {...} (added to this environment for that case only), "hash": dir (optional), "app" (optional)}; returns {returncode (the exit status the command would have), stdout,
    stderr, hashes (of the ``hash`` dir right after the case ran)} per case. ``prelude``: code the child runs first
    (e.g. wrapping a function); ``env``: added to the child's environment from its start (variables that libraries
    read at import, which a case's own ``env`` comes too late for)."""
    from pardec import REPO_ROOT

    todo = [{"args": list(c["args"]), "cwd": str(c["cwd"]), "env": c.get("env", {}), "app": c.get("app", "evaluate"),
             "hash": str(c["hash"]) if c.get("hash") else None} for c in cases]
    path = os.pathsep.join(filter(None, [str(REPO_ROOT / "src"), str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    p = subprocess.run([sys.executable, "-c", prelude + _CLI_RUNNER], input=json.dumps(todo), capture_output=True,
                       text=True, env={**os.environ, **(env or {}), "PYTHONPATH": path}, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.splitlines()[-1])


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
