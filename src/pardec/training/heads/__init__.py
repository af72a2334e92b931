"""Kind ``heads``: drafters trained on the target itself, which draft several tokens from one target forward:
Medusa heads (``heads.type: medusa``), FIRP projections (``heads.type: firp``) or an EAGLE-3 draft layer trained
with training-time test (``heads.type: eagle3``, :mod:`pardec.training.heads.eagle`), self-distilled on the target's own
completions (``python -m train +experiment=heads_<type>_<name>``; the artifacts: :mod:`pardec.models.heads`).

Stages (``stage=generate|train|eval|all``):

* ``generate``: the target's greedy completions of ``completions.sources`` into ``completions.out_dir``
  (:mod:`pardec.training.completions`; the SmolLM2 experiments share draft_smollm2's);
* ``train``: :class:`~.trainer.HeadsTrainer`; the drafter goes to ``<run dir>/final``;
* ``eval`` (rank 0): completions of the held-out ``eval.sources`` (``<eval.out_dir>/<dataset>``), per-depth rank
  accuracies of the drafter's candidates, trees for ``eval.budgets`` in ``<run dir>/final/trees``, all summarised
  in ``<run dir>/heads_eval.json``; for eagle3 the chain's held-out acceptance by depth instead of ranks and trees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pardec.config import ConfigError, check_at_least, is_int
from pardec.training.completions import GeneratesCompletions, check_fraction
from pardec.training.heads.types import COMMON_KEYS, TYPES, heads_type
from pardec.training.kinds import Kind, Spec, common_fields, known, register_kind

#: why ZeRO-3 is refused: its zero.Init would partition the frozen target, which loads inside the Trainer's
#: DeepSpeed context but is never handed to the engine, and the drafter is saved from rank 0 alone (whole weights);
#: heads of a few million parameters train under ZeRO-2
NO_ZERO3 = "the frozen target would be partitioned outside the engine and the heads are saved whole from rank 0"


@dataclass
class HeadsSpec(Spec):
    heads: dict  # type and the type's options, defaults filled (MedusaOptions, FirpOptions, Eagle3Options,
    #              DFlashOptions: each type's options dataclass)
    head_decay: float
    corpus_fraction: float  # train on the first fraction of each source's completions (corpus-size studies)
    gen: Any  # pardec.training.completions.GenerateConfig: the training completions
    eval_gen: list  # one GenerateConfig per held-out source, each with its own out_dir
    topk: int
    budgets: list[int]
    init_from: str | None = None  # a trained drafter's directory (heads.init_from, zoo:<name> resolved) to continue
    feature_cache: str | None = None  # heads.feature_cache: where the target's states are kept (EAGLE-3, DFlash)


def check_init_from(value, kind: str, target: str) -> str:
    """``heads.init_from``: a trained drafter of the same type to continue training (its directory, or
    ``zoo:<name>``: verified, made for this target), as the directory to load; refused in one line otherwise."""
    from pardec import zoo
    from pardec.models.heads import read_meta

    if not isinstance(value, str) or not value:
        raise ConfigError(f"heads.init_from={value!r} is not valid: give a trained drafter's directory or zoo:<name>")
    path = zoo.resolve(value, "heads.init_from", target)
    meta = read_meta(path, "heads.init_from")
    if meta.get("kind") != kind:
        raise ConfigError(f"heads.init_from={value!r} holds a {meta.get('kind')!r} drafter; this experiment trains "
                          f"heads.type={kind!r}")
    return path


def check_feature_cache(value, htype) -> str | None:
    """``heads.feature_cache``: null, or a directory for the target's states of a type that trains on them."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"heads.feature_cache={value!r} is not valid: give a directory (or null: a live target pass)")
    if not htype.reads_target_states:
        readers = [t for t in TYPES.names() if TYPES.get(t).reads_target_states]
        raise ConfigError(f"heads.feature_cache is not valid with heads.type={htype.name!r}: it keeps the target "
                          f"states that {', '.join(readers)} train on")
    return value


@register_kind("heads")
class HeadsKind(GeneratesCompletions, Kind):
    name = "heads"
    stages = ("generate", "train", "eval")
    rank0_stages = ("eval",)
    example = "heads_medusa_tiny"

    def validate(self, cfg: DictConfig, name: str) -> HeadsSpec:
        """Check a heads config before anything heavy loads (FIRP layers against the target's layer count when its
        config can be read without loading weights, else when the drafter is built)."""
        from pardec.training.completions import eval_sources, generate_config
        from pardec.training.heads.trainer import HeadsConfig

        heads, completions, ev = self.sections(cfg, "heads", "completions", "eval")
        kind = heads.get("type")
        htype = heads_type(kind)
        known(heads, ("type", *htype.keys, *COMMON_KEYS), f"heads (type {kind})")
        fraction = check_fraction(heads.pop("corpus_fraction", 1.0), "heads.corpus_fraction")
        init_from = heads.pop("init_from", None)
        feature_cache = check_feature_cache(heads.pop("feature_cache", None), htype)
        htype.check(heads)
        head_decay = float(heads.pop("head_decay", 1.0))  # Medusa's: head k weighs head_decay ** k
        gen = generate_config(completions, "completions")
        topk, budgets = ev.pop("topk", 10), ev.pop("budgets", [16, 32, 63])
        check_at_least("eval.topk", topk, 1, integer=True)
        if not isinstance(budgets, list) or not budgets or not all(is_int(b) and b >= 1 for b in budgets):
            raise ConfigError(f"eval.budgets={budgets!r} is not valid: give a non-empty list of integers >= 1 "
                              f"(tree sizes)")
        common = common_fields(cfg, name, HeadsConfig, no_zero3=NO_ZERO3,
                               elsewhere={"head_decay": "Medusa's head_decay is heads.head_decay"})
        htype.check_target(heads, common["model"])
        if init_from is not None:
            init_from = check_init_from(init_from, kind, common["model"].name)
        return HeadsSpec(**common, heads=heads, head_decay=head_decay, corpus_fraction=fraction, gen=gen,
                         eval_gen=eval_sources(ev), topk=topk, budgets=budgets, init_from=init_from,
                         feature_cache=feature_cache)

    def stage_train(self, spec: HeadsSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.heads.trainer import train_heads

        return train_heads(spec, run_dir, ranks)

    def stage_eval(self, spec: HeadsSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.heads.trainer import evaluate_heads

        result = evaluate_heads(spec, run_dir)
        if heads_type(result["kind"]).chain:
            o = result["overall"]
            out = {"positions": result["positions"], "parameters": result["parameters"],
                   **{k: o[k] for k in ("expected_tokens_per_forward", "conditional_acceptance", "topk_containment")}}
            print(json.dumps(out, indent=2))
            return out
        out = {k: result[k] for k in ("positions", "parameters", "trees")}
        out["topk_accuracy"] = result["overall"]["topk_accuracy"]
        print(json.dumps(out, indent=2))
        return out
