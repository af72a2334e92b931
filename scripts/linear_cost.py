"""What SmolLM2's decoder linears cost as bare calls, per linear kind and row count: the floor under a forward
(``python -m pardec.bench cost`` times whole forwards). Random weights of the model's shapes (30 layers x q, k, v, o,
gate, up, down; no LM head), the mean of ``--reps`` calls after 3 warm-ups, ms per pass over all of them.

    python scripts/linear_cost.py [--rows 1,2,4,5,8] [--reps 30] [--threads 2] [--layers 30]

Kinds: fp32 ``F.linear``; bf16 weights and activations; int8 weight-only (``aten._weight_int8pack_mm``, the
``weight_only`` scheme of pardec.models.quant.int8) with bf16 activations and with fp32 activations; fbgemm's dynamic
int8 (``quantize_dynamic``, per-row weight scales: the ``per_channel`` scheme); fbgemm's integer GEMM with one
activation scale per token (the ``per_token`` scheme, its scaling included). Prints the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

from pardec.models.host import describe, machine

#: (out, in) of one SmolLM2-135M decoder layer's linears: q, k, v, o, gate, up, down
SHAPES = ((576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536))
KINDS = ("fp32", "bf16", "int8 weight-only, bf16 act", "int8 weight-only, fp32 act", "fbgemm dynamic int8",
         "fbgemm per-token int8")


def _time(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


@torch.inference_mode()
def measure(rows: list[int], reps: int, layers: int = 30) -> dict[str, dict[int, float]]:
    """ms per pass over ``layers`` x :data:`SHAPES` linears, per kind of :data:`KINDS` and row count."""
    from pardec.models.quant.int8 import PerTokenLinear, WeightOnlyLinear, quantize

    torch.manual_seed(0)
    lins = [torch.nn.Linear(i, o, bias=False) for _ in range(layers) for o, i in SHAPES]
    w32 = [lin.weight.detach() for lin in lins]
    w16 = [w.to(torch.bfloat16) for w in w32]
    wo = [WeightOnlyLinear.of(lin) for lin in lins]
    pt = [PerTokenLinear.of(lin) for lin in lins]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dyn = list(quantize(torch.nn.Sequential(*lins), "per_channel"))
    out: dict[str, dict[int, float]] = {k: {} for k in KINDS}
    for m in rows:
        x = {i: torch.randn(m, i) for i in (576, 1536)}
        xb = {i: v.to(torch.bfloat16) for i, v in x.items()}
        fns = {
            "fp32": lambda x=x: [F.linear(x[w.shape[1]], w) for w in w32],
            "bf16": lambda xb=xb: [F.linear(xb[w.shape[1]], w) for w in w16],
            "int8 weight-only, bf16 act": lambda xb=xb: [torch.ops.aten._weight_int8pack_mm(xb[q.in_features], q.weight,
                                                                                      q.scales) for q in wo],
            "int8 weight-only, fp32 act": lambda x=x: [torch.ops.aten._weight_int8pack_mm(x[q.in_features], q.weight,
                                                                                      q.scales.float()) for q in wo],
            "fbgemm dynamic int8": lambda x=x: [q(x[q.in_features]) for q in dyn],
            "fbgemm per-token int8": lambda x=x: [q(x[q.in_features]) for q in pt],
        }
        for kind, fn in fns.items():
            out[kind][m] = _time(fn, reps)
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,5,8")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    a = ap.parse_args(argv)
    if a.reps < 1 or a.layers < 1:
        ap.error(f"--reps {a.reps} / --layers {a.layers}: both must be >= 1")
    torch.set_num_threads(a.threads)
    rows = [int(r) for r in a.rows.split(",")]
    print(describe(machine()))
    out = measure(rows, a.reps, a.layers)
    print("| M | " + " | ".join(KINDS) + " |")
    print("|" + "---|" * (1 + len(KINDS)))
    for m in rows:
        print(f"| {m} | " + " | ".join(f"{out[k][m]:.1f}" for k in KINDS) + " |")
    return out


if __name__ == "__main__":
    main()
