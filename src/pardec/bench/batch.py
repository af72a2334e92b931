"""``python -m pardec.bench batch``: how a method's gain changes as the batch grows, and where it falls below
batched ``ar`` (the crossover).

Every batched method (:data:`pardec.decoding.batch.BATCHED`) decodes the same N prompts at each batch size, all
submitted at once (continuous batching: :func:`~pardec.decoding.batch.run_batch`), after a warm-up; the methods take
turns at each batch size before the next one, so drift in the machine's speed hits them alike. Per cell: aggregate
tokens/s, per-request latency from submission (mean, p50, p95), tokens per target forward, the share of prompts whose
tokens equal batch-1 ``ar``'s (greedy; 1.00 expected of every lossless method in fp32) and whether another process
competed for the CPU meanwhile (:mod:`pardec.metrics.busy`). The crossover of a method: the smallest batch size at
which its tokens/s fall below batched ``ar``'s at the same size.

    python -m pardec.bench batch [--methods ar,pld,sps,bild,jacobi,eagle3:path=zoo:eagle3,dflash:path=zoo:dflash,...]
        [--batch-sizes 1,2,4,8,16] [--n 16] [--max-new-tokens 128] [--out DIR]
        [overrides: model=smollm2_135m dataset=gsm8k dataset.path=FILE dtype=fp32 draft=... threads=2 ...]

Methods with a draft model (``sps``) get the zoo's (``draft.path=zoo:draft``) unless a ``draft`` override names
another.

``<out>/batch.json`` holds the run's identity (host, commit, settings) and each cell as it is measured: a killed run
continues where it stopped (measured cells are kept) and refuses to continue with another identity.
``<out>/batch.png``: tokens/s and speed against batched ``ar`` per batch size; ``<out>/batch.md``: the table.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from tqdm import tqdm

from pardec import CONF_DIR, REPO_ROOT, zoo
from pardec.bench.speed import CPU_SIZED
from pardec.config import ConfigError
from pardec.config.schema import settings_diff
from pardec.jsonl import read_json
from pardec.metrics.busy import CpuMeter, free_cores
from pardec.report.batch import run_mode
from pardec.tasks.base import DataError, build_task, select_docs

FILE = "batch.json"
#: every batched method over the shipped target, the trained ones with the zoo's drafters (sps, bild: the zoo's draft
#: model unless draft= is given; eagle3 in both modes: its chain and the paper's 60-node tree), lookahead and
#: ouroboros at their CPU-sized windows; sdsat decodes its own fine-tuned model: a run of its own (model=local model.path=zoo:sdsat)
DEFAULT_METHODS = ("ar,pld,sps,bild,jacobi,eagle3:path=zoo:eagle3:mode=chain,eagle3:path=zoo:eagle3,"
                   "dflash:path=zoo:dflash,medusa:path=zoo:medusa,firp:path=zoo:firp,spectr,mjsd," + CPU_SIZED["lookahead"]
                   + "," + CPU_SIZED["ouroboros"])
ZOO_DRAFT = ["draft=local", "draft.name=zoo_draft", "draft.path=zoo:draft"]


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--batch-sizes {text!r}: expected integers >= 1 separated by commas, e.g. 1,2,4,8") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--batch-sizes {text!r}: expected integers >= 1 separated by commas, e.g. 1,2,4,8")
    return sizes


def parse_methods(text: str) -> list[tuple[str, str, dict]]:
    """``ar,sps:gamma=4`` -> [(label, name, params)], each checked against the batched methods; ``ar`` first."""
    from pardec.decoding.batch.engine import check_batched  # heavy: torch, transformers
    from pardec.evaluation.spec import parse_also  # heavy: torch, transformers

    out = []
    for entry in [e for e in text.split(",") if e]:
        name, params = parse_also(entry)
        cls = check_batched(name, 1, params)
        out.append((entry, cls.name, params))
    if "ar" not in [m[0] for m in out]:
        out.insert(0, ("ar", "ar", {}))  # the reference of every cell
    return sorted(out, key=lambda m: m[0] != "ar")


def crossover(cells: list[dict]) -> dict[str, int | None]:
    """Per method: the smallest batch size at which its tokens/s fall below batched ``ar``'s (None: never here)."""
    ar = {c["batch_size"]: c["tokens_per_s"] for c in cells if c["method"] == "ar"}
    out: dict[str, int | None] = {}
    for c in sorted(cells, key=lambda c: c["batch_size"]):
        m = c["method"]
        if m == "ar":
            continue
        out.setdefault(m, None)
        if out[m] is None and c["batch_size"] in ar and c["tokens_per_s"] < ar[c["batch_size"]]:
            out[m] = c["batch_size"]
    return out


