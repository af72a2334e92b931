"""Kind ``draft``: a draft model for speculative decoding, distilled from the target on the target's own completions
(``python -m train +experiment=draft_<name>``).

Stages (``stage=generate|train|eval|all``):

* ``generate``: the target's greedy completions of ``completions.sources`` into ``completions.out_dir``
  (:mod:`pardec.training.completions`);
* ``train``: :class:`~.trainer.DraftTrainer` (forward KL, TVD, JSD or CE on the draft vocabulary); the draft goes
  to ``<run dir>/final``;
* ``eval`` (rank 0): completions of the held-out ``eval.sources`` (``<eval.out_dir>/<dataset>``), top-1 agreement
  of draft vs target on them and the expected acceptance of a drafted token at temperature 1 (1 - TVD), and the
  forward cost ratio, into ``<run dir>/draft_eval.json``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pardec.config import ConfigError, check_at_least
from pardec.training.completions import GeneratesCompletions, check_fraction, eval_sources, generate_config
from pardec.training.kinds import Kind, Spec, check_layers, common_fields, known, register_kind

#: keys of the ``draft`` section (the draft's shape)
#: why ZeRO-3 is refused: its zero.Init would partition the frozen teacher, which loads inside the Trainer's
#: DeepSpeed context but is never handed to the engine, and the draft is saved from rank 0 alone (whole weights); a
#: draft of a few layers trains under ZeRO-2, which shards its optimizer states and gradients
NO_ZERO3 = "the frozen teacher would be partitioned outside the engine and the draft is saved whole from rank 0"
DRAFT_KEYS = ("layers", "vocab_size", "freeze_embeddings", "corpus_fraction")


@dataclass
class DraftSpec(Spec):
    layers: list[int]
    vocab_size: int
    freeze_embeddings: bool
    corpus_fraction: float  # train on the first fraction of each source's completions (corpus-size studies)
    gen: Any  # pardec.training.completions.GenerateConfig: the training completions
    eval_gen: list  # one GenerateConfig per held-out source, each with its own out_dir
    eval_context: int
    eval_repeats: int


@register_kind("draft")
class DraftKind(GeneratesCompletions, Kind):
    name = "draft"
    stages = ("generate", "train", "eval")
    rank0_stages = ("eval",)
    example = "draft_tiny"

    def validate(self, cfg: DictConfig, name: str) -> DraftSpec:
        """Check a draft config before anything heavy loads (the layer range against the target's config when it can
        be read without loading weights, else when the target loads)."""
        from pardec.training.draft.trainer import DraftConfig  # heavy: transformers

        draft, completions, ev = self.sections(cfg, "draft", "completions", "eval")
        known(draft, DRAFT_KEYS, "draft")
        layers = draft.get("layers")
        if not isinstance(layers, list) or not layers or not all(isinstance(i, int) for i in layers):
            raise ConfigError(f"draft.layers={layers!r} is not valid: give a non-empty list of target layer indices")
        vocab_size = draft.get("vocab_size", 8192)
        check_at_least("draft.vocab_size", vocab_size, 2, integer=True)
        fraction = check_fraction(draft.get("corpus_fraction", 1.0), "draft.corpus_fraction")
        gen = generate_config(completions, "completions")
        context, repeats = int(ev.pop("context", 200)), int(ev.pop("repeats", 20))
        if context < 2 or repeats < 1:
            raise ConfigError(f"eval.context={context} / eval.repeats={repeats} out of range: need >= 2 / >= 1")
        common = common_fields(cfg, name, DraftConfig, no_zero3=NO_ZERO3)
        check_layers(layers, common["model"], "draft.layers")
        return DraftSpec(**common, layers=layers, vocab_size=vocab_size,
                         freeze_embeddings=bool(draft.get("freeze_embeddings", True)),
                         corpus_fraction=fraction, gen=gen,
                         eval_gen=eval_sources(ev), eval_context=context, eval_repeats=repeats)

    def stage_train(self, spec: DraftSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.draft.trainer import train_draft  # heavy: transformers

        return train_draft(spec, run_dir, ranks)

    def stage_eval(self, spec: DraftSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.draft.trainer import evaluate_draft  # heavy: transformers

        result = evaluate_draft(spec, run_dir)
        print(json.dumps(result, indent=2))
        return result
