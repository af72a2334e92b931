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

from pardec.config import ConfigError, check_at_least, check_choice, check_range, is_int
from pardec.training.completions import GeneratesCompletions, check_fraction
from pardec.training.kinds import Kind, Spec, check_layers, common_fields, known, register_kind

#: keys of the ``heads`` section per type
#: why ZeRO-3 is refused: its zero.Init would partition the frozen target, which loads inside the Trainer's
#: DeepSpeed context but is never handed to the engine, and the drafter is saved from rank 0 alone (whole weights);
#: heads of a few million parameters train under ZeRO-2
NO_ZERO3 = "the frozen target would be partitioned outside the engine and the heads are saved whole from rank 0"
HEADS_KEYS = {"medusa": ("type", "num_heads", "num_blocks", "head_decay", "corpus_fraction", "init_from"),
              "firp": ("type", "layers", "attention", "distance", "corpus_fraction", "init_from"),
              "eagle3": ("type", "draft_vocab_size", "ttt_steps", "step_decay", "layers", "corpus_fraction",
                         "init_from"),
              "dflash": ("type", "num_layers", "layers", "block_size", "num_anchors", "gamma", "loss", "weighting",
                         "dpace_alpha", "fusion", "mask_token_id", "layer_init", "corpus_fraction", "init_from")}
#: EAGLE-3's defaults (Li et al. 2025; reference eagle/traineagle3: cnets.py ``self.length = 7``, main.py
#: ``ploss_weight = [0.8 ** i ...]``, the 32000-id draft vocabulary of its configs)
EAGLE3_DEFAULTS = {"draft_vocab_size": 32000, "ttt_steps": 7, "step_decay": 0.8}
#: FIRP's loss, per (anchor, step): KL(P~ || P) with P~ the pseudo state's distribution and P the target's at the
#: same future position (paper Eq. 4: ``rkl`` in :func:`pardec.training.losses.token_divergence`'s naming, where the
#: student is q); ``fkl``: KL(P || P~), pardec's earlier choice (Medusa's self-distillation direction)
FIRP_DISTANCES = ("rkl", "fkl")


@dataclass
class HeadsSpec(Spec):
    heads: dict  # type, num_heads, num_blocks (medusa) / layers, attention, distance (firp) /
    #              draft_vocab_size, ttt_steps, step_decay, layers (eagle3) / DFLASH_DEFAULTS' keys, layers (dflash)
    head_decay: float
    corpus_fraction: float  # train on the first fraction of each source's completions (corpus-size studies)
    gen: Any  # pardec.training.completions.GenerateConfig: the training completions
    eval_gen: list  # one GenerateConfig per held-out source, each with its own out_dir
    topk: int
    budgets: list[int]
    init_from: str | None = None  # a trained drafter's directory (heads.init_from, zoo:<name> resolved) to continue


def check_vocab_size(size: int, model) -> None:
    """``heads.draft_vocab_size`` against the target's vocabulary when its config is at hand without loading it."""
    from pardec.models.loading import read_config_json

    vocab = None if model.source == "tiny_random" else (read_config_json(model) or {}).get("vocab_size")
    if vocab is not None and size > vocab:
        raise ConfigError(f"heads.draft_vocab_size={size} is out of range: it must be in [2, {vocab}] (the target "
                          f"{model.name}'s vocabulary)")


