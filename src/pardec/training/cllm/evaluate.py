"""Stage ``eval`` of kind ``cllm``: held-out Jacobi decoding, the mechanism's number.

``<run dir>/final`` decodes the first ``max_prompts`` prompts of every ``eval.sources`` entry greedily with
``jacobi`` (random initial guesses from the context, the decoder's default) at ``eval.block_size`` (the trained
block) up to ``eval.max_new_tokens`` or EOS. Per prompt: its fast-forward (tokens committed per Jacobi iteration, the
CLLM paper's count), tokens and target forwards; per source and overall the mean fast-forward over prompts (as
``python -m pardec.report cllm`` averages the benchmark's) and tokens per forward (all tokens over all forwards).
With ``eval.base`` the base model decodes the same prompts (its fast-forward is the mechanism's zero: ~1).
Everything goes to ``<run dir>/cllm_eval.json``; the stage returns the overall figures.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from pardec.config import ConfigError, ModelConfig, check_at_least
from pardec.decoding.base import Stopper
from pardec.decoding.jacobi import Jacobi
from pardec.models.cached import CachedModel
from pardec.models.loading import load_model
from pardec.training.completions import Source, generate_config, source_prompts

log = logging.getLogger(__name__)

EVAL_FILE = "cllm_eval.json"
EVAL_KEYS = ("sources", "block_size", "max_new_tokens", "base")


@dataclass
class EvalConfig:
    sources: list[Source] = field(default_factory=list)  # none: nothing to evaluate (stage all skips eval)
    block_size: int = 16
    max_new_tokens: int = 48
    base: bool = False


def eval_config(section: dict | None) -> EvalConfig:
    """The ``eval`` section checked (keys, sources in generate_config's form, sizes) before any model loads."""
    section = dict(section or {})
    bad = sorted(set(section) - set(EVAL_KEYS))
    if bad:
        raise ConfigError(f"unknown key(s) {bad} in eval; valid: {', '.join(EVAL_KEYS)}")
    cfg = EvalConfig(block_size=section.get("block_size", 16), max_new_tokens=section.get("max_new_tokens", 48),
                     base=section.get("base", False))
    check_at_least("eval.block_size", cfg.block_size, 1, integer=True)
    check_at_least("eval.max_new_tokens", cfg.max_new_tokens, 1, integer=True)
    if not isinstance(cfg.base, bool):
        raise ConfigError(f"eval.base={cfg.base!r} is not valid: it must be true or false")
    if section.get("sources"):
        cfg.sources = generate_config({"sources": section["sources"]}, "eval").sources
    return cfg


@torch.no_grad()
def jacobi_runs(model, prompts: list[list[int]], block_size: int, max_new_tokens: int, eos_ids: set[int],
                desc: str | None = None) -> list:
    """Each prompt decoded greedily by ``jacobi`` with ``model`` (an HF causal LM; its train/eval mode restored);
    the decoder's :class:`~pardec.decoding.base.GenerationResult` per prompt."""
    was_training = model.training
    model.eval()
    try:
        decoder = Jacobi(CachedModel(model, cache="dynamic", forward_impl="hf"), block_size=block_size,
                         record_trajectories=False)
        stop = Stopper(eos_ids=eos_ids)
        return [decoder.generate(p, max_new_tokens, stop)
                for p in tqdm(prompts, desc=desc, disable=desc is None, leave=False)]
    finally:
        model.train(was_training)


def mean_fast_forward(runs: list) -> float:
    """The mean over prompts of each one's fast-forward; NaN for none."""
    ff = [r.extras["fast_forward"] for r in runs]
    return sum(ff) / len(ff) if ff else float("nan")


def summarize(runs: list) -> dict[str, Any]:
    """A set of prompts' figures: mean fast-forward over prompts, tokens per forward over all of them, counts."""
    tokens, forwards = sum(len(r.tokens) for r in runs), sum(r.target_forwards for r in runs)
    return {"fast_forward": mean_fast_forward(runs), "tokens_per_forward": tokens / max(1, forwards),
            "prompts": len(runs), "tokens": tokens, "forwards": forwards,
            "ended_with_eos": sum(r.stop_reason == "eos" for r in runs)}


def evaluate_cllm(spec, run_dir: Path) -> dict[str, Any]:
    """The eval stage (see the module doc); ``spec.eval`` has at least one source."""
    ev: EvalConfig = spec.eval
    final = run_dir / "final"
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"no trained model in {final}; run stage=train first")
    unset_hf_deepspeed_config()  # after a ZeRO-3 train stage: load the model whole (rank 0 alone), not sharded
    trained = load_model(ModelConfig(name="cllm", source="local", path=str(final), dtype=spec.model.dtype,
                                     device=spec.model.device))
    models = {"trained": trained}
    if ev.base:
        models["base"] = load_model(spec.model)
    result: dict[str, Any] = {"model": str(final), "base_model": spec.model.name, "block_size": ev.block_size,
                              "max_new_tokens": ev.max_new_tokens, "dtype": str(trained.model.dtype),
                              "threads": torch.get_num_threads(), "per_dataset": {}, "prompts": {}}
    every: dict[str, list] = {label: [] for label in models}
    t0 = time.perf_counter()
    for src in ev.sources:
        name = src.dataset.name
        prompts = source_prompts([src], trained.tokenizer, trained.chat)
        per: dict[str, Any] = {}
        for label, lm in models.items():
            runs = jacobi_runs(lm.model, [p.ids for p in prompts], ev.block_size, ev.max_new_tokens, lm.eos_ids,
                               desc=f"eval {name} ({label})")
            every[label] += runs
            per[label] = summarize(runs)
            result["prompts"].setdefault(name, {})[label] = [
                {"id": p.id, "fast_forward": r.extras["fast_forward"], "tokens": len(r.tokens),
                 "forwards": r.target_forwards, "stop_reason": r.stop_reason} for p, r in zip(prompts, runs)]
        result["per_dataset"][name] = per
        log.info("eval %s: %s", name, json.dumps(per))
    result["overall"] = {label: summarize(runs) for label, runs in every.items()}
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    (run_dir / EVAL_FILE).write_text(json.dumps(result, indent=1) + "\n")
    out = {k: result["overall"]["trained"][k] for k in ("fast_forward", "tokens_per_forward", "prompts", "tokens")}
    if ev.base:
        out["base_fast_forward"] = result["overall"]["base"]["fast_forward"]
    return out
