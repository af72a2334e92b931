"""`python -m pardec.bench table`: one run, one table. Every decoder pardec has, with the drafters kept in the zoo,
on each benchmark in **one** `evaluate` run per benchmark: `ar` is the baseline and every other method a
`bench.also` role (transformers' `hf_generate`, `hf_pld`, `hf_assisted` as peers), interleaved per prompt after a
warm-up, greedy, on the same prompts. Methods that decode their own fine-tuned model (CLLM's `jacobi`, `sdsat`) get
a second run per benchmark on that model, with `ar` on it as their baseline; their quality sits beside the base's.

    python -m pardec.bench table [--benchmarks gsm8k,spider,humaneval,mt_bench,cnn_dm] [--n 20]
        [--max-new-tokens 128] [--dtype fp32] [--methods all | m1,m2,...] [--out DIR] [--aggregate]
        [--publish [--name table_<date>] [--page table.md]] [overrides ...]

It resumes: rerun the same command with the same ``--out`` and every benchmark continues where it stopped (each
`evaluate` run resumes its records), also at a later commit, so that a table of several hours can be made in parts
on one host: each run records the commit it started at (``<out>/table_run.json``'s ``commits``; the table lists
them, and a benchmark's methods always come from one run). A rerun on another host (CPU model, vector flags, cores,
torch), dtype or set of methods, or with a zoo artifact rebuilt since (its manifest's sha256), is refused in one
line. ``--out`` defaults to ``data/table/<model>-<dtype>`` (``data/`` outlives ``outputs/``); ``--aggregate``
writes the table from the runs finished so far. The table, ``<out>/table.json`` (results as
data: command, commit, host, dtype, date, n) and ``<out>/table.md``, holds per benchmark and method: the speed
against `ar` (the mean of the per-prompt ratios with a 95% bootstrap interval, and the median), the speed against
the run's fastest transformers peer prompt by prompt (``vs_peer``: :func:`paired`), tokens per target forward, the
exact-match rate against `ar` (a lossless method below 1.00 is flagged, not averaged in), the task's quality metric
(and where the outputs are not the base model's ``ar``'s, its difference from them: :func:`quality`), the shares of
answers that ended before the token limit and that loop (a token repeated 10 times in a row), and how many of its
timed prompts ran on a busy host (:mod:`pardec.metrics.busy`);
``<out>/plots/<benchmark>.png`` draws each benchmark (:func:`pardec.report.table.plot_benchmarks`); ``--publish``
puts it on the pages (``docs/table.md``, its result file, raw records and figures: :mod:`pardec.bench.table_publish`).
A method whose zoo artifact is missing is left out with a note (``make zoo`` builds it).
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pardec import REPO_ROOT, zoo
from pardec.bench.speed import CPU_SIZED
from pardec.bench.table_publish import PublishError, log_wandb, publish
from pardec.bench.table_run import (
    RUN_FILE,
    TableError,
    check_identity,
    kept_shared,
    record_commit,
    redo,
    started,
)
from pardec.decoding import METHODS
from pardec.evaluation.results import is_failed, results_files
from pardec.evaluation.spec import PEERS
from pardec.jsonl import read_json, read_jsonl
from pardec.metrics.speed import record_is_repetitive
from pardec.report.table import markdown, plot_benchmarks
from pardec.zoo.build import host

#: benchmark -> its dataset overrides (local copies under the data dir; HumanEval ships with its package)
BENCHMARKS = {
    "gsm8k": ["dataset=gsm8k", "dataset.path=${paths.data_dir}/gsm8k/test.jsonl"],
    "spider": ["dataset=spider", "dataset.path=${paths.data_dir}/spider/dev.json"],
    "humaneval": ["dataset=humaneval"],
    "mt_bench": ["dataset=mt_bench", "dataset.path=${paths.data_dir}/mt_bench/question.jsonl"],
    "cnn_dm": ["dataset=cnn_dm", "dataset.path=${paths.data_dir}/cnn_dm/test.jsonl"],
}
#: every decoder on the shared target, as ``bench.also`` entries, with the zoo artifact each needs (None: none)
SHARED = [("jacobi", None), ("lookahead", None), (CPU_SIZED["lookahead"], None), ("pld", None), ("sps", "draft"),
          (CPU_SIZED["sps"], "draft"), ("ouroboros", "draft"), (CPU_SIZED["ouroboros"], "draft"), ("spectr", "draft"),
          ("mjsd", "draft"), ("mjgd", "draft"), ("bild", "draft"), ("medusa:path=zoo:medusa", "medusa"),
          ("medusa_typical:path=zoo:medusa", "medusa"), ("firp:path=zoo:firp", "firp"),
          ("eagle3:path=zoo:eagle3:mode=chain", "eagle3"), ("eagle3:path=zoo:eagle3", "eagle3"),
          ("dflash:path=zoo:dflash", "dflash"),
          # the zoo's DFlash drafts blocks of 8 (as trained); blocks of 4 were its fastest width on 2 CPU cores, in fp32
          # and int8 (docs/dflash.md "Drafters in int8"): a CPU-sized role beside the trained width
          ("dflash:path=zoo:dflash:block_size=4", "dflash")]
#: decoders of their own fine-tuned model: (method, the zoo artifact that is the model)
OWN_MODEL = [("jacobi", "cllm"), ("sdsat", "sdsat")]
#: benchmarks whose task metric needs a judge (a network service): a fine-tuned model's answers there are scored by
#: their perplexity under the base model instead, beside ``ar``'s on the fine-tuned model
JUDGED = ("mt_bench",)
LOSSLESS = ("tokens", "distribution")
BOOTSTRAP = 2000


# ------------------------------------------------------------------------------------------- plan
def zoo_has(name: str, zoo_name: str = "smollm2") -> bool:
    return (zoo.ZOO_DIR / zoo_name / name / zoo.MANIFEST).is_file()


def plan(methods: str, has=zoo_has) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """(the shared run's ``bench.also`` entries, the own-model runs (method, artifact), notes on what is left out)
    for ``--methods`` (``all`` or a comma list of entries; ``has(artifact)``: whether the zoo holds it)."""
    wanted = None if methods == "all" else methods.split(",")
    shared, own, notes = [], [], []
    for entry, needs in SHARED:
        if wanted is not None and entry not in wanted:
            continue
        if needs is not None and not has(needs):
            notes.append(f"{entry}: the zoo has no {needs!r} (make zoo ZOO_NAMES={needs})")
            continue
        shared.append(entry)
    for method, artifact in OWN_MODEL:
        if wanted is not None and f"{method}@{artifact}" not in wanted:
            continue
        if not has(artifact):
            notes.append(f"{method} on zoo:{artifact}: the zoo has no {artifact!r} (make zoo ZOO_NAMES={artifact})")
            continue
        own.append((method, artifact))
    if wanted is not None:
        known = {e for e, _ in SHARED} | {f"{m}@{a}" for m, a in OWN_MODEL}
        bad = [w for w in wanted if w not in known]
        if bad:
            raise TableError(f"--methods {bad[0]!r} is not one of the table's: {', '.join(sorted(known))} (or all)")
    return shared, own, notes


def zoo_used(shared: list[str], own: list[tuple[str, str]], zoo_name: str = "smollm2") -> dict[str, str]:
    """The zoo artifacts the table decodes with, each by the sha256 of its manifest (which holds the sha256 of every
    weight file): an artifact rebuilt in the middle of a table is a different drafter."""
    needs = dict(SHARED)
    names = sorted({needs[e] for e in shared if needs.get(e)} | {a for _, a in own})
    return {n: zoo.sha256_file(zoo.ZOO_DIR / zoo_name / n / zoo.MANIFEST) for n in names}


def identity(args: argparse.Namespace, shared: list[str], own: list[tuple[str, str]]) -> dict[str, Any]:
    """What a table run must keep across its processes: host, dtype, what it runs and the zoo artifacts it runs
    with (not the commit: each run records its own, :func:`record_commit`)."""
    h = host()
    return {"host": {k: h[k] for k in ("cpu", "flags", "cores", "torch")}, "dtype": args.dtype, "n": args.n,
            "max_new_tokens": args.max_new_tokens, "model": args.model, "shared": shared,
            "own_model": [f"{m}@{a}" for m, a in own], "zoo": zoo_used(shared, own),
            "benchmarks": args.benchmarks.split(","), "extra": list(args.extra),
            **({"temperature": args.temperature} if getattr(args, "temperature", 0.0) else {})}  # (greedy: as before)


def run_status(run_dir: Path, n: int) -> str:
    """How far a table run is: ``done``, ``<k> of <n> prompts timed`` (the baseline's records so far), or ``not
    started``."""
    if (run_dir / "summary.json").is_file():
        return "done"
    if not (run_dir / "run.json").is_file():
        return "not started"
    ids = {r.get("id") for f in results_files(run_dir) for r in read_jsonl(f, torn_ok=True) if r.get("role") == "baseline"}
    return f"{len(ids)} of {n} prompts timed"


def current_entry(entry: str) -> str:
    """A method entry (``name:key=value...``) under its method's name now: a table begun before a method was renamed
    (``eagle`` -> ``eagle3``) continues, and its rows keep one label."""
    name, sep, rest = entry.partition(":")
    return METHODS.current(name) + sep + rest


def run_artifacts(run: str, shared: list[str]) -> set[str]:
    """The zoo artifacts a run decodes with: a benchmark's shared run those of its entries, ``<bench>@<artifact>``
    that artifact (the model it decodes)."""
    _, _, model = run.partition("@")
    needs = dict(SHARED)
    return {model} if model else {needs[e] for e in shared if needs.get(e)}


def commands(args: argparse.Namespace, shared: list[str], own: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """(run dir name, evaluate arguments) of every run: per benchmark the shared run, then one per own model."""
    runs = []
    common = [f"n_samples={args.n}", f"max_new_tokens={args.max_new_tokens}", f"dtype={args.dtype}",
              f"threads={args.threads}", f"sampling.temperature={getattr(args, 'temperature', 0.0):g}"]
    no_ppl = ["perplexity.enabled=false"]
    for bench in args.benchmarks.split(","):
        data = BENCHMARKS[bench]
        also = "[" + ",".join(json.dumps(e) for e in shared) + "]"
        draft = ["draft=local", "draft.name=zoo_draft", "draft.path=zoo:draft"] if any(
            dict(SHARED).get(e) == "draft" for e in shared) else []
        runs.append((bench, ["+method=ar", f"model={args.model}", *data, *common, *no_ppl, f"bench.also={also}",
                             "bench.include_hf=true", *draft, *args.extra]))
        by_model: dict[str, list[str]] = {}
        for method, artifact in own:
            by_model.setdefault(artifact, []).append(method)
        for artifact, methods in by_model.items():
            also = "[" + ",".join(json.dumps(m) for m in methods) + "]"
            ppl = ["perplexity.enabled=true", f"perplexity.model={args.model}"] if bench in JUDGED else no_ppl
            runs.append((f"{bench}@{artifact}", ["+method=ar", "model=local", f"model.name={artifact}",
                                                  f"model.path=zoo:{artifact}", *data, *common, *ppl,
                                                  f"bench.also={also}", *args.extra]))
    return runs


# ------------------------------------------------------------------------------------------- aggregate
def bootstrap_ci(values: list[float], n: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float] | None:
    """The 95% percentile-bootstrap interval of the mean of ``values`` (None for fewer than 2)."""
    if len(values) < 2:
        return None
    rng = random.Random(seed)
    means = sorted(statistics.fmean(rng.choices(values, k=len(values))) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def cells(records: list[dict], summary: dict, max_new_tokens: int, sampled: bool = False,
          base_scores: dict[str, float] | None = None) -> dict[str, dict]:
    """The table's cells of one run (one per role): speed against the run's ``ar`` per prompt, tokens per forward,
    exact match, quality, ended / looping shares, busy count. ``sampled``: a run at temperature > 0, whose outputs
    are draws (a lossless method's draws need not equal ``ar``'s: no exact match, no flag; its distribution is
    what ``make test-stat`` checks). ``base_scores``: the base model's ``ar`` per prompt on the task metric, given
    for a fine-tuned model's run (every role's outputs then differ from the base's) and taken from the run's own
    ``ar`` otherwise (:func:`quality`)."""
    ok = counted(records)
    base = {r["id"]: r for r in ok if r["role"] == "baseline"}
    roles: dict[str, list[dict]] = {}
    for r in ok:
        roles.setdefault(r["role"], []).append(r)
    info = {"baseline": {"method": summary["baseline"], "exactness": "tokens", "metric": summary.get("baseline_metric"),
                         "exact_match_rate": 1.0, "perplexity": summary.get("baseline_perplexity")}}
    for role, p in summary.get("peers", {}).items():
        info[role] = p
    out, role_of = {}, {}
    for role, rs in roles.items():
        p = info.get(role, {})
        ratios = [base[r["id"]]["wall_s"] / r["wall_s"] for r in rs if r["id"] in base and r["wall_s"] > 0]
        forwards = sum(r.get("target_forwards") or 0 for r in rs)
        ci = bootstrap_ci(ratios)
        em = None if sampled else p.get("exact_match_rate")
        label = "ar" if role == "baseline" else current_entry(role.removeprefix("also:"))
        role_of[label] = role
        out[label] = {
            "method": p.get("method", label), "exactness": p.get("exactness"), "n": len(rs),
            "speedup_mean": statistics.fmean(ratios) if ratios else None,
            "speedup_ci95": list(ci) if ci else None,
            "speedup_median": statistics.median(ratios) if ratios else None,
            "tokens_per_forward": sum(r["n_tokens"] for r in rs) / forwards if forwards else None,
            "exact_match_rate": em,
            "flagged": bool(p.get("exactness") in LOSSLESS and em is not None and em < 1.0),
            "metric": p.get("metric"),
            "perplexity": p.get("perplexity"),  # under the scoring model (JUDGED benchmarks' own-model runs)
            "ended_share": statistics.fmean(all(len(t) < max_new_tokens for t in r["turn_tokens"]) for r in rs),
            "loop_share": statistics.fmean(record_is_repetitive(r) for r in rs),
            "busy": sum(bool(r.get("busy")) for r in rs),
        }
    peer = best_peer(out)
    metric = summary.get("metric_name")
    own = scores(roles.get("baseline", []), metric)
    for label, c in out.items():
        c["vs_peer"] = None
        if peer is not None and label != "ar" and c["method"] not in PEERS.values():
            c["vs_peer"] = paired(roles[role_of[label]], roles[role_of[peer]], peer)
        changes = base_scores is not None or c["exactness"] not in LOSSLESS or (sampled and label != "ar")
        c["quality"] = None
        if changes and metric:
            c["quality"] = quality(scores(roles[role_of[label]], metric), own if base_scores is None else base_scores,
                                   METHODS.get(c["method"]).quality_tolerance if c["method"] in METHODS else 0.0)
    return out


def counted(records: list[dict]) -> list[dict]:
    """The records a cell counts: each prompt's first repeat, failed ones left out."""
    return [r for r in records if not is_failed(r) and r.get("repeat", 0) == 0]


def scores(records: list[dict], metric: str | None) -> dict[str, float]:
    """Each prompt's task metric in ``records`` (prompts without one left out: MT-Bench without its judge)."""
    out = {}
    for r in records:
        v = (r.get("score") or {}).get(metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[r["id"]] = float(v)
    return out


def quality(method: dict[str, float], base: dict[str, float], tolerance: float) -> dict | None:
    """A method's task metric against the base model's ``ar`` on the same prompts: the mean of the per-prompt
    differences (method - ar) with its 95% bootstrap interval; ``flagged`` when the whole interval lies below
    ``-tolerance`` (the method's paper's stated quality loss: ``Decoder.quality_tolerance``), i.e. the prompts show
    a loss beyond it. An interval that reaches past it without lying wholly beyond is shown, not flagged: 20 prompts
    cannot tell it."""
    diffs = [method[i] - base[i] for i in method if i in base]
    if not diffs:
        return None
    ci = bootstrap_ci(diffs)
    return {"n": len(diffs), "mean_diff": statistics.fmean(diffs), "ci95": list(ci) if ci else None,
            "tolerance": tolerance, "flagged": bool(ci and ci[1] < -tolerance)}


def best_peer(cells: dict[str, dict]) -> str | None:
    """The run's fastest transformers peer (``hf``, ``hf_pld``, ``hf_assisted``: the highest mean speed against
    ``ar``), or None when the run has none (a fine-tuned model's own run)."""
    peers = [(c["speedup_mean"], label) for label, c in cells.items()
             if c["method"] in PEERS.values() and c["speedup_mean"] is not None]
    return max(peers)[1] if peers else None


def paired(records: list[dict], peer_records: list[dict], peer: str) -> dict | None:
    """A method against a peer prompt by prompt: the mean of ``peer wall / method wall`` over the prompts both decoded
    (> 1: the method is the faster), its 95% bootstrap interval and median. Means of each one's ratio to ``ar`` do
    not order two methods (a few looping prompts can weigh one mean up); this ratio of the same prompts does."""
    walls = {r["id"]: r["wall_s"] for r in peer_records if r["wall_s"] > 0}
    ratios = [walls[r["id"]] / r["wall_s"] for r in records if r["id"] in walls and r["wall_s"] > 0]
    if not ratios:
        return None
    ci = bootstrap_ci(ratios)
    return {"peer": peer, "n": len(ratios), "mean": statistics.fmean(ratios), "ci95": list(ci) if ci else None,
            "median": statistics.median(ratios)}


def _one_commit(commits: dict[str, list[str]]) -> str:
    """The table's commit: the one every run used, else the runs' commits joined (each run's under ``commits``)."""
    every = sorted({c for cs in commits.values() for c in cs if c})
    return every[0] if len(every) == 1 else "several: " + ", ".join(c[:9] for c in every)


def aggregate(out: Path, runs: list[tuple[str, list[str]]], ident: dict, command: str) -> dict:
    commits = read_json(out / RUN_FILE, TableError).get("commits", {})

    every = set(ident["shared"]) >= {e for e, _ in SHARED} and len(ident.get("own_model", [])) == len(OWN_MODEL)
    table: dict[str, Any] = {
        "title": ("Every decoder" if every else "The decoders chosen by --methods")
        + " on every benchmark: one run per benchmark, speed against ar beside quality",
        "date": time.strftime("%Y-%m-%d"), "command": command, "commit": _one_commit(commits),
        "commits": commits, "host": ident["host"], "zoo": ident.get("zoo", {}),
        "dtype": ident["dtype"], "n": ident["n"], "max_new_tokens": ident["max_new_tokens"],
        "sampling": {"temperature": ident.get("temperature", 0.0)}, "benchmarks": {}}
    bases: dict[str, dict[str, float]] = {}
    for name, _ in runs:
        run_dir = out / "runs" / name
        if not (run_dir / "summary.json").is_file():
            table.setdefault("pending", []).append(name)
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        add_run(table, name, read_jsonl(run_dir / "results.jsonl", torn_ok=True), summary, bases)
    return table


def add_run(table: dict, name: str, records: list[dict], summary: dict, bases: dict[str, dict[str, float]]) -> None:
    """One finished run's cells into ``table`` (``<benchmark>[@<fine-tuned model>]``: its methods get ``@model``).
    ``bases``: the base model's ``ar`` scores per benchmark, filled by each benchmark's shared run (which comes
    before its fine-tuned models' runs) and read by those."""
    bench, _, model = name.partition("@")
    entry = table["benchmarks"].setdefault(bench, {"metric": summary.get("metric_name"), "methods": {},
                                                   "timed_s": 0.0})
    entry["timed_s"] += sum(r.get("wall_s") or 0.0 for r in records)  # every role's timed decoding (not the warm-up)
    sampled = bool((table.get("sampling") or {}).get("temperature"))
    if not model:
        bases[bench] = scores([r for r in counted(records) if r["role"] == "baseline"], summary.get("metric_name"))
    base = bases.get(bench, {}) if model else None
    for label, cell in cells(records, summary, table["max_new_tokens"], sampled, base).items():
        entry["methods"][f"{label}@{model}" if model else label] = cell


def rederive(result: Path) -> list[str]:
    """A published table's cells computed anew from its published raw records (``<name>/<run>.*.gz``), after the
    cell's definition gained a field: every field the file held before must come out equal (the same records, the
    same seeded bootstrap), or nothing is written; the new fields are added and the file records when
    (``rederived``). Returns the fields added."""
    old = json.loads(result.read_text())
    raw = result.with_suffix("")
    runs = sorted(p.name.removesuffix(".summary.json.gz") for p in raw.glob("*.summary.json.gz"))
    if not runs:
        raise TableError(f"{result}: no raw records under {raw}/ to derive the cells from")
    new, bases = {**old, "benchmarks": {}}, {}
    for name in runs:
        with gzip.open(raw / f"{name}.summary.json.gz", "rt") as f:
            summary = json.load(f)
        with gzip.open(raw / f"{name}.results.jsonl.gz", "rt") as f:
            records = [json.loads(line) for line in f if line.strip()]
        add_run(new, name, records, summary, bases)
    added = set()
    for bench, b in old["benchmarks"].items():
        moved = [k for k, v in b.items() if k != "methods" and new["benchmarks"].get(bench, {}).get(k) != v]
        if moved:
            raise TableError(f"{result}: {bench}'s {moved} do not come out as published from its records; "
                             "nothing written")
        for label, cell in b["methods"].items():
            fresh = new["benchmarks"].get(bench, {}).get("methods", {}).get(label)
            if fresh is None or any(fresh.get(k) != v for k, v in cell.items()):
                raise TableError(f"{result}: {bench}/{label} does not come out as published from its records "
                                 f"({fresh and [k for k, v in cell.items() if fresh.get(k) != v]}); nothing written")
            added |= set(fresh) - set(cell)
    for bench, b in old["benchmarks"].items():  # the published order of benchmarks and methods
        fresh = new["benchmarks"].pop(bench)
        new["benchmarks"][bench] = {**fresh, "methods": {label: fresh["methods"][label] for label in b["methods"]}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    new["rederived"] = [*old.get("rederived", []),
                        {"date": time.strftime("%Y-%m-%d"), "commit": commit, "added": sorted(added)}]
    result.write_text(json.dumps(new, indent=1) + "\n")
    return sorted(added)


# ------------------------------------------------------------------------------------------- command
def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--benchmarks", default=",".join(BENCHMARKS))
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (default; every lossless cell must match ar exactly); > 0: the sampled table, "
                         "in a directory of its own (data/table/<model>-<dtype>-t<T>)")
    ap.add_argument("--methods", default="all")
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--threads", default="auto")
    ap.add_argument("--out", type=Path, default=None, help="the table's directory (default: data/table/<model>-<dtype>)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")
    ap.add_argument("--status", action="store_true", help="print how far each run is (done, prompts timed, not "
                                                         "started), run nothing")
    ap.add_argument("--aggregate", action="store_true",
                    help="write table.json, table.md and the plots from the runs finished so far and run nothing (a "
                         "table made in parts is published part by part; the unfinished runs are listed as pending)")
    ap.add_argument("--wandb", action="store_true",
                    help="also log the table to W&B: one run, a table per benchmark (offline unless WANDB_MODE says)")
    ap.add_argument("--redo", default=None, metavar="RUN[,RUN...]",
                    help="run these runs anew (the old ones are set aside under runs/superseded/): after a zoo "
                         "artifact was rebuilt, the runs that decode with it (e.g. gsm8k@cllm,spider@cllm)")
    ap.add_argument("--publish", action="store_true",
                    help="also put the table on the project's pages (docs/results/<name>.json, its raw records, "
                         "figures and docs/<page>; pardec.bench.table_publish)")
    ap.add_argument("--allow-busy", action="store_true",
                    help="--publish cells with prompts timed on a busy host (their busy count shown); refused otherwise")
    ap.add_argument("--name", default=None, help="the publication's name (default: table_<date the table started>)")
    ap.add_argument("--page", default="table.md", help="the page under docs/ that shows the table (default: table.md)")
    ap.add_argument("--rederive", type=Path, default=None, metavar="RESULT_JSON",
                    help="compute a published table's cells anew from its published raw records (after a new field "
                         "joined the cells: the fields it held must come out equal), then run nothing")
    ap.add_argument("extra", nargs="*", help="more Hydra overrides for every run")
    a = ap.parse_intermixed_args(argv)
    if a.rederive is not None:
        try:
            added = rederive(a.rederive)
        except (TableError, OSError, json.JSONDecodeError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{a.rederive}: every cell as published; added {', '.join(added) or 'nothing'} "
              "(python -m pardec.report docs renders the pages)")
        return 0
    if not 0.0 <= a.temperature <= 100.0:
        ap.error(f"--temperature={a.temperature} is out of range: 0 (greedy) or a positive temperature")
    a.out = a.out or REPO_ROOT / "data" / "table" / (f"{a.model}-{a.dtype}" + (f"-t{a.temperature:g}"
                                                                                 if a.temperature else ""))
    bad = [b for b in a.benchmarks.split(",") if b not in BENCHMARKS]
    if bad:
        ap.error(f"--benchmarks {bad[0]!r} is not one of: {', '.join(BENCHMARKS)}")
    if a.name is not None and not re.fullmatch(r"table_[\w.-]+", a.name):
        ap.error(f"--name {a.name!r} is not a publication name: it must start with table_ (the pages render a "
                 "result file named table_* as a table) and hold only letters, digits, '_', '.', '-'")
    if not re.fullmatch(r"[\w.-]+\.md", a.page):
        ap.error(f"--page {a.page!r} is not a page under docs/: a file name ending in .md, such as table.md")
    for flag in ("n", "max_new_tokens"):
        if getattr(a, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}={getattr(a, flag)} is out of range: it must be >= 1")
    try:
        shared, own, notes = plan(a.methods)
        runs = commands(a, shared, own)
        for note in notes:
            print(f"note: left out: {note}")
        if a.dry_run:
            for name, args in runs:
                print(f"{name}: python -m evaluate {' '.join(args)}")
            return 0
        if a.status:
            for name, _ in runs:
                print(f"{name}: {run_status(a.out / 'runs' / name, a.n)}")
            return 0
        ident = identity(a, shared, own)
        kept_shared(a.out, current_entry)
        if a.redo and (a.out / RUN_FILE).is_file():
            check_identity(a.out, ident, ignore=("zoo",))  # the same table but for its drafters
            for moved in redo(a.out, a.redo.split(","), ident["zoo"], {n: run_artifacts(n, shared) for n, _ in runs}):
                print(f"set aside: {moved}")
        check_identity(a.out, ident)
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for name, args in [] if a.aggregate else runs:
        run_dir = a.out / "runs" / name
        if (run_dir / "summary.json").is_file() and (run_dir / "results.jsonl").is_file():
            print(f"{name}: done earlier")
            continue
        resume = ["resume=true"] if (run_dir / "run.json").is_file() else []
        record_commit(a.out, name)
        cmd = [sys.executable, "-m", "evaluate", *args, *resume, f"hydra.run.dir={run_dir}"]
        print("+", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, cwd=REPO_ROOT).returncode
        if rc != 0:
            print(f"error: the {name} run stopped (exit {rc}); rerun the same command to continue it",
                  file=sys.stderr)
            return rc
    publishing = ("--aggregate", "--publish", "--wandb", "--allow-busy", "--name", a.name, "--page", a.page)
    given = [x for x in (argv if argv is not None else sys.argv[1:]) if x not in publishing]  # what made the runs
    command = "python -m pardec.bench table " + " ".join(given)
    table = aggregate(a.out, runs, ident, command.strip())
    (a.out / "table.json").write_text(json.dumps(table, indent=1) + "\n")
    (a.out / "table.md").write_text(markdown(table) + "\n")
    plot_benchmarks(table, a.out / "plots")
    print(markdown(table))
    pending = table.get("pending")
    print(f"written to {a.out}/table.json, table.md and plots/<benchmark>.png"
          + (f"; not finished yet: {', '.join(pending)}" if pending else ""))
    if a.wandb:
        log_wandb(table, a.out)
    if a.publish:
        try:
            written = publish(a.out, table, REPO_ROOT, a.name or f"table_{started(a.out)}", a.page,
                              title=table["title"], allow_busy=a.allow_busy)
        except PublishError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"published: {len(written)} files, the page docs/{a.page}")
    return 0
