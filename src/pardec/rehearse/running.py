"""Launching a rehearsal on gloo ranks and checking what it wrote."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pardec import REPO_ROOT
from pardec.config import ModelConfig
from pardec.rehearse.data import write_data
from pardec.rehearse.discovery import TINY_VOCAB
from pardec.rehearse.plans import SPLIT_FREE, Plan, deepspeed_stage, stages_of


# ------------------------------------------------------------------------------------------- running
def prepare(p: Plan) -> None:
    """Write the plan's tiny data files and save its on-disk tiny models (a fresh work dir each time)."""
    if p.work.exists():
        shutil.rmtree(p.work)
    p.work.mkdir(parents=True)
    data_dir = p.work / "inputs"
    for name, path in p.data_files.items():
        written = write_data(name, data_dir)
        assert str(written) == path, (written, path)
    for path, shape in p.saved_models.items():
        from pardec.models.loading import load_model  # heavy: torch, transformers

        loaded = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu", vocab=TINY_VOCAB,
                                        **shape))
        loaded.model.save_pretrained(path)
        loaded.tokenizer.save_pretrained(path)


def launch_cmd(p: Plan, ranks: int) -> list[str]:
    """The launch: the recipe's app on ``ranks`` gloo ranks; an evaluation under
    :mod:`pardec.testing.virtual_gpus` with ``p.gpus_per_rank`` virtual CUDA devices per rank (a split target's
    devices each as large as :data:`~pardec.rehearse.plans.SPLIT_FREE` of it, measured on the model ``prepare``
    saved)."""
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), "-m"]
    if not p.gpus_per_rank:
        return [*head, p.recipe.app, *p.command_args()]
    gpus = ["pardec.testing.virtual_gpus", "--devices", str(ranks * p.gpus_per_rank)]
    if p.split_model:
        gpus += ["--memory", str(int(SPLIT_FREE * split_size(p)))]
    return [*head, *gpus, p.recipe.app, *p.command_args()]


def split_size(p: Plan) -> int:
    """Bytes of the split target's weights as it loads (its saved fp32 weights at ``p.split_bytes`` per value)."""
    fp32 = sum(f.stat().st_size for f in Path(p.split_model).glob("*.safetensors"))
    if not fp32:
        raise FileNotFoundError(f"{p.split_model}: no weights saved (prepare() first)")
    return fp32 * p.split_bytes // 4


EVAL_FACTS = ("exact_match_rate", "exactness", "n_divergences", "n_near_ties", "forward_impl", "world_size", "n_errors")


def check(p: Plan, ranks: int, facts: dict[str, Any]) -> list[str]:
    """What is wrong with the rehearsal's outputs (empty: it passed); ``facts`` gets what the table notes."""
    problems = []
    run_dir = Path(p.expect["run_dir"])
    if p.recipe.app == "evaluate":
        f = run_dir / "summary.json"
        if not f.is_file():
            return [f"no {f}"]
        s = json.loads(f.read_text())
        facts.update({k: s.get(k) for k in EVAL_FACTS})
        placed = [x.get("device") for x in s.get("ranks") or []]
        if any(placed):
            facts["placed"] = "; ".join(str(d) for d in placed)
        if p.gpus_per_rank and not all(d and "cuda" in d for d in placed):
            problems.append(f"a virtual GPU run placed its target on {placed or 'no recorded device'}, not CUDA")
        if p.split_model and not all(d and d.count("cuda") >= 2 for d in placed):
            problems.append(f"a split target stayed on {placed}: model.device_map split it over no two devices")
        if s.get("n_samples") != p.expect["n_samples"]:
            problems.append(f"summary n_samples={s.get('n_samples')}, expected {p.expect['n_samples']}")
        if "exact_match_rate" not in s:
            problems.append("summary has no exact_match_rate")
        if s.get("n_errors"):
            problems.append(f"{s['n_errors']} generation error(s): {str(s.get('errors'))[:300]}")
        if s.get("world_size", ranks) != ranks:
            problems.append(f"summary world_size={s.get('world_size')}, launched {ranks} ranks")
        return problems
    f = run_dir / "train_summary.json"
    if not f.is_file():
        return [f"no {f}"]
    s = json.loads(f.read_text())
    facts.update(stages={st: ("skipped" if isinstance(s.get(st), dict) and "skipped" in s[st] else "ran")
                         for st in stages_of(p) if st in s},
                 steps=(s.get("train") or {}).get("steps"))
    missing = [st for st in stages_of(p) if st not in s]
    if missing:
        problems.append(f"train_summary.json lacks stage(s) {missing} (has {s.get('stages')})")
    final = run_dir / "final"
    if not final.is_dir() or not any(final.iterdir()):
        problems.append(f"no artifacts in {final}")
    for out_dir, n in p.expect.get("data", {}).items():
        stats_file = Path(out_dir) / "stats.json"
        if not stats_file.is_file():
            problems.append(f"no {stats_file}")
            continue
        stats = json.loads(stats_file.read_text())
        got = stats.get("prompts", stats.get("records"))
        kept = stats.get("kept", got)
        merged = [m for m in Path(out_dir).glob("*.jsonl") if not m.name.startswith("part-")]
        lines = sum(1 for m in merged for line in m.read_text().splitlines() if line.strip())
        facts.setdefault("data", {})[Path(out_dir).name] = {"records": got, "kept": kept, "merged": lines}
        if got != n or not stats.get("complete"):
            problems.append(f"{stats_file}: {got} records (complete={stats.get('complete')}), expected {n}")
        if lines != kept:
            problems.append(f"{out_dir}: merged file has {lines} records, stats say {kept}")
    return problems


