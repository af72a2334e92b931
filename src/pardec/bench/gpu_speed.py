"""Per-step cost of pardec's decoding loop on a GPU at the sizes researchers run, without their weights: a random
Llama of a named shape (initialised on the device, in bf16 by default) with SmolLM2's tokenizer.

    python -m pardec.bench gpu-speed [--shapes 7b,1b,smollm2] [--dtype bf16] [--tf32 on] [--new-tokens 128] [--context 512]
                                [--sizes 1,2,4,8,16,32,64] [--impls hf,lean,compiled,cudagraph]
                                [--cost-impls hf,cudagraph] [--methods ar,pld,jacobi,lookahead] [--out DIR]

Per shape it reports
1. the forward-cost table (``pardec.models.cost.measure``: one cached forward of T new rows after ``--context``
   tokens, median ms and each T relative to T=1): what a verification forward of gamma + 1 rows costs against one
   decode step, the quantity that decides whether drafting can pay on this GPU;
2. greedy decoding of ``--new-tokens`` tokens (no EOS: every run makes the same number) by transformers'
   ``generate()`` (the ``hf_generate`` method) and by pardec's ``ar`` on each ``forward_impl``: decode-only
   tokens/s, ms per token against table 1's one-row forward (``CachedModel`` on transformers' forward,
   ``forward_impl=hf``: what the loop adds, or saves with another forward), host syncs per
   step (``torch.cuda.set_sync_debug_mode``, counted in a separate untimed run), and whether the tokens equal
   ``generate()``'s.

Table 1 is measured on each of ``--cost-impls`` (``cudagraph``: the one-row step and the multi-row forwards padded
to a power of two rows, each a replayed CUDA graph). ``--methods`` adds draft-free drafting methods (``pld``,
``jacobi``, ``lookahead``) to table 2, each on every ``--impls`` forward, with their tokens per target forward:
random weights make acceptance rates meaningless (a random model's greedy text repeats itself, which prompt lookup
feeds on), so those rows measure the loop's cost per forward and its host syncs, never a speed-up to expect from a
trained model. Writes ``<out>/gpu_speed.json`` and ``<out>/gpu_speed.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch

from pardec import REPO_ROOT
from pardec.config import ModelConfig
from pardec.testing import count_cuda_syncs

ROOT = REPO_ROOT
#: (hidden, layers, heads, kv heads, intermediate): a tiny one (the script's own test, on the CPU), SmolLM2-135M,
#: TinyLlama-1.1B and Llama-2-7B's shapes
SHAPES = {"tiny": (64, 2, 4, 2, 128), "smollm2": (576, 30, 9, 3, 1536), "1b": (2048, 22, 32, 4, 5632), "7b": (4096, 32, 32, 32, 11008)}
#: the methods this script times: those that need no draft model, heads or trained tokens
DRAFT_FREE = ("ar", "pld", "jacobi", "lookahead")
PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have? Think step by step.\nAnswer:"


def random_llama(shape: str, vocab: int, dtype: torch.dtype, device: str):
    """A random Llama of one of :data:`SHAPES`, built in ``dtype`` on ``device``. Not
    :func:`pardec.models.loading.tiny_random_model`: that one fixes intermediate = 2 x hidden, kv heads = heads / 2
    and untied embeddings, which are not Llama-2-7B's, TinyLlama's or SmolLM2's shapes (it would need those three as
    parameters, and to build in a dtype on a device, to serve both)."""
    from transformers import LlamaConfig, LlamaForCausalLM  # heavy: transformers

    hidden, layers, heads, kv, inter = SHAPES[shape]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=shape == "smollm2", attn_implementation="sdpa")
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in its dtype on the device: a 7B model never exists in fp32
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def run_shape(shape: str, a, tok) -> dict:
    from pardec.bench.cost import measure  # heavy: transformers
    from pardec.decoding import Stopper, build_decoder  # heavy: transformers
    from pardec.decoding.base import sync  # heavy: transformers
    from pardec.models.cached import CachedModel  # heavy: transformers

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    model = random_llama(shape, len(tok), dtype, a.device)
    params = sum(p.numel() for p in model.parameters())
    out: dict = {"shape": shape, "params": params, "dtype": a.dtype}
    g = torch.Generator().manual_seed(1)
    context = torch.randint(0, len(tok), (a.context,), generator=g).tolist()
    sizes = [int(s) for s in a.sizes.split(",")]
    out["cost_ms_by_impl"] = {}
    for impl in a.cost_impls.split(","):
        try:
            out["cost_ms_by_impl"][impl] = measure(model, context, sizes, shape, a.dtype, repeats=a.repeats,
                                                   forward_impl=impl).ms
        except Exception as e:  # noqa: BLE001  (report every failure and go on)
            out["cost_ms_by_impl"][impl] = {"problem": f"{type(e).__name__}: {str(e)[:300]}"}
        print(f"  {shape} cost {impl}: {out['cost_ms_by_impl'][impl]}", flush=True)
    hf_table = out["cost_ms_by_impl"].get("hf")
    if hf_table is None or "problem" in hf_table:
        hf_table = measure(model, context, sizes, shape, a.dtype, repeats=a.repeats, forward_impl="hf").ms
    out["cost_ms"] = hf_table  # (transformers' forward: the reference of table 2's overhead column)
    one_row = hf_table[min(sizes)]
    prompt = tok(PROMPT)["input_ids"]
    stop = Stopper()  # no EOS: every run makes --new-tokens tokens
    runs = []
    ref = None
    methods = ["ar"] + [m for m in a.methods.split(",") if m and m != "ar"]
    for name, impl in [("hf_generate", "hf")] + [(m, i) for m in methods for i in a.impls.split(",")]:
        row = {"method": name, "forward_impl": impl}
        try:
            dec = build_decoder(name, CachedModel(model, forward_impl=impl), tok, None)
            dec.generate(prompt, 8, stop)  # warm-up (kernels, allocator, compilation)
            sync(torch.device(a.device))
            t0 = time.perf_counter()
            r = dec.generate(prompt, a.new_tokens, stop)
            sync(torch.device(a.device))
            wall = time.perf_counter() - t0
            decode_s = max(r.total_s - r.prefill_s, 1e-9)
            ref = r.tokens if ref is None else ref
            row.update(ok=True, tokens=len(r.tokens), wall_s=wall, decode_tok_s=(len(r.tokens) - 1) / decode_s,
                       tokens_per_forward=r.tokens_per_forward, target_forwards=r.target_forwards,
                       ms_per_token=1e3 * decode_s / max(len(r.tokens) - 1, 1), same_as_generate=r.tokens == ref,
                       graphed_forwards=dec.target.graphed_forwards)
            sites = Counter()
            row["syncs"] = count_cuda_syncs(partial(dec.generate, prompt, 32, stop), a.device, sites)[1]
            row["sync_sites"] = sites.most_common(6)  # (the Python lines that made them, most first)
            row["syncs_per_token"] = None if row["syncs"] is None else row["syncs"] / 32
            row["ms_per_forward"] = 1e3 * decode_s / max(r.target_forwards - 1, 1)  # (the prefill's forward out)
            row["overhead_vs_forward"] = row["ms_per_token"] / one_row
        except Exception as e:  # noqa: BLE001  (report every failure and go on)
            row.update(ok=False, problem=f"{type(e).__name__}: {str(e)[:300]}")
        runs.append(row)
        print(f"  {shape} {name} {impl}: {row}", flush=True)
    out["decoding"] = runs
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out


def _num(v: float | None) -> str:
    return "" if v is None else f"{v:.2f}"


def tables(res: dict) -> str:
    tf32 = f" (TF32 {res['tf32']})" if res["dtype"] == "fp32" and "tf32" in res else ""
    lines = [f"GPU speed: {res['device']}, torch {res['torch']}, {res['dtype']}{tf32}, random weights, context "
             f"{res['context']}, {res['new_tokens']} new tokens ({res['date']})", ""]
    for s in res["shapes"]:
        ms = s["cost_ms"]
        lines += [f"**{s['shape']}** ({s['params'] / 1e9:.2f} B parameters): forward of T new rows (ms, and × T=1 "
                  f"on the same forward)", "", "| forward | " + " | ".join(f"T={t}" for t in ms) + " |",
                  "|---" * (len(ms) + 1) + "|"]
        for impl, table in s.get("cost_ms_by_impl", {"hf": ms}).items():
            if "problem" in table:
                lines.append(f"| {impl} | {table['problem']} |")
                continue
            base = table[min(table, key=int)]
            lines.append(f"| {impl} | " + " | ".join(f"{v:.2f} ({v / base:.2f}×)" for v in table.values()) + " |")
        lines += ["", "| method | forward | decode tok/s | ms/token | tokens/forward | ms/forward | × table's hf T=1 "
                  "| host syncs/token | same tokens as generate() | status |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in s["decoding"]:
            if r["ok"]:
                lines.append(f"| {r['method']} | {r['forward_impl']} | {r['decode_tok_s']:.1f} | {r['ms_per_token']:.2f} "
                             f"| {r['tokens_per_forward']:.2f} | {r['ms_per_forward']:.2f} "
                             f"| {r['overhead_vs_forward']:.2f} | {_num(r['syncs_per_token'])} | {r['same_as_generate']} "
                             f"| ok |")
            else:
                lines.append(f"| {r['method']} | {r['forward_impl']} | | | | | | | | {r['problem']} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b,1b,smollm2", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    ap.add_argument("--tf32", default="on", choices=["on", "off"],
                    help="fp32 matmuls in TF32 on Ampere+ GPUs (pardec's `tf32` key; no effect in bf16/fp16)")
    ap.add_argument("--device", default="cuda", help="cuda (what it is for) or cpu (a test of the script itself)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--impls", default="hf,lean,compiled,cudagraph", help="forward_impls to run the methods on")
    ap.add_argument("--cost-impls", default="hf,cudagraph", help="forward_impls to measure table 1 on")
    ap.add_argument("--methods", default="ar", help="`ar` and draft-free drafting methods: pld, jacobi, lookahead")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_speed" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    a = ap.parse_args(argv)
    bad = [s for s in a.shapes.split(",") if s not in SHAPES]
    if bad:
        ap.error(f"--shapes {bad} not valid; choose from: {', '.join(SHAPES)}")
    bad = [m for m in a.methods.split(",") if m not in DRAFT_FREE]
    if bad:
        ap.error(f"--methods {bad} not valid; choose from: {', '.join(DRAFT_FREE)} (methods that need no drafter)")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {a.device!r}: no CUDA device is available here; --device cpu runs it as a test")
    from pardec.models.loading import load_tokenizer  # heavy: transformers
    from pardec.models.placement import set_tf32  # heavy: transformers

    set_tf32(a.tf32 == "on")
    tok = load_tokenizer(ModelConfig(name="tiny_random", source="tiny_random"))
    res = {"device": torch.cuda.get_device_name(0) if a.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "dtype": a.dtype, "tf32": a.tf32,
           "context": a.context, "new_tokens": a.new_tokens, "date": time.strftime("%Y-%m-%d"), "shapes": []}
    a.out.mkdir(parents=True, exist_ok=True)
    for shape in a.shapes.split(","):
        res["shapes"].append(run_shape(shape, a, tok))
        (a.out / "gpu_speed.json").write_text(json.dumps(res, indent=2) + "\n")  # after each shape: a kill keeps it
        (a.out / "gpu_speed.md").write_text(tables(res) + "\n")
    print("\n" + tables(res))
    return 0

