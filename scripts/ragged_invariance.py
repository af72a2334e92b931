"""Whether a ragged batch's rows are bitwise batch-1 ``ar``'s: prompts of different lengths prefilled into one
:class:`~pardec.models.ragged.RaggedModel` and decoded greedily side by side, each step's logits compared with
batch-1 ``ar``'s one-token steps of the same prompt with the same attention (``sdpa``: one masked call over the
batch, batch 1 on the lean forward; ``invariant``: every query row an item of its own, batch 1 on transformers'
forward; ``model.attn_implementation``).

    python scripts/ragged_invariance.py [--model smollm2_135m] [--dtype int8] [--steps 12] [--out FILE]

Counts, per prompt, the positions (the prefill's last and every step's) whose logits are bitwise equal. No timing.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import torch

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many",
           "def add(a, b):\n    return",
           "The capital of France is"]


@torch.inference_mode()
def compare(model_name: str, dtype: str, steps: int) -> dict:
    from pardec.models.cached import CachedModel
    from pardec.models.loading import load_model, named_config
    from pardec.models.ragged import RaggedModel

    lm = load_model(replace(named_config(model_name, dtype), device="cpu"))
    prompts = [lm.tokenizer(t)["input_ids"] for t in PROMPTS]
    out = {}
    for attention in ("sdpa", "invariant"):
        lm.model.config._attn_implementation = attention
        ref = []
        for p in prompts:  # batch-1 ar: prefill, then one token a step
            cm = CachedModel(lm.model, forward_impl="lean" if attention == "sdpa" else "hf")
            logits = [cm.prefill(torch.tensor([p]))[0]]
            for _ in range(steps):
                logits.append(cm.forward(torch.tensor([[int(logits[-1].argmax())]])).logits[0, -1])
            ref.append(logits)
        rag = RaggedModel(lm.model, len(prompts), 256)
        got = [[rag.add(p)[0]] for p in prompts]
        for _ in range(steps):
            nxt = rag.forward(torch.tensor([[int(g[-1].argmax())] for g in got]))[:, -1]
            for b, g in enumerate(got):
                g.append(nxt[b])
        out[attention] = [sum(bool(torch.equal(r[i], g[i])) for i in range(steps + 1)) for r, g in zip(ref, got)]
    return {"positions_per_prompt": steps + 1, "prompt_tokens": [len(p) for p in prompts], "bitwise_equal": out}


def main(argv: list[str] | None = None) -> dict:
    from pardec.models.host import describe, machine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2_135m")
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    host = machine()
    print(describe(host))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    result = {"title": "A ragged batch's rows against batch-1 ar, bitwise, per batched attention",
              "command": "python scripts/ragged_invariance.py " + " ".join(argv or []), "commit": commit,
              "host": host, "dtype": a.dtype, "model": a.model, "date": time.strftime("%Y-%m-%d"),
              "n": len(PROMPTS), **compare(a.model, a.dtype, a.steps)}
    print(json.dumps(result["bitwise_equal"]))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
