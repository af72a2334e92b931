"""The plan checked against measured peaks: each training kind and drafter type's tiny experiment, run at a reduced
size on the CPU with ``measure_memory=true`` (the train stage's peak above its start, :class:`~pardec.metrics.memory.
StagePeak`), beside :func:`~pardec.plan.plans.composed_plan` of the same composed config (the model built in code
planned from its own architecture, one rank, no DeepSpeed).

    python -m pardec.plan.measured [--json FILE] [name ...]      the table (one train stage each, ~10 s on 2 cores)

The sizes put the plan's terms in the regime it plans for: sequences of ``trainer.max_length`` (512) tokens whose
loss covers nearly all of them (short prompts without a chat template, long completions or documents), a batch of
4, a 8,192-token vocabulary, so the logits dominate as they do at paper scale. What is compared is the plan's total
less its overhead (10% of it, for the CUDA context and fragmentation, which the CPU allocator's peak does not hold).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import date
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pardec.config import composed
from pardec.plan.drafters import dflash, firp, medusa
from pardec.plan.plans import DRAFT_TEACHER_COPIES, STEP_COPIES, composed_plan

#: the reduced size per tiny experiment: overrides (``{data}``: the directory :func:`write_data` fills)
SIZE = ("model.chat=false", "trainer.max_length=512", "trainer.per_device_train_batch_size=4")
COMPLETIONS = ("completions.sources.0.dataset.path={data}/short.jsonl", "completions.max_new_tokens=480")
CASES: dict[str, tuple[str, ...]] = {
    "draft_tiny": COMPLETIONS,
    "heads_medusa_tiny": COMPLETIONS,
    "heads_firp_tiny": COMPLETIONS,
    "eagle3_tiny": COMPLETIONS,
    "dflash_tiny": (*COMPLETIONS, "drafter.num_anchors=64"),
    "sdsat_tiny": ("mask.sources.0.dataset.path={data}/long.jsonl", "mask.max_length=512"),
    "cllm_tiny": ("dataset.path={data}/short.jsonl", "completions.max_new_tokens=480", "collect.max_new_tokens=64",
                  "collect.block_size=16"),
}
TOLERANCE = 0.15  # the plan's total (less its overhead) within 15% of the measured peak


def write_data(out: Path) -> Path:
    """GSM8K-shaped files: ``short.jsonl`` (one-line questions: the completions are nearly the whole sequence) and
    ``long.jsonl`` (documents longer than 512 tokens: SDSAT's masked corpus fills every row)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = "the of and to in is that it for on with as was at by an be this which or from but not are".split()
    with open(out / "short.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"question": f"What is {i} plus {i + 1}?", "answer": f"#### {2 * i + 1}"}) + "\n")
    with open(out / "long.jsonl", "w") as f:
        for i in range(12):
            text = " ".join(f"{rng.choice(words)}{rng.randint(0, 99)}" for _ in range(400))
            f.write(json.dumps({"question": f"Q{i}?", "answer": f"{text}\n#### {i}"}) + "\n")
    return out


def compose_case(name: str, work: Path, threads: int = 1, extra: Sequence[str] = ()):
    """The tiny experiment ``name`` at :data:`CASES`' size, its data and outputs under ``work`` (a DictConfig as the
    train app resolves it)."""
    import pardec.train  # noqa: F401  (its resolvers; heavy: torch, transformers)

    data = write_data(work / "inputs")
    overrides = [f"+experiment={name}", f"paths.data_dir={work}/data", f"paths.output_dir={work}/out",
                 "measure_memory=true", f"threads={threads}", *SIZE,
                 *(o.format(data=data) for o in CASES[name]), *extra]
    return composed("train", overrides)


def measure(name: str, work: Path, threads: int = 1, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``name``'s stages (data, train, eval) at the reduced size; the train stage's measured peak beside the plan
    of the same config (MB = 1e6 bytes)."""
    from pardec.train import run  # heavy: torch, transformers

    cfg = compose_case(name, work, threads, extra)
    summary = run(cfg, work / "run")
    peak = (summary.get("train") or {}).get("peak_memory")
    if not peak:
        raise RuntimeError(f"{name}: the train stage recorded no peak (glibc's mallinfo2 is needed on the CPU)")
    p = composed_plan(name, "train", OmegaConf.to_container(cfg, resolve=True), world=1)
    measured = peak["bytes"]
    return {"experiment": name, "overrides": list(extra), "kind": p.kind, "type": (cfg.get("drafter") or {}).get("type"),
            "measured_mb": round(measured / 1e6, 1), "planned_mb": round(p.total / 1e6, 1),
            "planned_without_overhead_mb": round((p.total - p.components["overhead"]) / 1e6, 1),
            "error": round((p.total - p.components["overhead"]) / measured - 1, 3),
            "components_mb": {k: round(v / 1e6, 2) for k, v in p.components.items()}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pardec.plan.measured", description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="name",
                        help=f"tiny experiments (default all: {', '.join(CASES)})")
    parser.add_argument("--json", metavar="FILE", help="write the rows, command, commit, host and date here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override on top of the reduced size, e.g. trainer.max_length=256 (repeatable)")
    args = parser.parse_args(argv)
    bad = [n for n in args.names if n not in CASES]
    if bad:
        parser.error(f"unknown experiment(s) {bad}; valid: {', '.join(CASES)}")
    names = args.names or list(CASES)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            if len(names) == 1:
                rows.append(measure(name, Path(tmp), args.threads, args.set))
            else:  # a process each: what an earlier run left allocated (caches, tokenizers) would lower the peak
                one = Path(tmp) / "row.json"
                subprocess.run([sys.executable, "-m", "pardec.plan.measured", name, "--threads", str(args.threads),
                                "--json", str(one), *(f"--set={o}" for o in args.set)], check=True,
                               stdout=subprocess.DEVNULL)
                rows.append(json.loads(one.read_text())["rows"][0])
        r = rows[-1]
        print(f"{r['experiment']:<18} {r['kind']:<6} {r['type'] or '-':<7} measured {r['measured_mb']:>8.1f} MB  "
              f"planned {r['planned_mb']:>8.1f} MB  error {r['error']:+.1%}", flush=True)
    if args.json:
        from pardec.models.host import machine  # heavy: torch, transformers
        from pardec.zoo.build import git_state  # heavy: torch

        out = {"title": "The memory plan against the measured peak of each training kind's train stage at a reduced "
                        "size on the CPU (python -m pardec.plan.measured)",
               "command": shlex.join(["python", "-m", "pardec.plan.measured", *(argv if argv is not None
                                                                               else sys.argv[1:])]),
               **git_state(), "host": machine(), "date": date.today().isoformat(), "dtype": "fp32",
               "n": len(rows), "tolerance": TOLERANCE, "factors": factors(), "rows": rows,
               "tables": {"measured": table(rows)}}
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.json}")


def factors() -> dict[str, Any]:
    """The plan's measured copy counts this table checks (fp32 copies of the logits)."""
    return {"step_copies": {**STEP_COPIES, "dflash": dflash.SLOT_COPIES, "draft_teacher": DRAFT_TEACHER_COPIES},
            "depth_base_copies": {"medusa": medusa.BASE_COPIES, "firp": firp.BASE_COPIES}}


def table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The rows as the table docs/plan.md renders (MB = 1e6 bytes)."""
    columns = ["experiment", "kind", "drafter type", "measured MB", "planned MB (less overhead)", "planned MB",
               "error"]
    return {"columns": columns, "rows": [[r["experiment"], r["kind"], r["type"] or "-", f"{r['measured_mb']:.1f}",
                                          f"{r['planned_without_overhead_mb']:.1f}", f"{r['planned_mb']:.1f}",
                                          f"{r['error']:+.1%}"] for r in rows]}


if __name__ == "__main__":
    main()