def check_dflash(heads: dict) -> None:
    """DFlash's keys (defaults: :data:`pardec.training.heads.dflash.DFLASH_DEFAULTS`), each range and choice
    checked; ``layers`` null: DFlash's evenly spaced target layers, one per draft layer."""
    from pardec.models.dflash import FUSIONS, LAYER_INITS
    from pardec.training.heads.dflash import DFLASH_DEFAULTS, LOSSES, WEIGHTINGS

    for key, v in DFLASH_DEFAULTS.items():
        heads.setdefault(key, v)
    for key, lo in (("num_layers", 1), ("block_size", 2), ("num_anchors", 1)):
        check_at_least(f"heads.{key}", heads[key], lo, integer=True)
    check_range("heads.gamma", heads["gamma"], 0, 1e9, integer=False, open_lo=True)
    check_range("heads.dpace_alpha", heads["dpace_alpha"], 0, 1, integer=False, open_lo=True)
    heads["gamma"], heads["dpace_alpha"] = float(heads["gamma"]), float(heads["dpace_alpha"])
    check_choice("heads.loss", heads["loss"], LOSSES)
    check_choice("heads.weighting", heads["weighting"], WEIGHTINGS)
    check_choice("heads.fusion", heads["fusion"], FUSIONS)
    if heads["mask_token_id"] is not None:
        check_at_least("heads.mask_token_id", heads["mask_token_id"], 0, integer=True)
    check_choice("heads.layer_init", heads["layer_init"], LAYER_INITS)
    layers = heads.get("layers")
    if layers is not None and (not isinstance(layers, list) or not layers or not all(is_int(i) for i in layers)):
        raise ConfigError(f"heads.layers={layers!r} is not valid: give a non-empty list of target layer indices (the "
                          f"states entering them are fused; null: DFlash's evenly spaced layers, one per draft layer)")
    if heads["layer_init"] == "target":  # draft layer i is a copy of target layer layers[i] reading its own state
        if heads["fusion"] != "layerwise":
            raise ConfigError(f"heads.layer_init=target needs heads.fusion=layerwise (each draft layer reads the state "
                              f"entering the target layer it copies), not {heads['fusion']!r}")
        if layers is None:  # the target's first num_layers layers
            heads["layers"] = list(range(heads["num_layers"]))
        elif len(layers) != heads["num_layers"]:
            raise ConfigError(f"heads.layers={layers} is not valid with heads.layer_init=target: give one target "
                              f"layer per draft layer ({heads['num_layers']}; null: layers 0..{heads['num_layers'] - 1})")


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
        check_choice("heads.type", kind, tuple(HEADS_KEYS))
        known(heads, HEADS_KEYS[kind], f"heads (type {kind})")
        fraction = check_fraction(heads.pop("corpus_fraction", 1.0), "heads.corpus_fraction")
        init_from = heads.pop("init_from", None)
        head_decay = 1.0
        if kind == "medusa":
            for key in ("num_heads", "num_blocks"):
                v = heads.setdefault(key, 3 if key == "num_heads" else 1)
                check_at_least(f"heads.{key}", v, 1, integer=True)
            head_decay = heads.pop("head_decay", 0.8)
            check_range("heads.head_decay", head_decay, 0, 1, integer=False, open_lo=True)
            head_decay = float(head_decay)
        elif kind == "dflash":
            check_dflash(heads)
        elif kind == "eagle3":
            for key, v in EAGLE3_DEFAULTS.items():
                heads.setdefault(key, v)
            check_at_least("heads.draft_vocab_size", heads["draft_vocab_size"], 2, integer=True)
            check_at_least("heads.ttt_steps", heads["ttt_steps"], 1, integer=True)
            check_range("heads.step_decay", heads["step_decay"], 0, 1, integer=False, open_lo=True)
            heads["step_decay"] = float(heads["step_decay"])
            layers = heads.get("layers")
            if layers is not None and (not isinstance(layers, list) or not layers
                                       or not all(is_int(i) for i in layers)):
                raise ConfigError(f"heads.layers={layers!r} is not valid: give a non-empty list of target layer "
                                  f"indices (the fused features; null: EAGLE-3's low/mid/high default)")
        else:
            layers = heads.get("layers")
            if not isinstance(layers, list) or not layers or not all(is_int(i) for i in layers):
                raise ConfigError(f"heads.layers={layers!r} is not valid: give a non-empty list of target layer "
                                  f"indices (one per pseudo step)")
            if layers != sorted(layers):
                raise ConfigError(f"heads.layers={layers} is not valid: the layers must be nondecreasing")
            from pardec.models.pseudo import PSEUDO_ATTENTION

            attention, distance = heads.get("attention", "real"), heads.get("distance", "rkl")  # the paper's
            check_choice("heads.attention", attention, PSEUDO_ATTENTION)
            check_choice("heads.distance", distance, FIRP_DISTANCES)
        gen = generate_config(completions, "completions")
        topk, budgets = ev.pop("topk", 10), ev.pop("budgets", [16, 32, 63])
        check_at_least("eval.topk", topk, 1, integer=True)
        if not isinstance(budgets, list) or not budgets or not all(is_int(b) and b >= 1 for b in budgets):
            raise ConfigError(f"eval.budgets={budgets!r} is not valid: give a non-empty list of integers >= 1 "
                              f"(tree sizes)")
        common = common_fields(cfg, name, HeadsConfig, no_zero3=NO_ZERO3,
                               elsewhere={"head_decay": "Medusa's head_decay is heads.head_decay"})
        if kind == "firp" or (kind in ("eagle3", "dflash") and heads.get("layers") is not None):
            check_layers(heads["layers"], common["model"], "heads.layers")
        if kind == "eagle3":
            check_vocab_size(heads["draft_vocab_size"], common["model"])
        if init_from is not None:
            init_from = check_init_from(init_from, kind, common["model"].name)
        return HeadsSpec(**common, heads=heads, head_decay=head_decay, corpus_fraction=fraction, gen=gen,
                         eval_gen=eval_sources(ev), topk=topk, budgets=budgets, init_from=init_from)

    def stage_train(self, spec: HeadsSpec, run_dir: Path, d) -> dict:
        from pardec.training.heads.trainer import train_heads

        return train_heads(spec, run_dir, d)

    def stage_eval(self, spec: HeadsSpec, run_dir: Path, d) -> dict:
        from pardec.training.heads.trainer import evaluate_heads

        result = evaluate_heads(spec, run_dir)
        if result["kind"] in ("eagle3", "dflash"):
            o = result["overall"]
            out = {"positions": result["positions"], "parameters": result["parameters"],
                   **{k: o[k] for k in ("expected_tokens_per_forward", "conditional_acceptance", "topk_containment")}}
            print(json.dumps(out, indent=2))
            return out
        out = {k: result[k] for k in ("positions", "parameters", "trees")}
        out["topk_accuracy"] = result["overall"]["topk_accuracy"]
        print(json.dumps(out, indent=2))
        return out
