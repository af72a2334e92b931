"""Where one decoding step's time goes: one `ar` step and one `sps` round of SmolLM2 (and its distilled draft),
split into the model's parts, against the bare-GEMM floor of the same linear layers.

    python scripts/profile_step.py [--dtype fp32|bf16|int8] [--methods ar,sps] [--tokens 128] [--prompts 2]
        [--draft outputs/train/runs/draft_smollm2/default/final] [--gamma 4] [--threads 2] [--kv-cache preallocated]
        [--repeats 9]

Prefill forwards are left out (decode-only); the draft's first forward over the prompt, which happens inside the
first round, is its own part. Each method generates ``--tokens`` greedy tokens for ``--prompts`` GSM8K-like prompts (after a warm-up) while
forward hooks on every module read the clock on entry and exit (synchronous CPU kernels: the clock is honest; a
hook costs ~2 us). A module's time is its inclusive time less its children's, grouped as:

* linears: the decoder layers' attention projections (q/k/v/o), their MLP linears (gate/up/down), the LM head;
* attention core: the attention module less its projections (rotary, the cache write and read, SDPA);
* norms, embedding, glue (residual adds, masks and rotary tables built by the model, the head's slicing);
* outside the model: the decoding loop's own time (CachedModel's masks and positions, cache verbs, the finiteness
  check, drafting logic, verification, stop checks, Python).

The floor is the same linear layers run bare, in the model's order, on random inputs of M rows (M = 1 for an `ar`
step and a draft step, gamma + 1 for the verification forward), the median of ``--repeats`` passes: what the
weights' trip from memory costs, which nothing short of smaller weights (int8) removes. Prints one markdown table per
method (ms per step or round, and share) under the machine's CPU model and vector flags.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from pardec.config import KV_CACHES, ModelConfig
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.models.host import describe, machine
from pardec.models.loading import SMOLLM2, load_model

PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May? Explain step by step.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did she "
    "earn? Explain step by step.",
    "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. Her "
    "parents decided to give her $15 for that purpose, and her grandparents twice as much as her parents. How much "
    "more money does Betty need to buy the wallet? Explain step by step.",
]

OUTSIDE = "outside the models (loop, masks, cache verbs, verification, Python)"
LINEAR_GROUPS = {"q_proj": "attention projections", "k_proj": "attention projections",
                 "v_proj": "attention projections", "o_proj": "attention projections", "gate_proj": "MLP linears",
                 "up_proj": "MLP linears", "down_proj": "MLP linears", "lm_head": "LM head"}


def group_of(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    if leaf in LINEAR_GROUPS:
        return LINEAR_GROUPS[leaf]
    if leaf == "self_attn":
        return "attention core (rotary, cache, SDPA)"
    if "norm" in leaf:
        return "norms"
    if leaf == "embed_tokens":
        return "embedding"
    return "glue (residuals, masks, rotary tables, slicing)"


class Timer:
    """Exclusive time per module group, from forward pre/post hooks (a stack of open modules). Forwards of more
    than ``max_rows`` new tokens (a prefill, the draft's first catch-up over the prompt) are not counted: the
    decode-only wall time they are compared with leaves them out too."""

    def __init__(self, model: torch.nn.Module, prefix: str, max_rows: int, whole: str | None = None):
        """``whole``: the label under which the longer forwards are counted whole (None: not at all)."""
        self.ms: dict[str, float] = defaultdict(float)
        self.forward_ms = 0.0
        self.max_rows = max_rows
        self.whole = whole
        self.counting = False
        self.started = 0.0
        self.stack: list[list[float]] = []  # [start, children's time]
        self.handles = [model.register_forward_pre_hook(self._top, with_kwargs=True)]
        for name, mod in model.named_modules():
            label = f"{prefix}: {group_of(name) if name else 'glue (residuals, masks, rotary tables, slicing)'}"
            self.handles.append(mod.register_forward_pre_hook(self._enter))
            self.handles.append(mod.register_forward_hook(self._exit(label, top=not name)))

    def _top(self, mod, args, kwargs):
        x = kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        self.counting = x is not None and x.shape[1] <= self.max_rows
        self.started = time.perf_counter()

    def _enter(self, mod, args):
        if self.counting:
            self.stack.append([time.perf_counter(), 0.0])

    def _exit(self, label: str, top: bool):
        def hook(mod, args, out):
            if not self.counting:
                if top and self.whole is not None:
                    spent = (time.perf_counter() - self.started) * 1e3
                    self.ms[self.whole] += spent
                    self.forward_ms += spent
                return
            start, children = self.stack.pop()
            spent = (time.perf_counter() - start) * 1e3
            self.ms[label] += spent - children
            if self.stack:
                self.stack[-1][1] += spent
            if top:
                self.forward_ms += spent
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def linear_floor(model: torch.nn.Module, rows: int, repeats: int) -> float:
    """ms of every linear layer of ``model`` run bare, one after the other in the model's order, on random
    [1, rows, in] inputs (median over ``repeats`` passes). In order, as a forward runs them: the weights come from
    memory, not from a cache warmed by repeating one layer (which measured half this here)."""
    mods = [m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in LINEAR_GROUPS]
    times = []
    with torch.inference_mode():
        xs = []
        for mod in mods:
            weight = mod.weight() if callable(getattr(mod, "weight", None)) else mod.weight
            half = weight.dtype in (torch.bfloat16, torch.float16)  # (int8 linears take fp32 inputs)
            xs.append(torch.randn(1, rows, weight.shape[1], dtype=weight.dtype if half else torch.float32))
        for _ in range(repeats):
            t0 = time.perf_counter()
            for mod, x in zip(mods, xs):
                mod(x)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def load(path: str | None, dtype: str):
    if path is None:
        return load_model(ModelConfig(name=SMOLLM2.name, source=SMOLLM2.source, path=SMOLLM2.path,
                                      gguf_file=SMOLLM2.gguf_file, dtype=dtype, device="cpu"))
    return load_model(ModelConfig(name="draft", source="local", path=path, dtype=dtype, device="cpu"))


@dataclass
class Profile:
    method: str
    total: float  # ms per decoding step (ar) or round (sps), decode only
    parts: dict[str, float]  # ms per step, by part (they sum to total)
    floor: float  # ms of the same linears run bare (see linear_floor)
    steps: int
    tokens_per_step: float
    tokens_per_s: float  # decode-only
    draft_forwards_per_step: float


def profile(method: str, target: torch.nn.Module, draft: torch.nn.Module | None, tokenizer, prompts: list[list[int]],
            tokens: int, gamma: int = 4, kv_cache: str = "preallocated", repeats: int = 9) -> Profile:
    """One method's decode steps split into parts (module docstring); ``draft`` only for ``sps``."""
    sps = method == "sps"
    stop = Stopper(tokenizer)
    dec = build_decoder(method, CachedModel(target, cache=kv_cache), tokenizer,
                        CachedModel(draft, "draft", cache=kv_cache) if sps else None, **({"gamma": gamma} if sps else {}))
    dec.generate(prompts[0], 16, stop)  # warm-up
    models = [(target, "target")] + ([(draft, "draft")] if sps else [])
    # the target's prefill is outside the decode-only wall time; the draft's first catch-up over the prompt is inside
    timers = [Timer(m, name, gamma + 1 if sps else 1, None if name == "target" else f"{name}: prompt forwards")
              for m, name in models]
    wall = steps = new = draft_steps = 0
    try:
        for p in prompts:
            r = dec.generate(p, tokens, stop)
            wall += (r.total_s - r.prefill_s) * 1e3
            steps += r.target_forwards - 1
            new += len(r.tokens) - 1  # the prefill's token is not a decode step's
            draft_steps += max(0, r.draft_forwards - 1)
    finally:
        for t in timers:
            t.remove()
    steps = max(steps, 1)
    parts = {k: v / steps for t in timers for k, v in t.ms.items()}
    parts[OUTSIDE] = (wall - sum(t.forward_ms for t in timers)) / steps
    floor = linear_floor(target, gamma + 1 if sps else 1, repeats)
    if sps:  # the draft's forwards per round (its catch-up forwards of 2 rows counted as 1)
        floor += linear_floor(draft, 1, repeats) * draft_steps / steps
    return Profile(method, wall / steps, parts, floor, steps, new / steps, new / max(wall, 1e-9) * 1e3,
                   draft_steps / steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "int8"])
    ap.add_argument("--methods", default="ar,sps")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--draft", type=Path, default=Path("outputs/train/runs/draft_smollm2/default/final"))
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--kv-cache", default="preallocated", choices=list(KV_CACHES))
    a = ap.parse_args()
    methods = a.methods.split(",")
    bad = [m for m in methods if m not in ("ar", "sps")]
    if bad:
        ap.error(f"--methods {','.join(bad)}: choose from ar, sps")
    torch.set_num_threads(a.threads)
    print(describe(machine()), f"| {a.dtype} | kv_cache={a.kv_cache} | {a.tokens} tokens x {a.prompts} prompts")
    lm = load(None, a.dtype)
    tok = lm.tokenizer
    draft = load(str(a.draft), a.dtype).model if "sps" in methods else None
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                       return_dict=True)["input_ids"] for p in PROMPTS[: a.prompts]]
    for method in methods:
        pr = profile(method, lm.model, draft, tok, prompts, a.tokens, a.gamma, a.kv_cache, a.repeats)
        unit = "round" if method == "sps" else "step"
        at = f"target at M={a.gamma + 1} + draft at M=1 x {pr.draft_forwards_per_step:.2f}" if method == "sps" \
            else "M=1"
        print(f"\n{method}: {pr.total:.1f} ms per {unit} ({pr.steps} of them, {pr.tokens_per_step:.2f} tokens each, "
              f"{pr.tokens_per_s:.1f} tokens/s decode-only); bare-GEMM floor of the same linears {pr.floor:.1f} ms "
              f"({at})")
        print("| part | ms | share |")
        print("|---|---|---|")
        for k, v in sorted(pr.parts.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.2f} | {v / pr.total:.1%} |")
        print(f"| total | {pr.total:.2f} | 100% |")


if __name__ == "__main__":
    main()