@dataclass
class Result:
    recipe: str
    app: str
    stages: list[str]
    ranks: int
    deepspeed: str
    wall_s: float
    ok: bool
    problems: list[str]
    overrides: dict[str, list[str]]
    command: str
    log: str
    log_tail: str = ""
    facts: dict[str, Any] = field(default_factory=dict)


def cause(text: str) -> str | None:
    """A failed launch's cause in one line: the last error a rank printed (``error: ...`` or an exception, not the
    launcher's ChildFailedError) and the innermost pardec frame before it."""
    lines = text.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if re.match(r"^(error: |[A-Za-z_.]*(Error|Exception)\b)", line) and "ChildFailedError" not in line \
                and "elastic" not in line:
            frame = next((m for j in range(i - 1, max(-1, i - 200), -1)
                          if (m := re.search(r'File ".*?/(pardec/[^"]+)", line (\d+)', lines[j]))), None)
            return line + (f" (at {frame.group(1)}:{frame.group(2)})" if frame else "")
    return None


def _tail(text: str, n: int = 40) -> str:
    lines = text.splitlines()
    errors = [line for line in lines if re.search(r"Error|error:|Traceback", line)]
    return "\n".join((errors[-8:] + ["..."] if errors else []) + lines[-n:])


def rehearse(p: Plan, ranks: int, timeout_s: float = 1800) -> Result:
    prepare(p)
    cmd = launch_cmd(p, ranks)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "TOKENIZERS_PARALLELISM": "false"}
    log = p.work / "launch.log"
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=p.work, env=env, capture_output=True, text=True, timeout=timeout_s)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        output += (e.stderr or b"").decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        rc = None
    wall = time.perf_counter() - t0
    log.write_text(output)
    why = cause(output) if rc != 0 else None
    problems = [(f"exit status {rc}" if rc is not None else f"timed out after {timeout_s:.0f} s") +
                (f": {why}" if why else "")] if rc != 0 else []
    facts: dict[str, Any] = {}
    problems += check(p, ranks, facts) if rc == 0 else []
    return Result(p.name, p.recipe.app, stages_of(p), ranks, deepspeed_stage(p), round(wall, 1), not problems,
                  problems, p.overrides, " ".join(cmd[1:]), str(log), "" if not problems else _tail(output), facts)


def note(r: Result) -> str:
    """The table's notes: a failure's first problem; else a skipped stage, the steps, exact match vs ``ar``."""
    if not r.ok:
        return r.problems[0][:160]
    f = r.facts
    if r.app == "evaluate":
        em = f.get("exact_match_rate")
        return (f"exact match {em:.2f}" if isinstance(em, (int, float)) else "exact match n/a") + \
            f" ({f.get('exactness')}), {f.get('forward_impl')}" + (f" on {f['placed']}" if f.get("placed") else "")
    skipped = [st for st, how in (f.get("stages") or {}).items() if how == "skipped"]
    return f"{f.get('steps')} steps" + (f"; {', '.join(skipped)} skipped by its config" if skipped else "")
