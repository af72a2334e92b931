"""A/B of the batch-invariant attention (``model.attn_implementation=invariant``) against its version at another
commit: the cost of one cached forward of T new rows after a context, both versions in one process, interleaved
round by round (a busy or drifting host affects each alike), and whether each version's T-row forward is bitwise
its own one-row steps on this model (the property the mode exists for).

    python scripts/attention_ab.py --base acf8400 [--model smollm2_135m] [--dtype int8] [--contexts 200,400,800]
        [--rows 1,4,11,16,60] [--rounds 3] [--repeats 5] [--threads 2] [--out FILE]

The base version is ``git show <base>:src/pardec/models/forward/invariant.py``, registered as
``invariant_base``. Prints a markdown table (median ms per forward, base / this) under the host line; ``--out``
writes the result file (command, commit, host, dtype, date, n).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "src/pardec/models/forward/invariant.py"
TEXT = "The quick brown fox jumps over the lazy dog. " * 200


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=ROOT).stdout.strip()


def register_base(commit: str) -> str:
    """Load ``invariant.py`` of ``commit`` as a module of its own and register its attention as
    ``invariant_base``; returns the commit's full hash."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    full = _git("rev-parse", commit)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "invariant_base.py"
        path.write_text(_git("show", f"{full}:{SOURCE}"))
        spec = importlib.util.spec_from_file_location("invariant_base", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["invariant_base"] = mod  # (dataclasses look their module up there)
        spec.loader.exec_module(mod)  # (it registers itself as "invariant" on import: registered again below)
    AttentionInterface.register("invariant_base", mod.attention)
    AttentionMaskInterface.register("invariant_base", sdpa_mask)
    from pardec.models.forward import invariant

    invariant.register()  # this commit's version keeps the name "invariant"
    return full


@torch.inference_mode()
def bitwise(model, context: list[int], rows: int) -> bool:
    """Whether one forward of ``rows`` new rows after ``context`` gives bitwise the logits of one-row steps."""
    from pardec.models.cached import CachedModel

    together, alone = CachedModel(model), CachedModel(model)
    ids = torch.tensor([context])
    together.prefill(ids[:, :-rows])
    alone.prefill(ids[:, :-rows])
    many = together.forward(ids[:, -rows:]).logits[0]
    steps = torch.cat([alone.forward(ids[:, i : i + 1]).logits[0] for i in range(len(context) - rows, len(context))])
    return bool(torch.equal(many, steps))


def main(argv: list[str] | None = None) -> dict:
    from pardec.bench.cost import measure
    from pardec.models.host import describe, machine
    from pardec.models.loading import load_model, named_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit whose invariant attention is compared")
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--dtype", default="int8", choices=["fp32", "int8"])
    ap.add_argument("--contexts", default="200,400,800")
    ap.add_argument("--rows", default="1,4,11,16,60")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",")]
    sizes = sorted({int(x) for x in a.rows.split(",")} | {1})
    if a.rounds < 1 or a.repeats < 1 or min(contexts) < 1:
        ap.error(f"--rounds {a.rounds}, --repeats {a.repeats}, --contexts {a.contexts}: all must be >= 1")
    try:
        base = register_base(a.base)
    except subprocess.CalledProcessError as e:
        ap.error(f"--base {a.base!r}: no {SOURCE} there ({e.stderr.strip()})")
    torch.set_num_threads(a.threads)
    host = machine()
    print(describe(host), flush=True)
    lm = load_model(replace(named_config(a.model, a.dtype), device="cpu", attn_implementation="invariant"))
    tokens = lm.tokenizer(TEXT)["input_ids"]
    impls = {"base": "invariant_base", "this": "invariant"}
    cells = []
    for ctx in contexts:
        context = tokens[: ctx + max(sizes)]
        ms: dict[str, dict[int, list[float]]] = {k: {t: [] for t in sizes} for k in impls}
        for _ in range(a.rounds):
            for k, name in impls.items():
                lm.model.config._attn_implementation = name
                table = measure(lm.model, context, sizes, k, a.dtype, repeats=a.repeats, warmup=2)
                for t in sizes:
                    ms[k][t].append(table.ms[t])
        exact = {}
        for k, name in impls.items():
            lm.model.config._attn_implementation = name
            exact[k] = bitwise(lm.model, tokens[: ctx + 11], 11)
        print(f"\ncontext {ctx}: 11 rows bitwise their one-row steps: base {exact['base']}, this {exact['this']}")
        print("| rows | base ms | this ms | base / this |\n|---|---|---|---|")
        for t in sizes:
            b, n = statistics.median(ms["base"][t]), statistics.median(ms["this"][t])
            print(f"| {t} | {b:.1f} | {n:.1f} | {b / n:.2f} |", flush=True)
            cells.append({"context": ctx, "rows": t, "base_ms": b, "this_ms": n, "base_over_this": b / n,
                          "base_rounds": ms["base"][t], "this_rounds": ms["this"][t]})
        cells.append({"context": ctx, "bitwise_11_rows": exact})
    result = {"title": "Invariant attention: one cached forward of T rows, this commit against a base",
              "command": "python scripts/attention_ab.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "commit": _git("rev-parse", "HEAD"), "base": base, "dirty": bool(_git("status", "--porcelain", "src")),
              "host": host, "dtype": a.dtype, "model": a.model, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "n": a.rounds, "repeats_per_round": a.repeats, "cells": cells}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
