"""``python -m pardec.rehearse``'s command line (:mod:`pardec.rehearse`)."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from tqdm import tqdm

from pardec import REPO_ROOT
from pardec.rehearse.discovery import discover, find
from pardec.rehearse.plans import deepspeed_stage, plan, stages_of
from pardec.rehearse.report import as_result_file, host, render, table
from pardec.rehearse.running import Result, rehearse


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pardec.rehearse", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="paper recipes (training experiments or evaluation recipes)")
    ap.add_argument("--all", action="store_true", help="every paper recipe")
    ap.add_argument("--list", action="store_true", help="list the paper recipes and each rehearsal's overrides")
    ap.add_argument("--ranks", type=int, default=2, help="gloo ranks (torchrun --nproc_per_node)")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "rehearse", help="work dir (one per recipe)")
    ap.add_argument("--json", type=Path, help="write the results (host, commit, table rows, overrides) here")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    ap.add_argument("--render", type=Path, metavar="JSON", help="print the table and overrides of a --json file")
    args = ap.parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    recipes = discover() if args.all or (args.list and not args.names) else find(args.names)
    if not recipes:
        ap.error("name paper recipes, or pass --all (or --list)")
    out = args.out.resolve()
    plans = [plan(r, out) for r in recipes]
    if args.list:
        for p in plans:
            print(f"{p.name} ({p.recipe.app}, {' + '.join(stages_of(p))}, DeepSpeed {deepspeed_stage(p)}):")
            for what, ovs in p.overrides.items():
                print(f"  {what:7s} {' '.join(ovs)}")
        return 0

    results = []
    bar = tqdm(plans, desc="rehearse", unit="recipe", dynamic_ncols=True)
    for p in bar:
        bar.set_postfix_str(p.name)
        try:
            r = rehearse(p, args.ranks, args.timeout)
        except Exception as e:  # a broken plan (its data, its saved model) fails this recipe, not the others
            r = Result(p.name, p.recipe.app, stages_of(p), args.ranks, deepspeed_stage(p), 0.0, False,
                       [f"{type(e).__name__}: {e}"], p.overrides, "", "")
        results.append(r)
        tqdm.write(f"{'pass' if r.ok else 'FAIL'} {r.recipe} ({r.wall_s:.0f} s)" +
                   ("" if r.ok else "\n  " + "\n  ".join(r.problems) + "\n" + r.log_tail))
    print(table(results))
    total = sum(r.wall_s for r in results)
    print(f"{sum(r.ok for r in results)}/{len(results)} passed, {total:.0f} s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"command": "python -m pardec.rehearse " + " ".join(argv if argv is not None else sys.argv[1:]),
               "host": host(), "ranks": args.ranks, "total_wall_s": round(total, 1),
               "results": [asdict(r) for r in results]}
        args.json.write_text(json.dumps(as_result_file(doc), indent=2) + "\n")
    return 0 if all(r.ok for r in results) else 1

