"""Host reads per forward of every decoding method, counted on a virtual GPU (no GPU needed).

Each method generates from the same prompts with the model and its drafter placed on a virtual CUDA device
(:class:`pardec.testing.VirtualCUDA`): every value the host reads back from the device (``tolist``, ``item``,
``int()``, blocking copies to the CPU, ``nonzero``, boolean-mask indexing) is counted, and with ``--trace`` named by
the pardec source line that made it. On a real GPU each such read waits for the device's queue to drain: it is what
``python -m pardec.bench gpu-smoke`` counts on CUDA with ``torch.cuda.set_sync_debug_mode``. The timing syncs and the waits on
the finiteness flags' events are not counted (the latter follow a read that has already waited).

    python scripts/host_reads.py [--methods ar,sps,...] [--new-tokens 32] [--sampled] [--trace] [--out FILE]

The model is ``tiny_random`` (3 layers) with gpu_smoke's untrained drafters (the target's first and last layers as
the draft model, untrained Medusa heads / FIRP projections): the counts per forward depend on the method's code
path, not on the weights, except through how many tokens are accepted.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
NOT_READS = ("cuda.Event.synchronize", "cuda.synchronize")


def count(methods: list[str], new_tokens: int, sampled: bool, trace: bool) -> list[dict]:
    import torch

    from pardec.config import ModelConfig, SamplingConfig
    from pardec.decoding import METHODS, Stopper, build_decoder
    from pardec.models.cached import CachedModel
    from pardec.models.loading import load_model
    from pardec.testing import VirtualCUDA, untrained_drafters

    torch.manual_seed(0)
    lm = load_model(ModelConfig(name="tiny_random", source="tiny_random", layers=3, dtype="fp32", device="cpu"))
    draft, params = untrained_drafters(lm.model, Path(tempfile.mkdtemp(prefix="pardec-reads-")))
    ids = lm.tokenizer(PROMPT)["input_ids"]
    s = SamplingConfig(temperature=0.8, top_k=20, top_p=0.95, seed=1) if sampled else SamplingConfig()
    rows = []
    for name in methods:
        cls = METHODS.get(name)
        with VirtualCUDA(trace=trace) as vc:
            vc.place(lm.model)
            vc.place(draft)
            dec = build_decoder(name, CachedModel(lm.model), lm.tokenizer,
                                CachedModel(draft, "draft") if cls.needs_draft else None, **params.get(name, {}))
            res = dec.generate(ids, new_tokens, Stopper(lm.tokenizer), s)
        reads = sum(n for k, n in vc.syncs.items() if k not in NOT_READS)
        forwards = res.target_forwards + res.draft_forwards
        row = {"method": name, "sampled": sampled, "tokens": len(res.tokens), "target_forwards": res.target_forwards,
               "draft_forwards": res.draft_forwards, "reads": reads,
               "reads_per_target_forward": reads / max(res.target_forwards, 1),
               "reads_per_forward": reads / max(forwards, 1)}
        if trace:
            row["sites"] = [{"call": c, "where": w, "n": n} for (c, w), n in vc.sync_sites.most_common(8)]
        rows.append(row)
        print(f"  {name:15s} reads {reads:4d}  per target forward {row['reads_per_target_forward']:.2f}  "
              f"per forward of either model {row['reads_per_forward']:.2f}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    out = ["| method | decoding | tokens | target forwards | draft forwards | host reads | per target forward | "
           "per forward (either model) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {'sampled' if r['sampled'] else 'greedy'} | {r['tokens']} | "
                   f"{r['target_forwards']} | {r['draft_forwards']} | {r['reads']} | "
                   f"{r['reads_per_target_forward']:.2f} | {r['reads_per_forward']:.2f} |")
        for site in r.get("sites", []):
            out.append(f"|  | `{site['where']}` {site['call']} | | | | {site['n']} | | |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from pardec.decoding import METHODS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", default=None, help="comma-separated (default: every method but hf ones)")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--sampled", action="store_true", help="temperature 0.8, top-k 20, top-p 0.95 (default: greedy)")
    p.add_argument("--trace", action="store_true", help="name the source lines of the reads")
    p.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = p.parse_args(argv)
    names = a.methods.split(",") if a.methods else [n for n in METHODS.names() if not n.startswith("hf")]
    bad = [n for n in names if n not in METHODS.names()]
    if bad:
        p.error(f"--methods {bad} not valid; choose from: {', '.join(METHODS.names())}")
    rows = count(names, a.new_tokens, a.sampled, a.trace)
    print(table(rows))
    if a.out:
        a.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
