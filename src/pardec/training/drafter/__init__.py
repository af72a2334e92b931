"""Kind ``drafter``: drafters that read the frozen target's hidden states and draft several tokens from one target
forward: Medusa heads (``drafter.type: medusa``), FIRP projections (``drafter.type: firp``), an EAGLE-3 draft layer
trained with training-time test (``drafter.type: eagle3``, :mod:`pardec.training.drafter.eagle`) or a DFlash block
drafter (``drafter.type: dflash``, :mod:`pardec.training.drafter.dflash`), self-distilled on the target's own
completions (``python -m train +experiment=<heads_medusa|heads_firp|eagle3|dflash>_<name>``; the artifacts:
:mod:`pardec.models.drafters`). The ``drafter:`` section holds the type and its options (earlier spellings, kind
``heads`` and its ``heads:`` section, are refused in one line naming the new ones).

Stages (``stage=generate|train|eval|all``):

* ``generate``: the target's greedy completions of ``completions.sources`` into ``completions.out_dir``
  (:mod:`pardec.training.completions`; the SmolLM2 experiments share draft_smollm2's);
* ``train``: :class:`~.trainer.DrafterTrainer`; the drafter goes to ``<run dir>/final``;
* ``eval`` (rank 0): completions of the held-out ``eval.sources`` (``<eval.out_dir>/<dataset>``), per-depth rank
  accuracies of the drafter's candidates, trees for ``eval.budgets`` in ``<run dir>/final/trees``, all summarised
  in ``<run dir>/drafter_eval.json``; for eagle3 the chain's held-out acceptance by depth instead of ranks and trees.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pardec import zoo
from pardec.config import ConfigError, check_at_least, is_int
from pardec.training.completions import GeneratesCompletions, check_fraction, eval_sources, generate_config
from pardec.training.drafter.types import COMMON_KEYS, TYPES, drafter_type
from pardec.training.kinds import Kind, Spec, common_fields, known, register_kind

#: why ZeRO-3 is refused: its zero.Init would partition the frozen target, which loads inside the Trainer's
#: DeepSpeed context but is never handed to the engine, and the drafter is saved from rank 0 alone (whole weights);
#: drafters of a few million parameters train under ZeRO-2
NO_ZERO3 = "the frozen target would be partitioned outside the engine and the drafter is saved whole from rank 0"


@dataclass
class DrafterSpec(Spec):
    drafter: dict  # type and the type's options, defaults filled (MedusaOptions, FirpOptions, Eagle3Options,
    #              DFlashOptions: each type's options dataclass)
    head_decay: float
    corpus_fraction: float  # train on the first fraction of each source's completions (corpus-size studies)
    gen: Any  # pardec.training.completions.GenerateConfig: the training completions
    eval_gen: list  # one GenerateConfig per held-out source, each with its own out_dir
    topk: int
    budgets: list[int]
    init_from: str | None = None  # a trained drafter's directory (drafter.init_from, zoo:<name> resolved) to continue
    feature_cache: str | None = None  # drafter.feature_cache: where the target's states are kept (EAGLE-3, DFlash)


def check_init_from(value, kind: str, target: str) -> str:
    """``drafter.init_from``: a trained drafter of the same type to continue training (its directory, or
    ``zoo:<name>``: verified, made for this target), as the directory to load; refused in one line otherwise."""
    from pardec.models.drafters import read_meta  # heavy: transformers

    if not isinstance(value, str) or not value:
        raise ConfigError(f"drafter.init_from={value!r} is not valid: give a trained drafter's directory or zoo:<name>")
    path = zoo.resolve(value, "drafter.init_from", target)
    meta = read_meta(path, "drafter.init_from")
    if meta.get("kind") != kind:
        raise ConfigError(f"drafter.init_from={value!r} holds a {meta.get('kind')!r} drafter; this experiment trains "
                          f"drafter.type={kind!r}")
    return path


def check_feature_cache(value, htype) -> str | None:
    """``drafter.feature_cache``: null, or a directory for the target's states of a type that trains on them."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ConfigError(f"drafter.feature_cache={value!r} is not valid: give a directory (or null: a live target pass)")
    if not htype.reads_target_states:
        readers = [t for t in TYPES.names() if TYPES.get(t).reads_target_states]
        raise ConfigError(f"drafter.feature_cache is not valid with drafter.type={htype.name!r}: it keeps the target "
                          f"states that {', '.join(readers)} train on")
    return value


@register_kind("drafter")
class DrafterKind(GeneratesCompletions, Kind):
    name = "drafter"
    stages = ("generate", "train", "eval")
    rank0_stages = ("eval",)
    example = "heads_medusa_tiny"

    def validate(self, cfg: DictConfig, name: str) -> DrafterSpec:
        """Check a drafter config before anything heavy loads (FIRP layers against the target's layer count when its
        config can be read without loading weights, else when the drafter is built)."""
        from pardec.training.drafter.trainer import DrafterConfig  # heavy: transformers

        options, completions, ev = self.sections(cfg, "drafter", "completions", "eval")
        kind = options.get("type")
        htype = drafter_type(kind)
        known(options, ("type", *htype.keys, *COMMON_KEYS), f"drafter (type {kind})")
        fraction = check_fraction(options.pop("corpus_fraction", 1.0), "drafter.corpus_fraction")
        init_from = options.pop("init_from", None)
        feature_cache = check_feature_cache(options.pop("feature_cache", None), htype)
        htype.check(options)
        head_decay = float(options.pop("head_decay", 1.0))  # Medusa's: head k weighs head_decay ** k
        gen = generate_config(completions, "completions")
        topk, budgets = ev.pop("topk", 10), ev.pop("budgets", [16, 32, 63])
        check_at_least("eval.topk", topk, 1, integer=True)
        if not isinstance(budgets, list) or not budgets or not all(is_int(b) and b >= 1 for b in budgets):
            raise ConfigError(f"eval.budgets={budgets!r} is not valid: give a non-empty list of integers >= 1 "
                              f"(tree sizes)")
        common = common_fields(cfg, name, DrafterConfig, no_zero3=NO_ZERO3,
                               elsewhere={"head_decay": "Medusa's head_decay is drafter.head_decay"})
        htype.check_target(options, common["model"])
        if init_from is not None:
            init_from = check_init_from(init_from, kind, common["model"].name)
        return DrafterSpec(**common, drafter=options, head_decay=head_decay, corpus_fraction=fraction, gen=gen,
                           eval_gen=eval_sources(ev), topk=topk, budgets=budgets, init_from=init_from,
                           feature_cache=feature_cache)

    def stage_train(self, spec: DrafterSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.drafter.trainer import train_drafter  # heavy: transformers

        return train_drafter(spec, run_dir, ranks)

    def stage_eval(self, spec: DrafterSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.drafter.trainer import evaluate_drafter  # heavy: transformers

        result = evaluate_drafter(spec, run_dir)
        if drafter_type(result["kind"]).chain:
            o = result["overall"]
            out = {"positions": result["positions"], "parameters": result["parameters"],
                   **{k: o[k] for k in ("expected_tokens_per_forward", "conditional_acceptance", "topk_containment")}}
            print(json.dumps(out, indent=2))
            return out
        out = {k: result[k] for k in ("positions", "parameters", "trees")}
        out["topk_accuracy"] = result["overall"]["topk_accuracy"]
        print(json.dumps(out, indent=2))
        return out