def with_ratios(data: dict) -> dict:
    """``data`` with each cell's speed against batched ``ar`` at its batch size (``vs_ar``) and against ``ar`` at
    batch 1 (``vs_ar_at_1``; its rounds' rate against batch-1 ``ar``'s: ``decode_vs_ar_at_1``) and the share of its
    time in prefills (``prefill_share``): the table's ratios as fields, which the pages' figures point at."""
    ar = {c["batch_size"]: c["tokens_per_s"] for c in data["cells"] if c["method"] == "ar"}
    ar_decode = next((c.get("decode_tokens_per_s") for c in data["cells"] if c["method"] == "ar" and
                      c["batch_size"] == 1), None)
    cells = [{**c, "vs_ar": c["tokens_per_s"] / ar[c["batch_size"]] if ar.get(c["batch_size"]) else None,
              "vs_ar_at_1": c["tokens_per_s"] / ar[1] if ar.get(1) else None,
              "decode_vs_ar_at_1": c["decode_tokens_per_s"] / ar_decode
              if ar_decode and c.get("decode_tokens_per_s") is not None else None,
              "prefill_share": c["prefill_s"] / c["wall_s"] if c.get("prefill_s") is not None and c["wall_s"] else None}
             for c in data["cells"]]
    return {**data, "cells": cells, "crossover": crossover(data["cells"])}


def table(data: dict) -> str:
    rated = with_ratios(data)
    lines = ["| method | batch | tokens/s | vs ar at batch | vs ar at 1 | decode tokens/s (vs ar at 1) | "
             "latency mean / p50 / p95 s | tokens per forward | EM vs ar | busy |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in sorted(rated["cells"], key=lambda c: (c["method"] != "ar", c["method"], c["batch_size"])):
        lat = c["latency"]
        same = "" if c["vs_ar"] is None else f"{c['vs_ar']:.2f}x"
        one = "" if c["vs_ar_at_1"] is None else f"{c['vs_ar_at_1']:.2f}x"
        em = "" if c["exact_match"] is None else f"{c['exact_match']:.2f}"
        decode = "" if c.get("decode_tokens_per_s") is None else f"{c['decode_tokens_per_s']:.1f}" + (
            "" if c["decode_vs_ar_at_1"] is None else f" ({c['decode_vs_ar_at_1']:.2f}x)")
        lines.append(f"| {c['method']} | {c['batch_size']} | {c['tokens_per_s']:.1f} | {same} | {one} | {decode} | "
                     f"{lat['mean']:.1f} / {lat['p50']:.1f} / {lat['p95']:.1f} | {c['tokens_per_forward']:.2f} | "
                     f"{em} | {'yes' if c['busy'].get('busy') else ''} |")
    top = max((c["batch_size"] for c in rated["cells"]), default=0)
    cross = ", ".join(f"{m}: {f'never (up to {top})' if b is None else b}" for m, b in rated["crossover"].items())
    return "\n".join(lines) + (f"\n\nCrossover (first batch size below batched ar): {cross}" if cross else "")


def plot(data: dict, path: Path) -> None:
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    from pardec.models.host import describe  # heavy: torch, transformers

    cells = with_ratios(data)["cells"]
    methods = list(dict.fromkeys(c["method"] for c in cells))
    cols = min(3, len(methods))
    rows = -(-len(methods) // cols)  # one legend under both panels: it covers no line
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2 + 0.25 * rows))
    for m in methods:
        mine = sorted((c for c in cells if c["method"] == m), key=lambda c: c["batch_size"])
        xs = [c["batch_size"] for c in mine]
        left.plot(xs, [c["tokens_per_s"] for c in mine], marker="o", label=m)
        both = [(c["batch_size"], c["vs_ar"]) for c in mine if c["vs_ar"] is not None]
        right.plot([b for b, _ in both], [v for _, v in both], marker="o", label=m)
    right.axhline(1.0, color="grey", lw=0.8, ls="--")
    sizes = sorted({c["batch_size"] for c in cells})
    for ax, title in ((left, "aggregate tokens/s"), (right, "tokens/s vs batched ar at the same batch size")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_title(title, fontsize=10)
    fig.legend(*left.get_legend_handles_labels(), loc="lower center", ncol=cols, fontsize=8, frameon=False)
    ident = data["identity"]
    mode = run_mode(ident)
    fig.suptitle(f"{ident['model']} {ident['dtype']}{mode}, {ident['dataset']} (n={ident['n']}, {ident['max_new_tokens']} "
                 f"new tokens) -- {describe(ident['host'])}, {data['date']}", fontsize=8)
    fig.tight_layout(rect=(0, (0.17 * rows + 0.08) / (4.2 + 0.25 * rows), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load(out: Path, ident: dict, command: str = "") -> dict:
    """The run so far in ``out`` (or a new one, started by ``command``); refuses one started with another identity,
    naming the differences."""
    f = out / FILE
    if not f.is_file():
        return {"title": "Batched decoding: tokens/s and latency per batch size against batched ar",
                "command": command, "date": time.strftime("%Y-%m-%d"), "identity": ident, "cells": [],
                "reference": None}
    data = read_json(f, ConfigError)
    diff = settings_diff(data["identity"], ident)
    if diff:
        raise ConfigError(f"cannot continue the batch run in {out}: it was started with other settings "
                          f"({'; '.join(diff)}); pass another --out")
    return data


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default=DEFAULT_METHODS)
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "bench" / f"batch_{time.strftime('%Y-%m-%d')}")
    ap.add_argument("--publish", action="store_true",
                    help="put the run on the pages: docs/results/<name>.json, docs/img/<name>.png and the table in "
                         "docs/batch.md (between its batch-table markers for the run's dataset and dtype)")
    ap.add_argument("--name", default=None, help="the publication's name (default: batch_<date the run started>)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of the evaluate config (model=, dataset=, dtype=, "
                                                   "draft=, threads=, ...)")
    a = ap.parse_intermixed_args(argv)
    try:  # every value checked before anything loads
        sizes = parse_sizes(a.batch_sizes)
        methods = parse_methods(a.methods)
        if a.n < 1 or a.max_new_tokens < 1:
            raise ConfigError(f"--n {a.n} and --max-new-tokens {a.max_new_tokens} must be >= 1")
        spec = _spec(a, methods)

        try:  # a missing or empty dataset file: one line, before the models load
            spec.task = build_task(spec.dataset, timeout_s=spec.run.timeout_s)
            spec.docs = select_docs(spec.task, a.n)
        except DataError as e:
            raise ConfigError(str(e)) from None
        _threads(spec.run.threads)  # before the identity (it records the threads) and before the model loads
        command = " ".join(["python -m pardec.bench batch", *(argv if argv is not None else sys.argv[1:])])
        data = load(a.out, _identity(a, spec, methods), command)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return measure(a, spec, methods, sizes, data)


def _spec(a: argparse.Namespace, methods: list[tuple[str, str, dict]]):
    from pardec.decoding.batch import BATCHED  # heavy: torch, transformers
    from pardec.evaluation.batched import check_forward  # heavy: torch, transformers
    from pardec.evaluation.spec import validate  # heavy: torch, transformers

    draft = [] if any(o.startswith("draft") for o in a.overrides) or not any(
        BATCHED.get(name).needs_draft for _, name, _ in methods) else ZOO_DRAFT
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["+method=ar", f"n_samples={a.n}", f"max_new_tokens={a.max_new_tokens}",
                                             *draft, *a.overrides])
    spec = validate(cfg)
    check_forward(spec, "pardec.bench batch")

    for i, (label, name, params) in enumerate(methods):  # a drafter kept in the zoo: path=zoo:eagle3
        methods[i] = (label, name, {k: zoo.resolve(v, f"--methods entry {label!r}: method.{k}", spec.model.name)
                                    for k, v in params.items()})
    for label, name, _ in methods:
        if BATCHED.get(name).needs_draft and spec.draft is None:
            raise ConfigError(f"--methods entry {label!r} needs a draft model: pass draft=<name> "
                              f"(e.g. draft=smollm2_distilled)")
    return spec


