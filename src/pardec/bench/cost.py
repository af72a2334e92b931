"""Measuring a forward-cost table (:class:`pardec.models.cost.CostTable`): the bench times, the library only reads.
:func:`measure` times one model; ``python -m pardec.bench cost`` (:func:`main`) measures and saves this machine's.

This machine's forward-cost table: one cached forward of T new rows, target (and draft), per dtype, at a fixed
context. It decides whether drafting can pay here (a verification forward of gamma + 1 rows against gamma + 1
single-row steps) and it is what ``CachedModel`` pads verification forwards by (``pardec.models.cost``).

    python -m pardec.bench cost [--draft outputs/train/runs/draft_smollm2/default/final] [--tokens 1,2,3,4,5,6,8,16]
        [--context 200] [--threads 2] [--dtypes fp32,int8,int8:weight_only] [--repeats 15] [--no-save]
        [--model smollm2_135m] [--forward-impl hf|lean|compiled] [--attn-implementation sdpa|eager|invariant]

A dtype ``int8`` is the default int8 recipe; ``int8:<recipe>`` names another (``pardec.models.quant.int8.parse_recipe``:
``weight_only``, ``per_channel:smooth=0.8:skip=down_proj``): the schemes cost differently by rows. ``bf16`` packs
the linears for oneDNN on CPUs with AMX-bf16 (``model.cpu_prepack``); ``bf16:unpacked`` does not. Prints a
markdown table per dtype (median ms and each T relative to T=1) under the machine's CPU model, vector flags and
thread count, and saves each table to data/forward_cost/<machine key>/<model>-<key>.json, the key being
``ModelConfig.precision()`` (the dtype, with the int8 recipe) and the forward timed when it is not transformers'
with SDPA (``pardec.models.cost.table_key``: ``-compiled``, ``-invariant``), which is what evaluation looks it up
by (its own forward's table first, else transformers' at the same precision).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from pardec.config import ATTN_IMPLEMENTATIONS, ModelConfig
from pardec.models.cached import CachedModel
from pardec.models.cost import CostTable, table_key
from pardec.models.host import describe, machine
from pardec.models.loading import load_model, named_config
from pardec.models.quant.int8 import parse_recipe


def measure(model: torch.nn.Module, context: list[int], sizes: list[int], name: str, dtype: str,
            repeats: int = 15, warmup: int = 3, forward_impl: str | None = None) -> CostTable:
    """Median time of a cached forward of T rows after ``len(context) - max(sizes)`` cached tokens, per T in
    ``sizes`` (interleaved over T, so a drift of the machine's speed spreads over all of them), through
    ``CachedModel.forward`` on ``forward_impl`` (default: CachedModel's)."""
    cm = CachedModel(model, forward_impl=forward_impl)
    top = max(sizes)
    ids = torch.tensor([context], device=cm.device)
    cm.prefill(ids[:, :-top])
    base = cm.length
    times: dict[int, list[float]] = {t: [] for t in sizes}
    cuda = cm.device.type == "cuda"
    for i in range(warmup + repeats):
        for t in sizes:
            if cuda:
                torch.cuda.synchronize(cm.device)
            t0 = time.perf_counter()
            cm.forward(ids[:, base : base + t])
            if cuda:
                torch.cuda.synchronize(cm.device)
            if i >= warmup:
                times[t].append((time.perf_counter() - t0) * 1e3)
            cm.truncate(base)
    return CostTable(name, dtype, base, {t: statistics.median(v) for t, v in times.items()}, machine(cm.device))


def _options(spec: str) -> dict:
    """``int8:<recipe>`` -> the int8 fields; ``bf16:unpacked`` -> bf16 without prepacked linears; else none."""
    dtype, _, rest = spec.partition(":")
    if not rest:
        return {}
    if dtype == "int8":
        return parse_recipe(rest)
    if dtype == "bf16" and rest == "unpacked":
        return {"cpu_prepack": False}
    raise ValueError(f"{spec!r}: only int8:<recipe> and bf16:unpacked take options")


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> dict[str, dict[str, CostTable]]:
    """The CLI; returns the measured tables per precision key, per model name."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m",
                    help="the target: a conf/model/<name>.yaml (tiny_random: a test of this command)")
    ap.add_argument("--draft", type=Path, default=Path("outputs/train/runs/draft_smollm2/default/final"))
    ap.add_argument("--tokens", default="1,2,3,4,5,6,8,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="fp32,int8")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-save", action="store_true", help="print only")
    ap.add_argument("--forward-impl", default="hf", choices=["hf", "lean", "compiled"],
                    help="CachedModel's forward to time (saved under its own key: a run with that forward uses it)")
    ap.add_argument("--attn-implementation", default="sdpa", choices=list(ATTN_IMPLEMENTATIONS),
                    help="the target's attention (saved under its own key, as --forward-impl)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    sizes = sorted({int(x) for x in a.tokens.split(",")} | {1})
    print(describe(machine()))
    measured = {}
    specs = a.dtypes.split(",")
    try:
        recipes = [_options(s) for s in specs]
    except ValueError as e:
        ap.error(f"--dtypes: {e}")
    for spec, recipe in zip(specs, recipes):
        dtype = spec.partition(":")[0]
        try:
            named = named_config(a.model, dtype)
        except FileNotFoundError as e:
            ap.error(f"--model {a.model!r}: {e}")
        cfg = replace(named, dtype=dtype, device="cpu", attn_implementation=a.attn_implementation, **recipe)
        lm = load_model(cfg)
        models = {cfg.name: lm.model}
        if (a.draft / "config.json").is_file():
            models["draft"] = load_model(ModelConfig(name="draft", source="local", path=str(a.draft), dtype=dtype,
                                                     device="cpu", **recipe)).model
        else:
            print(f"note: no draft at {a.draft}; timing the target only")
        text = "The quick brown fox jumps over the lazy dog. " * 60
        context = lm.tokenizer(text)["input_ids"][: a.context + max(sizes)]
        key = table_key(cfg.precision(), a.forward_impl, a.attn_implementation)
        tables = {name: measure(m, context, sizes, name, key, repeats=a.repeats,
                                forward_impl=a.forward_impl) for name, m in models.items()}
        print(f"\n{cfg.precision()}, context {a.context}, forward_impl={a.forward_impl}, attention {a.attn_implementation}")
        print("| T | " + " | ".join(f"{n} ms | {n} / its T=1" for n in tables) + " |")
        print("|" + "---|" * (1 + 2 * len(tables)))
        for t in sizes:
            print(f"| {t} | " + " | ".join(f"{tb.ms[t]:.1f} | {tb.relative(t):.2f}" for tb in tables.values()) + " |")
        if not a.no_save:
            for tb in tables.values():
                print(f"saved {tb.save()}")
        measured[key] = tables
    return measured

