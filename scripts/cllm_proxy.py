"""Both CLLM fast-forward proxies of a trained model, after the fact, on the records its training held out.

    python scripts/cllm_proxy.py --model <run>/final --collection data/trajectories/<collection> [--held-out 16]

The training run holds out the collection's last ``trainer.proxy_records`` records (16 in the GSM8K recipe) and logs
the proxies at every evaluation (:mod:`pardec.training.cllm.trainer`); runs from before the decoded proxy existed
logged only the teacher-forced one. This prints, as JSON: ``ff_proxy`` / ``ff_proxy_init`` (teacher-forced, every
collected state) and ``ff_decode`` (the held-out prompts decoded by ``jacobi`` from random guesses, the benchmark's
fast-forward), block size and token budget read from the collection.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from pardec.config import ModelConfig
from pardec.models.loading import load_model
from pardec.training.cllm.data import CLLMCollator, TrajectoryDataset
from pardec.training.cllm.trainer import DecodingProxy, fast_forward_proxy
from pardec.training.cllm.trajectories import load_trajectories


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="a trained model dir (<run>/final) or the base: smollm2")
    ap.add_argument("--collection", required=True, help="the trajectory collection the run trained on")
    ap.add_argument("--held-out", type=int, default=16, help="the collection's last records held out (proxy_records)")
    ap.add_argument("--max-length", type=int, default=512, help="packed sample length (trainer.max_length)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    records = load_trajectories(Path(a.collection))
    if not 0 < a.held_out < len(records):
        sys.exit(f"error: --held-out={a.held_out} must be in [1, {len(records) - 1}] ({a.collection} holds "
                 f"{len(records)} records)")
    meta = json.loads((Path(a.collection) / "meta.json").read_text())
    held = records[len(records) - a.held_out :]
    cfg = ModelConfig() if a.model == "smollm2" else ModelConfig(name="cllm", source="local", path=a.model)
    lm = load_model(cfg)
    t0 = time.perf_counter()
    out = fast_forward_proxy(lm.model, TrajectoryDataset(held, "global", "all", a.max_length),
                             CLLMCollator(lm.tokenizer.pad_token_id))
    t1 = time.perf_counter()
    out.update(DecodingProxy([r["prompt_ids"] for r in held], meta["block_size"], meta["max_new_tokens"],
                             lm.eos_ids)(lm.model))
    out.update({"model": a.model, "collection": a.collection, "held_out": a.held_out,
                "teacher_forced_s": round(t1 - t0, 1), "decode_s": round(time.perf_counter() - t1, 1)})
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