def _threads(setting) -> None:
    import torch  # heavy: torch

    torch.set_num_threads(free_cores() if setting == "auto" else int(setting))


def _identity(a, spec, methods) -> dict[str, Any]:
    from pardec.models.host import machine  # heavy: torch, transformers

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                            text=True).stdout.strip() or None
    return {"host": machine(), "commit": commit, "model": spec.model.name, "dtype": spec.run.dtype,
            "draft": spec.draft.name if spec.draft else None, "dataset": spec.dataset.name, "n": a.n,
            "max_new_tokens": a.max_new_tokens, "methods": [[label, params] for label, _, params in methods],
            "sampling": asdict(spec.sampling),
            # the batched attention where it is not the default (invariant: exact int8 rows), so a run in one mode
            # is neither continued nor published as the other
            **({"attention": spec.model.attn_implementation} if spec.model.attn_implementation != "sdpa" else {}),
            **({"forward": spec.run.forward_impl} if spec.run.forward_impl in ("compiled", "cudagraph") else {})}


def measure(a, spec, methods, sizes, data: dict) -> int:
    from pardec.decoding import Stopper  # heavy: torch, transformers
    from pardec.decoding.batch import build_batched, run_batch  # heavy: torch, transformers
    from pardec.evaluation.batched import batch_forward  # heavy: torch, transformers
    from pardec.evaluation.results import write_json  # heavy: torch, transformers
    from pardec.models.loading import load_model  # heavy: torch, transformers

    r = spec.run
    a.out.mkdir(parents=True, exist_ok=True)
    task, docs = spec.task, spec.docs
    lm = load_model(spec.model, spec.devices[0])
    draft = load_model(spec.draft, spec.devices[1]).model if spec.draft else None
    chat = spec.dataset.use_chat(lm.chat)
    prompts = [list(task.prompt_ids(doc, lm.tokenizer, chat, [])) for doc in docs]
    stop = Stopper(lm.tokenizer, lm.eos_ids if r.stop_at_eos else set(), task.stop_strings(chat))
    done = {(c["method"], c["batch_size"]) for c in data["cells"]}
    todo = [(b, m) for b in sizes for m in methods if (m[0], b) not in done]
    for b, (label, name, params) in tqdm(todo, desc="batch cells", unit="cell"):
        dec = build_batched(name, lm.model, b, max(map(len, prompts)) + a.max_new_tokens + 64, lm.tokenizer, draft,
                            batch_forward(spec.run.forward_impl), **params)
        # warm-up: a full batch, then one row alone (a batch's tail runs single rows: a compiled forward meets each
        # kind, ragged_step's, before the clock starts)
        run_batch(dec, prompts[: min(len(prompts), b)], a.warmup_tokens, stop, spec.sampling)
        if b > 1:
            run_batch(dec, prompts[:1], a.warmup_tokens, stop, spec.sampling)
        with CpuMeter().window() as competed:
            run = run_batch(dec, prompts, a.max_new_tokens, stop, spec.sampling)
        tokens = [res.tokens for res in run.results]
        if label == "ar" and b == 1:
            data["reference"] = tokens
        ref = data["reference"]
        same = None if ref is None or not spec.sampling.greedy else sum(x == y for x, y in zip(tokens, ref)) / len(ref)
        data["cells"].append({
            "method": label, "batch_size": b, "tokens_per_s": run.tokens_per_s, "wall_s": run.wall_s,
            "prefill_s": run.prefill_s, "decode_tokens_per_s": run.decode_tokens_per_s,
            "tokens": run.tokens, "rounds": run.rounds, "latency": run.latency(),
            "tokens_per_forward": run.tokens / max(1, sum(res.target_forwards for res in run.results)),
            "exact_match": same, "busy": competed.record()})
        write_json(a.out / FILE, data)  # each cell as measured (a rename: a kill leaves the previous file whole)
    text = table(data)
    (a.out / "batch.md").write_text(text + "\n")
    plot(data, a.out / "batch.png")
    print(text)
    print(f"\nwritten to {a.out}")
    if a.publish:
        try:
            print(f"published: {publish(a.out, data, REPO_ROOT, a.name or 'batch_' + data['date'])}")
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 0


