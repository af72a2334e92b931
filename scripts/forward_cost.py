"""Cost of one cached forward of T new tokens, target and draft, at a fixed context: what decides whether
drafting pays off on a machine (a verification forward of gamma + 1 tokens against gamma + 1 single-token steps).

    python scripts/forward_cost.py [--draft outputs/train/runs/draft_smollm2/default/final] [--tokens 1,2,3,5,8,16]
        [--context 200] [--threads 2] [--dtype fp32] [--repeats 15]

Prints a markdown table: T, median ms of the target, of the draft, and each relative to its own 1-token forward.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from pardec.config import ModelConfig
from pardec.models.loading import load_model
from pardec.training.draft.trainer import forward_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=Path("outputs/train/runs/draft_smollm2/default/final"))
    ap.add_argument("--tokens", default="1,2,3,4,5,8,16")
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(ModelConfig(dtype=a.dtype))
    models = {"target": lm.model}
    if (a.draft / "config.json").is_file():
        models["draft"] = load_model(ModelConfig(name="draft", source="local", path=str(a.draft), dtype=a.dtype)).model
    else:
        print(f"note: no draft at {a.draft}; timing the target only")
    text = "The quick brown fox jumps over the lazy dog. " * 60
    context = lm.tokenizer(text)["input_ids"][: a.context]
    sizes = [int(x) for x in a.tokens.split(",")]
    # the cache holds the whole context, then T more tokens are run
    ms = {name: {t: forward_ms(m, context + context[:t], a.repeats, tokens=t) for t in sizes}
          for name, m in models.items()}
    print(f"{platform.processor() or platform.machine()}, threads={a.threads}, {a.dtype}, context {len(context)}")
    head = "| T | " + " | ".join(f"{n} ms | {n} / its T=1" for n in ms) + " |"
    print(head)
    print("|" + "---|" * (1 + 2 * len(ms)))
    for t in sizes:
        print(f"| {t} | " + " | ".join(f"{ms[n][t]:.1f} | {ms[n][t] / ms[n][1]:.2f}" for n in ms) + " |")


if __name__ == "__main__":
    main()
