"""`make gpu-smoke` (``python -m pardec.bench gpu-smoke``): does pardec run on this machine's GPU? Offline, in minutes, with the local SmolLM2 and drafters
made on the spot (untrained: this checks that everything runs and stays exact, not speed-ups):

1. every decoding method in fp32 and bf16, on transformers' forward, on pardec's lean one and on the compiled
   one-token step (``forward_impl``):
   exact-match rate against `ar` in the same dtype on transformers' forward (tokens-exact methods must reach 1.0
   in fp32; bf16 flips near-ties), tokens per target forward, and wall time against `ar` on the same forward (and
   lean `ar` against hf `ar`: the lean forward's own gain, which on a GPU is kernel launches saved);
2. two optimizer steps of every experiment kind (the `*_tiny` experiments with `trainer.max_steps=2`, placed
   on the GPU);
3. a 2-process sharded `evaluate` (torchrun) when the machine has two GPUs or more.

    python -m pardec.bench gpu-smoke [--device cuda|cpu] [--model smollm2_135m|tiny_random] [--new-tokens 32]
                                [--methods ar,sps,...] [--forward-impls hf,lean,compiled,cudagraph] [--dtypes fp32,bf16]
                                [--kinds cllm,draft,...] [--out DIR]

It writes ``<out>/gpu_smoke.json`` and prints one markdown table per part. On a machine without CUDA it runs with
``--device cpu`` (CI runs it so, on the tiny random model, as a test of the script itself).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

import torch

from pardec import REPO_ROOT
from pardec.config import FORWARD_IMPLS, ModelConfig
from pardec.testing import count_cuda_syncs, untrained_drafters

ROOT = REPO_ROOT
PROMPTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:",
           "The quick brown fox jumps over the lazy dog. The quick brown fox"]
KINDS = {"cllm": "cllm_tiny", "draft": "draft_tiny", "heads_medusa": "heads_medusa_tiny",
         "heads_firp": "heads_firp_tiny", "sdsat": "sdsat_tiny"}


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()} (CUDA {torch.version.cuda})"
    model = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                  if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return f"CPU {model} ({os.cpu_count()} cores)"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decoding(a, out: dict) -> list[dict]:
    from pardec.decoding import METHODS, Stopper, build_decoder  # heavy: transformers
    from pardec.decoding.base import lossless_under_greedy  # heavy: transformers
    from pardec.models.cached import CachedModel  # heavy: transformers
    from pardec.models.loading import TORCH_DTYPES, load_model, named_config  # heavy: transformers
    from pardec.models.placement import set_tf32  # heavy: transformers

    set_tf32(True)
    names = a.methods.split(",") if a.methods else METHODS.names()
    rows = []
    work = Path(tempfile.mkdtemp(prefix="pardec-smoke-"))
    for dtype in a.dtypes.split(","):
        cfg = (ModelConfig(name="tiny_random", source="tiny_random", layers=3, dtype=dtype,
                           device=a.device) if a.model == "tiny_random" else named_config(a.model, dtype))
        if a.model != "tiny_random":
            cfg.device = a.device
        lm = load_model(cfg)
        tok, model = lm.tokenizer, lm.model
        draft_model, params = untrained_drafters(model, work / dtype)
        draft_model = draft_model.to(model.device, TORCH_DTYPES[dtype])
        prompts = [tok(p)["input_ids"] for p in PROMPTS]
        stop = Stopper(tok)
        ref: dict[int, list[int]] = {}  # the first forward_impl's `ar` (hf by default): every row's reference
        ar_hf = None
        for impl, name in [(i, n) for i in a.forward_impls.split(",") for n in ["ar"] + [n for n in names if n != "ar"]]:
            if name == "ar":
                ar_s = None  # speed is against `ar` on the same forward
            cls = METHODS.get(name)
            row = {"method": name, "dtype": dtype, "forward_impl": impl, "exactness": cls.exactness}
            try:
                dec = build_decoder(name, CachedModel(model, forward_impl=impl), tok,
                                    CachedModel(draft_model, "draft", forward_impl=impl) if cls.needs_draft else None,
                                    **params.get(name, {}))
                dec.generate(prompts[0], 4, stop)  # warm-up (kernels, allocator)
                tokens = forwards = same = 0
                sync(a.device)
                t0 = time.perf_counter()
                results = [dec.generate(p, a.new_tokens, stop) for p in prompts]
                sync(a.device)
                seconds = time.perf_counter() - t0
                for i, r in enumerate(results):
                    if name == "ar" and i not in ref:
                        ref[i] = r.tokens
                    same += r.tokens == ref[i]
                    tokens += len(r.tokens)
                    forwards += r.target_forwards
                # host syncs per target forward, in a separate untimed run of the first prompt (real CUDA only)
                if a.device.startswith("cuda"):
                    sites = Counter()
                    r, syncs = count_cuda_syncs(partial(dec.generate, prompts[0], a.new_tokens, stop), a.device,
                                                sites)
                    row["syncs_per_forward"] = syncs / max(r.target_forwards, 1)
                    row["sync_sites"] = sites.most_common(8)  # (the Python lines that made them, most first)
                ar_s = seconds if name == "ar" else ar_s
                ar_hf = seconds if name == "ar" and impl == "hf" else ar_hf
                row.update(ok=True, exact_match=same / len(prompts), tokens_per_forward=tokens / max(forwards, 1),
                           seconds=seconds, speed_vs_ar=ar_s / seconds if ar_s else None,
                           # lean `ar` against `ar` on transformers' forward (the lean forward's own gain)
                           **({"speed_vs_hf_ar": ar_hf / seconds} if name == "ar" and impl != "hf" and ar_hf else {}))
                if dtype == "fp32" and lossless_under_greedy(cls) and same < len(prompts):
                    row["problem"] = "a tokens-exact method differs from ar in fp32"
            except Exception as e:  # noqa: BLE001  (a smoke test reports every failure and goes on)
                row.update(ok=False, problem=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            # (the figures too: a run cut by its time limit keeps them in its log)
            figures = " ".join(f"{k}={row[k]:.2f}" for k in ("exact_match", "tokens_per_forward", "speed_vs_ar",
                                                              "syncs_per_forward") if row.get(k) is not None)
            print(f"  {dtype} {impl:4s} {name:15s} {'ok' if row['ok'] and 'problem' not in row else 'FAILED'} "
                  f"{figures} {row.get('problem', '')}", flush=True)
            if row.get("sync_sites"):
                print("      syncs at " + ", ".join(f"{site} x{n}" for site, n in row["sync_sites"]), flush=True)
        del model, draft_model
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    out["decoding"] = rows
    return rows


def training(a, out: dict) -> list[dict]:
    rows = []
    # pardec's src first, then whatever the caller's PYTHONPATH holds (a machine with packages beside the venv)
    path = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    for kind in (a.kinds.split(",") if a.kinds else list(KINDS)):
        exp = KINDS[kind]
        work = Path(tempfile.mkdtemp(prefix=f"pardec-smoke-{kind}-"))
        cmd = [sys.executable, "-m", "train", f"+experiment={exp}", f"paths.data_dir={work}/data",
               f"paths.output_dir={work}/out", "run_name=smoke", "trainer.max_steps=2",
               f"trainer.use_cpu={str(a.device == 'cpu').lower()}", f"model.device={a.device}"]
        t0 = time.perf_counter()
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        row = {"kind": kind, "experiment": exp, "ok": p.returncode == 0, "seconds": time.perf_counter() - t0}
        if p.returncode:
            row["problem"] = p.stderr.strip().splitlines()[-1][:300] if p.stderr.strip() else f"exit {p.returncode}"
        else:
            summary = json.loads((work / "out" / "train" / "runs" / exp / "smoke" / "train_summary.json").read_text())
            steps = (summary.get("train") or {}).get("steps")
            row.update(steps=steps, dtype=summary.get("dtype", ""))
            if steps != 2:
                row["problem"] = f"trained {steps} steps, expected 2"
        rows.append(row)
        print(f"  train {kind:13s} {'ok' if row['ok'] and 'problem' not in row else 'FAILED'} "
              f"{row.get('problem', '')}", flush=True)
    out["training"] = rows
    return rows


def sharded(a, out: dict) -> dict:
    if not a.device.startswith("cuda") or torch.cuda.device_count() < 2:
        out["sharded_evaluate"] = {"skipped": "needs 2 CUDA devices"}
        return out["sharded_evaluate"]
    run_dir = Path(tempfile.mkdtemp(prefix="pardec-smoke-sharded-"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "evaluate",
           "+method=pld", f"model={a.model}", "n_samples=8", "max_new_tokens=32", "perplexity.enabled=false",
           f"hydra.run.dir={run_dir}"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    res = {"ok": p.returncode == 0, "seconds": time.perf_counter() - t0, "command": " ".join(cmd[1:])}
    if p.returncode:
        res["problem"] = p.stderr[-1000:]
    else:
        res["records"] = sum(1 for _ in open(run_dir / "results.jsonl"))
    out["sharded_evaluate"] = res
    return res


def tables(out: dict) -> str:
    lines = [f"GPU smoke test: {out['device']}, torch {out['torch']}, model {out['model']}, "
             f"{out['new_tokens']} new tokens x {len(PROMPTS)} prompts, greedy ({out['date']})", "",
             "| method | dtype | forward | exactness | exact match vs ar | tokens/forward | speed vs ar | host syncs/forward "
             "| status |", "|---|---|---|---|---|---|---|---|---|"]
    for r in out["decoding"]:
        impl = r.get("forward_impl", "hf")
        if r["ok"]:
            vs_hf = f" ({r['speed_vs_hf_ar']:.2f}x `ar` on hf)" if "speed_vs_hf_ar" in r else ""
            syncs = f"{r['syncs_per_forward']:.2f}" if "syncs_per_forward" in r else ""
            lines.append(f"| {r['method']} | {r['dtype']} | {impl} | {r['exactness']} | {r['exact_match']:.2f} | "
                         f"{r['tokens_per_forward']:.2f} | {r['speed_vs_ar']:.2f}x{vs_hf} | {syncs} | {r.get('problem', 'ok')} |")
        else:
            lines.append(f"| {r['method']} | {r['dtype']} | {impl} | {r['exactness']} | | | | | {r['problem']} |")
    lines += ["", "| kind | experiment | dtype | steps | seconds | status |", "|---|---|---|---|---|---|"]
    for r in out.get("training", []):
        lines.append(f"| {r['kind']} | {r['experiment']} | {r.get('dtype', '')} | {r.get('steps', '')} | "
                     f"{r['seconds']:.0f} | {r.get('problem', 'ok')} |")
    s = out.get("sharded_evaluate", {})
    lines += ["", f"sharded evaluate (2 processes): {s.get('skipped') or ('ok' if s.get('ok') else s.get('problem'))}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="smollm2_135m", help="a conf/model name, or tiny_random")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--methods", default="", help="comma-separated (default: every method)")
    ap.add_argument("--forward-impls", default="",
                    help="comma-separated CachedModel forwards to run every method on (hf, lean, compiled: the "
                         "torch.compile'd one-token step; cudagraph: that step and the multi-row forwards replayed as CUDA graphs, CUDA only); "
                         "exact match is against `ar` on the first (default: hf,lean,compiled, and cudagraph on CUDA)")
    ap.add_argument("--dtypes", default="fp32,bf16", help="comma-separated, of fp32, bf16")
    ap.add_argument("--kinds", default="", help=f"comma-separated, of {', '.join(KINDS)} (default: all)")
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "outputs" / "gpu_smoke" / time.strftime("%Y-%m-%d_%H-%M-%S"))
    a = ap.parse_args(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device is available here; use --device cpu")
    unknown = set(filter(None, a.kinds.split(","))) - set(KINDS)
    if unknown:
        ap.error(f"--kinds {sorted(unknown)} not valid; choose from: {', '.join(KINDS)}")
    bad = [d for d in a.dtypes.split(",") if d not in ("fp32", "bf16")]
    if bad:
        ap.error(f"--dtypes {bad} not valid; choose from: fp32, bf16")

    a.forward_impls = a.forward_impls or ("hf,lean,compiled,cudagraph" if a.device == "cuda" else "hf,lean,compiled")

    bad = [i for i in a.forward_impls.split(",") if i not in FORWARD_IMPLS]
    if bad:
        ap.error(f"--forward-impls {bad} not valid; choose from: {', '.join(FORWARD_IMPLS)}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = {"device": device_name(a.device), "torch": torch.__version__, "model": a.model, "new_tokens": a.new_tokens,
           "date": time.strftime("%Y-%m-%d")}
    print(f"decoding ({out['device']})", flush=True)
    decoding(a, out)
    if not a.skip_training:
        print("training", flush=True)
        training(a, out)
    sharded(a, out)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "gpu_smoke.json").write_text(json.dumps(out, indent=2) + "\n")
    text = tables(out)
    (a.out / "gpu_smoke.md").write_text(text + "\n")
    print("\n" + text)
    failed = [r for part in ("decoding", "training") for r in out.get(part, []) if not r["ok"] or "problem" in r]
    if out.get("sharded_evaluate", {}).get("ok") is False:
        failed.append(out["sharded_evaluate"])
    print(f"\n{len(failed)} problem(s); full results in {a.out}")
    return 1 if failed else 0

