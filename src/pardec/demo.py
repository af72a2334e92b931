"""`make demo`: the best method pardec has on the offline default — SmolLM2-135M-Instruct, fp32, the first 5
HumanEval problems, 128 new tokens — beside `ar` and transformers' own decoders (`hf`, `hf_pld`, and
`hf_assisted` when there is a draft), in one compact table.

The method is `pld` (prompt lookup): on the CPUs measured so far it is pardec's fastest decoder on SmolLM2
(the README's leaderboard). When the distilled draft exists (`python -m train +experiment=draft_smollm2`),
`sps` with it runs beside it (``bench.also``), and so does transformers' assisted generation with the same draft.

    python -m pardec.demo [--n 5] [--model smollm2_135m] [--max-new-tokens 128] [extra Hydra overrides ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir

from pardec import CONF_DIR, REPO_ROOT

ROOT = REPO_ROOT


def draft_dir(draft: str) -> Path:
    """Where the ``draft=<draft>`` config points (resolved exactly as ``python -m evaluate`` would)."""
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        return Path(compose("evaluate", overrides=[f"draft={draft}"]).draft.path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pardec.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5)
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model/<name>.yaml (tiny_random: a test of the demo)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "demo" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    ap.add_argument("extra", nargs="*", help="more Hydra overrides")
    a = ap.parse_args(argv)
    d = draft_dir("smollm2_distilled")
    method = ["+method=pld"]
    if (d / "config.json").is_file():
        method += ["draft=smollm2_distilled", 'bench.also=["sps"]']
    else:
        print(f"note: no distilled draft at {d} (train it: python -m train +experiment=draft_smollm2); "
              f"showing pld without sps", flush=True)
    cmd = [sys.executable, "-m", "evaluate", *method, f"model={a.model}", "dataset=humaneval", "dtype=fp32",
           f"n_samples={a.n}", f"max_new_tokens={a.max_new_tokens}", "bench.include_hf=true",
           "perplexity.enabled=false", f"hydra.run.dir={a.out}", *a.extra]
    print("+", " ".join(cmd), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)  # progress (stderr) stays visible
    if p.returncode:
        print(p.stdout, end="")
        sys.exit(p.returncode)
    from pardec.evaluation import format_comparison  # heavy: torch, transformers

    s = json.loads((a.out / "summary.json").read_text())
    print(f"\n{s['model']} {s['dtype']}, {s['dataset']} x {s['n_samples']}, {s['max_new_tokens']} new tokens, "
          f"greedy (full summary: {a.out / 'summary.json'})\n")
    print(format_comparison(s))


if __name__ == "__main__":
    main()
