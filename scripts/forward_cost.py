"""This machine's forward-cost table: one cached forward of T new rows, target (and draft), per dtype, at a fixed
context. It decides whether drafting can pay here (a verification forward of gamma + 1 rows against gamma + 1
single-row steps) and it is what ``CachedModel`` pads verification forwards by (``pardec.models.cost``).

    python scripts/forward_cost.py [--draft outputs/train/runs/draft_smollm2/default/final] [--tokens 1,2,3,4,5,6,8,16]
        [--context 200] [--threads 2] [--dtypes fp32,int8,int8:weight_only] [--repeats 15] [--no-save]
        [--forward-impl hf|lean|compiled] [--attn-implementation sdpa|eager|invariant]

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
from pathlib import Path

import torch

from pardec.bench.cost import measure
from pardec.config import ATTN_IMPLEMENTATIONS, ModelConfig
from pardec.models.cost import table_key
from pardec.models.host import describe, machine
from pardec.models.loading import SMOLLM2, load_model
from pardec.models.quant.int8 import parse_recipe


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    sizes = sorted({int(x) for x in a.tokens.split(",")} | {1})
    print(describe(machine()))
    specs = a.dtypes.split(",")
    try:
        recipes = [_options(s) for s in specs]
    except ValueError as e:
        ap.error(f"--dtypes: {e}")
    for spec, recipe in zip(specs, recipes):
        dtype = spec.partition(":")[0]
        cfg = ModelConfig(name=SMOLLM2.name, source=SMOLLM2.source, path=SMOLLM2.path, gguf_file=SMOLLM2.gguf_file,
                          dtype=dtype, device="cpu", attn_implementation=a.attn_implementation, **recipe)
        lm = load_model(cfg)
        models = {SMOLLM2.name: lm.model}
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


if __name__ == "__main__":
    main()
