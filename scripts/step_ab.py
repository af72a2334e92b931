"""Per-step A/B of CachedModel's forwards (``forward_impl``): greedy `ar` decode steps of one model, the forwards
interleaved round by round in one process so that a busy or drifting host affects each alike.

    python scripts/step_ab.py [--model smollm2_135m|tiny_random] [--dtype fp32|int8] [--impls hf,lean]
        [--steps 64] [--rounds 5] [--threads 2]

Each round runs, for every forward in turn, a prefill of a GSM8K-like prompt and then ``--steps`` one-token steps
(the clock covers the steps only); after one warm-up round, it prints the ms per step of every round and the
median, the median's ratio to the first forward's, and whether every forward produced the same tokens (exactness
check: they must, in fp32). Prints the CPU model and vector flags first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pardec.config import FORWARD_IMPLS, ModelConfig
from pardec.models.cached import CachedModel
from pardec.models.host import describe, machine
from pardec.models.loading import load_model, named_config

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
          "clips did Natalia sell altogether in April and May? Explain step by step.")


@torch.inference_mode()
def steps(cm: CachedModel, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """(seconds of ``n`` greedy one-token steps after a prefill, their tokens)."""
    logits = cm.prefill(torch.tensor([prompt]))
    out = []
    t0 = time.perf_counter()
    for _ in range(n):
        tok = logits.argmax(-1)
        out.append(tok)
        logits = cm.forward(tok[:, None], last_only=True).logits[:, -1]
    seconds = time.perf_counter() - t0  # (CPU kernels are synchronous; the tokens are read after the clock)
    return seconds, [int(t) for t in out]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name, or tiny_random")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "int8"])
    ap.add_argument("--impls", default="hf,lean")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    impls = a.impls.split(",")
    bad = [i for i in impls if i not in FORWARD_IMPLS]
    if bad:
        ap.error(f"--impls {bad} not valid; choose from: {', '.join(FORWARD_IMPLS)}")
    if a.steps < 1 or a.rounds < 1:
        ap.error(f"--steps {a.steps} / --rounds {a.rounds}: both must be >= 1")
    torch.set_num_threads(a.threads)
    if a.model == "tiny_random":
        cfg = ModelConfig(name="tiny_random", source="tiny_random", dtype=a.dtype, device="cpu")
    else:
        cfg = named_config(a.model, a.dtype)
        cfg.device = "cpu"
    lm = load_model(cfg)
    prompt = lm.tokenizer(PROMPT)["input_ids"]
    models = {i: CachedModel(lm.model, forward_impl=i) for i in impls}
    print(describe(machine()), f"| {a.model} {a.dtype}, {a.steps} steps x {a.rounds} rounds", flush=True)
    for cm in models.values():  # warm-up round (allocator, kernels' first calls)
        steps(cm, prompt, min(a.steps, 8))
    ms: dict[str, list[float]] = {i: [] for i in impls}
    tokens: dict[str, list[int]] = {}
    for _ in range(a.rounds):
        for i, cm in models.items():
            s, toks = steps(cm, prompt, a.steps)
            ms[i].append(1000 * s / a.steps)
            tokens.setdefault(i, toks)
    first = statistics.median(ms[impls[0]])
    result = {"impls": {}, "same_tokens": all(t == tokens[impls[0]] for t in tokens.values())}
    for i in impls:
        med = statistics.median(ms[i])
        result["impls"][i] = {"ms_per_step": ms[i], "median": med, "speedup_vs_first": first / med}
        print(f"{i:5s} ms/step {[round(x, 1) for x in ms[i]]}  median {med:.1f}  x{first / med:.2f} vs {impls[0]}")
    print(f"same tokens on every forward: {result['same_tokens']}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["same_tokens"] else 1)
