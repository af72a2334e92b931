"""``python -m pardec.plan``: the table, its result file, the command line."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from collections.abc import Sequence
from datetime import date
from pathlib import Path

from pardec.config import ConfigError, exit_with_error
from pardec.plan.compose import check_name, paper_recipes
from pardec.plan.data_stages import stage_plans
from pardec.plan.plans import plan
from pardec.plan.shapes import CAPACITIES_GB, COMPONENTS, GB, OVERHEAD, Plan

# ------------------------------------------------------------------------------------------- output
_HEAD = ("recipe", "kind", "world", "ZeRO", "params") + tuple(c if c != "optimizer" else "optim" for c in COMPONENTS) \
    + ("total",) + tuple(f"{c}GB" for c in CAPACITIES_GB)


def _fit_cell(p: Plan, cap: int) -> str:
    if p.fits(cap):
        return "yes"
    n = p.gpus_needed.get(cap)
    return f"{n} GPUs" if n and n > p.world else "no"


def table_rows(plans: Sequence[Plan]) -> list[tuple[str, ...]]:
    return [(p.recipe, p.kind, str(p.world), "-" if p.zero is None else str(p.zero), f"{p.params / 1e9:.2f}B",
             *(f"{p.components[c] / GB:.1f}" for c in COMPONENTS), f"{p.total / GB:.1f}",
             *(_fit_cell(p, c) for c in CAPACITIES_GB)) for p in plans]


def table(plans: Sequence[Plan]) -> str:
    rows = [_HEAD, *table_rows(plans)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEAD))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pardec.plan", description=__doc__.splitlines()[0],
        epilog="GB = 1e9 bytes, per GPU; overhead = 10% of the components. Formulas: docs/plan.md.")
    parser.add_argument("recipes", nargs="*", help="conf/experiment/<name> or conf/recipe/<name> (no extension)")
    parser.add_argument("--all", action="store_true", help="every paper recipe (those with a shipped config.json)")
    parser.add_argument("--json", metavar="OUT", help="also write the plans to this JSON file")
    parser.add_argument("--result", metavar="FILE#NAME",
                        help="also keep the table as table NAME of the result file FILE (created, or added to), with "
                             "its command, commit and date: what docs/plan.md's tables are rendered from")
    parser.add_argument("--world", type=int, help="training ranks (default: the recipe's --nproc_per_node, else 8)")
    parser.add_argument("--gpus", type=int, help="evaluation: GPUs a model.device_map target is split over (default 1)")
    parser.add_argument("--prompt-tokens", type=int, help="evaluation: longest prompt in tokens (default: per task)")
    parser.add_argument("--batch", type=int, default=1,
                        help="evaluation: prompts decoded at once (batched decoding: the KV caches hold this many rows)")
    parser.add_argument("--stages", action="store_true",
                        help="training recipes: also plan the stages that generate the training data (completions, "
                             "CLLM's Jacobi trajectories, held-out completions), a row each (pardec.plan.data_stages)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for the composed recipe, e.g. trainer.deepspeed=zero3 (repeatable)")
    args = parser.parse_args(argv)
    try:
        names = list(args.recipes) + (paper_recipes() if args.all else [])
        if not names:
            parser.error("name at least one recipe, or --all")
        for n in names:
            check_name(n)
        each = stage_plans if args.stages else (lambda n, **kw: [plan(n, **kw)])
        plans = [p for n in dict.fromkeys(names)
                 for p in each(n, world=args.world, gpus=args.gpus, overrides=args.set, prompt_tokens=args.prompt_tokens,
                               batch=args.batch)]
    except ConfigError as e:
        exit_with_error(e)
    print(table(plans))
    print(f"\nper GPU, GB = 1e9 bytes; overhead = {OVERHEAD:.0%} of the rest (CUDA context, fragmentation); "
          "eval rows: world = GPUs the target is split over (model.device_map), the first GPU also holds the draft")
    if args.json:
        Path(args.json).write_text(json.dumps([p.to_json() for p in plans], indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.result:
        keep_result(args.result, plans, ["python", "-m", "pardec.plan", *(argv if argv is not None else sys.argv[1:])])
        print(f"wrote {args.result}")


def keep_result(ref: str, plans: Sequence[Plan], command: Sequence[str]) -> None:
    """Table ``NAME`` of result file ``FILE`` (``FILE#NAME``): the rows, the command and the commit it came from; the
    file's other tables are kept (one file holds a page's tables, each with its own command)."""
    path, _, name = ref.partition("#")
    if not name:
        raise SystemExit(f"--result {ref!r}: give FILE#NAME (the table's name in the file)")
    out = Path(path)
    data = json.loads(out.read_text()) if out.is_file() else {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or None
    data.update({"title": "Memory plans of the paper recipes: python -m pardec.plan (per GPU, GB = 1e9 bytes; "
                          "estimates from the formulas of docs/plan.md, their loss factors measured)",
                 "date": date.today().isoformat(), "host": "any: each model's architecture is built on the meta "
                 "device from the shipped config.json (no weights, no GPU)",
                 "dtype": "bf16 (the recipes' GPU defaults: dtype bf16, trainer.bf16)", "n": None,
                 "transcribed": False})
    data.setdefault("tables", {})[name] = {"command": shlex.join(command), "commit": commit,
                                           "columns": list(_HEAD), "rows": [list(r) for r in table_rows(plans)],
                                           "plans": [p.to_json() for p in plans]}
    data["command"] = "; ".join(t["command"] for t in data["tables"].values())
    data["commit"] = ", ".join(sorted({t["commit"] or "?" for t in data["tables"].values()}))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
