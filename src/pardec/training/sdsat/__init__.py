"""Kind ``sdsat``: the model itself fine-tuned to guess several tokens at once from adaptive tokens (SDSAT, Liu et al.
2024; the contract the decoder reads: :mod:`pardec.models.adaptive`), ``python -m train +experiment=sdsat_<name>``.

Stages (``stage=mask|train|eval|all``):

* ``mask``: the masked corpus of ``mask.sources`` in ``mask.out_dir`` (:func:`.masked.run_masking`; tokenizer only,
  no weights; resumable, sharded over ranks);
* ``train``: :class:`~.trainer.SDSATTrainer` (Eq. 9, full fine-tuning or LoRA); the model with its adaptive tokens
  goes to ``<run dir>/final``, loadable with ``python -m evaluate +method=sdsat model=local
  model.path=<run dir>/final``;
* ``eval`` (rank 0): held-out perplexity (base vs trained) and per-depth adaptive-token accuracy on
  ``eval.sources``, into ``<run dir>/sdsat_eval.json``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pardec.config import ConfigError, check_at_least, settings_diff, to_dataclass
from pardec.training.kinds import Kind, Spec, common_fields, known, register_kind

log = logging.getLogger(__name__)

#: keys of the ``adaptive`` and ``eval`` sections of an sdsat experiment
ADAPTIVE_KEYS = ("max_span", "diverse")
SDSAT_EVAL_KEYS = ("sources", "max_docs", "stride", "k_max")


@dataclass
class SDSATSpec(Spec):
    max_span: int  # L: adaptive windows of 1..L tokens
    diverse: bool  # SDSAT-D: one adaptive token per offset
    mask: Any  # pardec.training.sdsat.masked.MaskConfig (its max_span / diverse are the adaptive section's)
    eval_sources: list  # held-out sources, in masked.parse_sources form
    eval_max_docs: int | None  # sequences per held-out source
    eval_stride: int  # anchors every stride positions
    eval_k_max: int  # adaptive slots per anchor (depths 1..k_max)


@register_kind("sdsat")
class SDSATKind(Kind):
    name = "sdsat"
    stages = ("mask", "train", "eval")
    rank0_stages = ("eval",)
    example = "sdsat_tiny"

    def validate(self, cfg: DictConfig, name: str) -> SDSATSpec:
        """Check an sdsat config before anything heavy loads. ``stage=train`` without ``mask`` also checks the masked
        corpus in ``mask.out_dir`` now (finished, this schema version, built with these settings)."""
        from pardec.training.sdsat import masked as mk  # heavy: torch, transformers
        from pardec.training.sdsat.trainer import SDSATConfig  # heavy: torch, transformers

        adaptive, mask, ev = self.sections(cfg, "adaptive", "mask", "eval")
        known(adaptive, ADAPTIVE_KEYS, "adaptive")
        max_span, diverse = adaptive.get("max_span", 5), adaptive.get("diverse", False)
        check_at_least("adaptive.max_span", max_span, 1, integer=True)
        if not isinstance(diverse, bool):
            raise ConfigError(f"adaptive.diverse={diverse!r} is not valid: it must be true or false")
        moved = sorted(set(mask) & set(ADAPTIVE_KEYS))
        if moved:
            raise ConfigError(f"mask.{moved[0]} is not a mask key here: set adaptive.{moved[0]} (the tokens and the "
                              f"windows share it)")
        mask_cfg = to_dataclass(mk.MaskConfig, {**mask, "max_span": max_span, "diverse": diverse}, "mask")
        if not mask_cfg.sources:
            raise ConfigError(f"mask.sources is empty: list at least one of {mk.SOURCE_FORMS}")
        known(ev, SDSAT_EVAL_KEYS, "eval")
        eval_sources = mk.parse_sources(ev.get("sources"), "eval.sources")
        if not eval_sources:
            raise ConfigError(f"eval.sources is empty: list at least one of {mk.SOURCE_FORMS}")
        max_docs, stride, k_max = ev.get("max_docs"), ev.get("stride", 8), ev.get("k_max", max_span)
        check_at_least("eval.max_docs", max_docs, 1, integer=True, or_null=True)
        check_at_least("eval.stride", stride, 1, integer=True)
        check_at_least("eval.k_max", k_max, 1, integer=True)
        if diverse and k_max > max_span:
            raise ConfigError(f"eval.k_max={k_max} is out of range: diverse adaptive tokens exist for depths "
                              f"1..adaptive.max_span={max_span} only")
        common = common_fields(cfg, name, SDSATConfig, lora=True)
        if cfg.stage == "train":
            check_masked(mask_cfg)
        return SDSATSpec(**common, max_span=max_span, diverse=diverse, mask=mask_cfg, eval_sources=eval_sources,
                         eval_max_docs=max_docs, eval_stride=stride, eval_k_max=k_max)

    def stage_mask(self, spec: SDSATSpec, run_dir: Path, ranks) -> dict | None:
        from pardec.models.loading import load_tokenizer_only, model_chat  # heavy: torch, transformers
        from pardec.training.sdsat.masked import run_masking  # heavy: torch, transformers

        barrier = ranks.barrier()
        tok = load_tokenizer_only(spec.model)
        # returns on every rank once rank 0 has merged: every rank may read masked.jsonl then
        stats = run_masking(spec.mask, tok, spec.model.identity(), ranks.rank, ranks.world, barrier,
                            chat=model_chat(spec.model, tok))
        if stats:
            log.info("masked corpus: %s", json.dumps(stats))
        return stats

    def stage_train(self, spec: SDSATSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.sdsat.trainer import train_sdsat  # heavy: torch, transformers

        if spec.stage == "all":
            check_masked(spec.mask)  # what stage=train checks in validate
        return train_sdsat(spec, run_dir, ranks)

    def stage_eval(self, spec: SDSATSpec, run_dir: Path, ranks) -> dict:
        from pardec.training.sdsat.trainer import evaluate_sdsat  # heavy: torch, transformers

        result = evaluate_sdsat(spec, run_dir)
        out = {k: result["overall"][k] for k in ("tokens", "ppl_base", "ppl_trained", "ppl_ratio")}
        adaptive = result["overall"]["adaptive"]
        out.update(accuracy=adaptive["accuracy"], expected_tokens_per_loop=adaptive["expected_tokens_per_loop"])
        print(json.dumps(out, indent=2))
        return out


def check_masked(mask_cfg) -> None:
    """The masked corpus the train stage will read: finished, of this schema version (masked.check_masked_dir) and
    built with the configured masking settings (the model identity and the adaptive ids are checked when the model
    has its tokens)."""
    from pardec.models.adaptive import adaptive_tokens  # heavy: torch, transformers
    from pardec.training.sdsat import masked as mk  # heavy: torch, transformers

    meta = mk.check_masked_dir(mask_cfg.out_dir)
    want = mk.mask_meta(mask_cfg, meta.get("model"), adaptive_tokens(mask_cfg.max_span, mask_cfg.diverse),
                        meta.get("adaptive_ids", []))
    diff = settings_diff(meta, json.loads(json.dumps(want)))
    if diff:
        raise ConfigError(f"{mask_cfg.out_dir} holds a masked corpus built with other settings ({'; '.join(diff)}); "
                          f"rebuild it with stage=mask mask.overwrite=true, or use another mask.out_dir")
