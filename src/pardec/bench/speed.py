"""`make bench`: the speed table (docs/cpu_speed.md). SmolLM2-135M-Instruct (fp32 by default) on GSM8K test, HumanEval and
CNN/DM, the first N prompts each, 256 new tokens, greedy: `ar`, `hf` (generate), `hf_assisted` (the distilled
draft), `hf_pld`, `pld`, `sps` (fixed and adaptive gamma), `lookahead` (a CPU-sized window and the paper's
default) and `ouroboros` (a CPU-sized window).

One `python -m evaluate` run per dataset measures them all side by side, interleaved per prompt after a warm-up:
the first method of --methods is the run's method, the others run as `bench.also` roles, and
`bench.include_hf=true` adds transformers' decoders as peers (hf, hf_pld, and hf_assisted with the draft). Then
`pardec.report` aggregates the runs and the table below is printed (and written to <out>/table.md).

    python -m pardec.bench speed --dataset-path gsm8k=<gsm8k test.jsonl> [--datasets humaneval,gsm8k] [--n 20]
        [--methods sps,pld,lookahead,...] [--draft smollm2_distilled | none] [--dtype fp32] [overrides ...]

A method is `name[:key=value[:key=value...]]`. Draft methods (and hf_assisted) need the draft: when its
directory is missing (or --draft none) they are skipped with a printed note. GSM8K has no offline copy: without
`--dataset-path gsm8k=...` it is skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from pardec import CONF_DIR, REPO_ROOT, zoo

ROOT = REPO_ROOT
OFFLINE_DATASETS = ("humaneval",)  # the others need dataset.path=<local file> here
#: the named CPU-sized settings (the methods' defaults are their papers': tests/test_paper_defaults.py). With the
#: paper's windows (lookahead W 15 / N 5, Ouroboros gamma 12 / W 20 / N 7) one forward runs 60-140 tokens, which on
#: a 2-core CPU costs several single-token steps (python -m pardec.bench cost)
CPU_SIZED = {"lookahead": "lookahead:window=4:level=4:guess_set=4",
             "ouroboros": "ouroboros:gamma=4:window=4:level=4:guess_set=4",
             # a round's draft ends at the first token the draft is unsure of (p < 0.4, transformers' assistant
             # default); the paper drafts a fixed gamma. GSM8K int8 1.53x vs 1.46x (docs/methods/sps.md)
             "sps": "sps:confidence_threshold=0.4"}


def parse_method(spec: str) -> tuple[str, list[str], str]:
    """``sps:adaptive=true`` -> ("sps", ["method.adaptive=true"], "sps_adaptive-true") (a label for dir names)."""
    from pardec.evaluation.spec import split_method  # heavy: torch, transformers

    name, *params = split_method(spec)
    return name, [f"method.{p}" for p in params], "_".join([name, *params]).replace("=", "-").replace(":", "-")


def draft_available(draft: str, extra: list[str] = ()) -> tuple[bool, str]:
    """(whether ``draft=<draft>`` can be loaded, where it points), with the run's ``draft.*`` overrides applied
    (e.g. ``draft.path=<run>/final``)."""
    if draft == "none":
        return False, "draft=none"

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        d = compose("evaluate", overrides=[f"draft={draft}", *(o for o in extra if o.startswith("draft."))]).draft
    if d.source != "local":
        return True, str(d.get("path") or d.source)

    if zoo.is_ref(d.path):  # a draft kept in the zoo (checked in full when the run validates)
        kept, name = zoo.locate(d.path, "draft.path")
        return (zoo.ZOO_DIR / kept / name / zoo.MANIFEST).is_file(), d.path
    return (Path(d.path) / "config.json").is_file(), str(d.path)


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--datasets", default="gsm8k,humaneval,cnn_dm")
    ap.add_argument("--dataset-path", action="append", default=[], metavar="NAME=FILE",
                    help="a local file for a dataset, e.g. gsm8k=data/gsm8k_test.jsonl (repeatable)")
    ap.add_argument("--methods", default=f"sps,pld,sps:adaptive=true,{CPU_SIZED['lookahead']},lookahead,"
                                         f"{CPU_SIZED['ouroboros']}")
    ap.add_argument("--draft", default="smollm2_distilled", help="draft config for draft methods, or none")
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    ap.add_argument("--no-perplexity", action="store_true", help="skip scoring the completions under the target")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every job")
    a = ap.parse_intermixed_args(argv)  # overrides may come before or after the options

    import pardec.decoding  # noqa: F401  (registers the methods; heavy: torch, transformers)
    from pardec.decoding.base import METHODS  # heavy: torch, transformers

    for spec in a.methods.split(","):
        try:
            METHODS.get(spec.split(":")[0])
        except KeyError as e:  # the registry's message names the valid methods
            ap.error(f"--methods {spec!r}: {e.args[0]}")
    bad = [p for p in a.dataset_path if "=" not in p]
    if bad:
        ap.error(f"--dataset-path {bad[0]!r}: expected NAME=FILE, e.g. gsm8k=data/gsm8k_test.jsonl")
    paths = dict(p.split("=", 1) for p in a.dataset_path)
    has_draft, where = draft_available(a.draft, a.extra)
    if not has_draft:
        print(f"note: no draft ({where}); skipping draft methods and hf_assisted "
              f"(train one: python -m train +experiment=draft_smollm2)")
    methods = []
    for spec in a.methods.split(","):
        if METHODS.get(spec.split(":")[0]).needs_draft and not has_draft:
            print(f"note: skipping {spec} (needs a draft)")
            continue
        methods.append(spec)
    if not methods:
        sys.exit("no method left to run")
    main_name, main_over, _ = parse_method(methods[0])
    also = "[" + ",".join(f'"{m}"' for m in methods[1:]) + "]"
    runs = a.out / "runs"
    for ds in a.datasets.split(","):
        if ds not in OFFLINE_DATASETS and ds not in paths:
            print(f"note: skipping {ds}: no offline copy; pass --dataset-path {ds}=<local file>")
            continue
        cmd = [sys.executable, "-m", "evaluate", f"+method={main_name}", *main_over, f"bench.also={also}",
               f"dataset={ds}", *([f"dataset.path={paths[ds]}"] if ds in paths else []), f"model={a.model}",
               f"dtype={a.dtype}", f"n_samples={a.n}", f"max_new_tokens={a.max_new_tokens}", f"threads={a.threads}",
               *([f"draft={a.draft}"] if has_draft else []), "bench.include_hf=true", f"perplexity.enabled={str(not a.no_perplexity).lower()}",
               f"hydra.run.dir={runs / ds}", *a.extra]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT)
    summaries = [json.loads(p.read_text()) for p in sorted(runs.glob("*/summary.json"))]
    if not summaries:
        sys.exit("no runs")
    subprocess.run([sys.executable, "-m", "pardec.report", "runs", str(runs), "--out", str(a.out / "report")], check=True)
    from pardec.report.runs import bench_table  # heavy: matplotlib

    table = bench_table(summaries)
    (a.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"\nwritten to {a.out}")