def markers(ident: dict) -> tuple[str, str]:
    """The pair of comments around a run's block in ``docs/batch.md``: one block per dataset, dtype and (where they
    are not the defaults) attention and forward."""
    key = " ".join(filter(None, (ident["dataset"], ident["dtype"], ident.get("attention"), ident.get("forward"))))
    return f"<!-- batch-table {key} -->", f"<!-- /batch-table {key} -->"


def publish(out: Path, data: dict, root: Path, name: str) -> Path:
    """The run in ``out`` onto the pages: its result file and figure under ``docs/``, and its table with the host,
    the data link and the figure between the markers of ``docs/batch.md`` (refused when the run is not finished:
    every method at every batch size of its identity)."""
    from pardec.evaluation.results import write_json  # heavy: torch, transformers
    from pardec.models.host import describe  # heavy: torch, transformers

    ident = data["identity"]
    want = len(ident["methods"]) * len({c["batch_size"] for c in data["cells"]})
    if len(data["cells"]) < want or data.get("reference") is None:
        raise ConfigError(f"the batch run in {out} is not finished ({len(data['cells'])} of {want} cells): run it to "
                          f"the end before --publish")
    docs = root / "docs"
    write_json(docs / "results" / f"{name}.json", with_ratios(data))
    shutil.copyfile(out / "batch.png", docs / "img" / f"{name}.png")
    page = docs / "batch.md"
    text = page.read_text()
    start, end = markers(ident)
    if start not in text or end not in text:
        raise ConfigError(f"{page} has no {start} ... {end} block to fill (add the pair where this run's table goes)")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    mode = run_mode(ident)
    body = (f"{ident['model']} {ident['dtype']}{mode} on {ident['dataset']}, {ident['n']} prompts, {ident['max_new_tokens']} "
            f"new tokens, {data['date']}; host: {describe(ident['host'])}.\n\n{table(data)}\n\n"
            f"<sub>Data: [results/{name}.json](results/{name}.json)</sub>\n\n"
            f"![tokens/s and speed against batched ar per batch size](img/{name}.png)\n")
    page.write_text(f"{head}{start}\n{body}{end}{tail}")
    return page
