"""`make bench`: SmolLM2-135M-Instruct on the first N HumanEval problems, fp32 and bf16: ar, hf_generate,
jacobi and pld, run as one Hydra multirun (each job: baseline ar + HF generate + the method, interleaved per
prompt), then aggregated by ``pardec.report`` and summarised as the README's table.

    python scripts/bench.py [--n 20] [--max-new-tokens 256] [--dtypes fp32,bf16] [--methods jacobi,pld]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--methods", default="jacobi,pld")
    ap.add_argument("--dataset", default="humaneval")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "bench" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    ap.add_argument("extra", nargs="*", help="more Hydra overrides, e.g. method.block_size=8")
    a = ap.parse_args()
    runs = a.out / "runs"
    cmd = [sys.executable, "-m", "evaluate", "-m", f"+method={a.methods}", f"dtype={a.dtypes}",
           f"dataset={a.dataset}", "model=smollm2_135m", f"n_samples={a.n}", f"max_new_tokens={a.max_new_tokens}",
           f"threads={a.threads}", "bench.include_hf=true", "perplexity.enabled=false", f"hydra.sweep.dir={runs}",
           *a.extra]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    subprocess.run([sys.executable, "-m", "pardec.report", str(runs), "--out", str(a.out / "report")], check=True)
    table = bench_table([json.loads(p.read_text()) for p in sorted(runs.glob("*/summary.json"))])
    (a.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"\nwritten to {a.out}")


def bench_table(summaries: list[dict]) -> str:
    """One row per (dtype, method); ar and hf_generate rows pool the baseline columns of every job."""
    rows = ["| dtype | method | tokens/s | speedup vs ar | tokens / target forward | exact match vs ar |",
            "|---|---|---|---|---|---|"]
    for dtype in sorted({s["dtype"] for s in summaries}, key=["fp32", "bf16", "fp16"].index):
        group = [s for s in summaries if s["dtype"] == dtype]
        ar = statistics.fmean(s["baseline_tokens_per_s"] for s in group)
        hf = [s["hf_tokens_per_s"] for s in group if s.get("hf_tokens_per_s")]
        hf_eq = [s.get("hf_exact_match_rate") for s in group if s.get("hf_exact_match_rate") is not None]
        rows.append(f"| {dtype} | ar | {ar:.1f} | 1.00 | 1.00 | – |")
        if hf:
            h = statistics.fmean(hf)
            eq = f"{statistics.fmean(hf_eq):.2f}" if hf_eq else "–"
            rows.append(f"| {dtype} | hf_generate | {h:.1f} | {h / ar:.2f} | 1.00 | {eq} |")
        for s in sorted(group, key=lambda s: s["method"]):
            if s["method"] in ("ar", "hf_generate"):
                continue
            em = "–" if s["exact_match_rate"] is None else f"{s['exact_match_rate']:.2f}"
            rows.append(f"| {dtype} | {s['method']} | {s['tokens_per_s']:.1f} | {s['speedup']:.2f} "
                        f"(median {s['speedup_median']:.2f}) | {s['tokens_per_forward']:.2f} | {em} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
