"""The data-generation stages of a training recipe, planned like its train stage: per GPU, what decoding the
training data needs (``python -m pardec.plan <recipe> --stages``).

Every rank decodes its share of the prompts with the whole target (no ZeRO: it is inference), so per GPU:

* weights: the target in the run's ``dtype``;
* kv: the KV cache of one batch, ``batch x (longest prompt + new tokens + margin)`` tokens;
* activations: one layer's working set over the batch's prefill (as an evaluation's, :mod:`pardec.plan.plans`);
* logits, fp32 (4 B): ``generate`` (the training completions) and ``heldout`` (stage eval's held-out completions)
  run ``model.generate``, which keeps one ``[batch, vocab]`` row of logits per step in fp32, and with
  ``completions.teacher_topk`` every step's (``new x batch x vocab``); CLLM's ``collect`` runs Jacobi iterations of
  ``block_size`` rows of the whole batch at once (``batch x block x vocab``);
* overhead: 10% of the rest.

Stages without a GPU model are not rows: SDSAT's ``mask`` (text only)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pardec.plan.compose import check_name, compose
from pardec.plan.plans import composed_plan, prompt_estimate
from pardec.plan.shapes import COMPONENTS, CONTEXT_MARGIN, DTYPE_BYTES, OVERHEAD, Arch, Plan, arch


def _prompt(sources: list[dict] | None, dataset: dict | None, prompt_tokens: int | None) -> int:
    """The longest prompt of a stage's sources (each a ``{dataset: ...}`` or ``{completions: ...}`` entry) or of
    ``dataset``, estimated per task."""
    if prompt_tokens:
        return prompt_tokens
    sets = [s["dataset"] for s in sources or [] if isinstance(s, dict) and isinstance(s.get("dataset"), dict)]
    return max((prompt_estimate(d) for d in sets or [dataset or {}]), default=prompt_estimate({}))


def _stage(name: str, recipe: str, a: Arch, world: int, run_bytes: int, batch: int, prompt: int, new: int,
           logits_rows: int, note: str) -> Plan:
    comps = dict.fromkeys(COMPONENTS, 0.0)
    comps["weights"] = a.params * run_bytes
    comps["kv"] = batch * (prompt + new + CONTEXT_MARGIN) * a.kv_bytes_per_token(run_bytes)
    comps["activations"] = batch * prompt * (4 * a.hidden + 3 * a.intermediate) * run_bytes
    comps["logits"] = logits_rows * a.vocab * 4
    comps["overhead"] = OVERHEAD * sum(comps.values())
    return Plan(recipe=recipe, kind=name, world=world, zero=None, model=a.hub_id, params=a.params, trainable=0,
                components=comps, notes=[f"batch {batch}, prompt ~{prompt} + {new} new tokens; {note}"])


def data_plans(recipe: str, cfg: dict[str, Any], a: Arch, world: int, prompt_tokens: int | None = None) -> list[Plan]:
    """The plans of the data stages of training recipe ``recipe`` (its composed ``cfg``, its target's ``a``)."""
    kind, run_bytes = cfg["kind"], DTYPE_BYTES[cfg["dtype"]]
    out = []
    if kind == "cllm":
        c = cfg.get("collect") or {}
        batch, block, new = int(c.get("batch_size", 8)), int(c.get("block_size", 16)), int(c.get("max_new_tokens", 256))
        prompt = _prompt(None, cfg.get("dataset"), prompt_tokens)
        out.append(_stage("collect", recipe, a, world, run_bytes, batch, prompt, new + block, batch * block,
                          f"Jacobi blocks of {block}"))
    sections = {"draft": ("completions", "eval"), "drafter": ("completions", "eval"), "cllm": ("completions",)}
    for key in sections.get(kind, ()):
        g = cfg.get(key) or {}
        if not g or (kind == "cllm" and (cfg.get("ar_answer") != "whole" or int(g.get("max_new_tokens", 0)) <= int(
                (cfg.get("collect") or {}).get("max_new_tokens", 0)))):
            continue  # CLLM generates whole answers only when asked for longer ones than it collected
        batch, new, topk = int(g.get("batch_size", 8)), int(g.get("max_new_tokens", 128)), int(g.get("teacher_topk", 0))
        prompt = _prompt(g.get("sources"), cfg.get("dataset"), prompt_tokens)
        rows = batch * (new if topk else 1)
        out.append(_stage("generate" if key == "completions" else "heldout", recipe, a, world, run_bytes, batch, prompt,
                          new, rows, "every step's logits kept (teacher_topk)" if topk else "generate()"))
    return out


def stage_plans(name: str, *, world: int | None = None, gpus: int | None = None, overrides: Sequence[str] = (),
                prompt_tokens: int | None = None, batch: int = 1) -> list[Plan]:
    """:func:`plan`, and for a training recipe also its data-generation stages, in the order the recipe runs them
    (collect, generate, train, heldout); the recipe is composed once for all of them."""
    name = check_name(name)
    app, cfg = compose(name, overrides)
    p = composed_plan(name, app, cfg, world=world, gpus=gpus, prompt_tokens=prompt_tokens, batch=batch)
    if app != "train":
        return [p]
    data = data_plans(name, cfg, arch(p.model), p.world, prompt_tokens)
    return [*(d for d in data if d.kind != "heldout"), p, *(d for d in data if d.kind == "heldout")]
