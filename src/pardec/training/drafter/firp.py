"""``drafter.type: firp``: FIRP's projections (Wu et al. 2024; the model: :class:`pardec.models.heads.FirpProjections`),
one per pseudo step, each reading the state entering its target layer (``layers``: nondecreasing), trained on the
target's completions with the divergence ``distance`` (the paper's Eq. 4: ``rkl``) under ``attention`` (what the
pseudo states see: §3.3's ``real``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pardec.config import ConfigError, check_choice
from pardec.models.cached import CachedModel
from pardec.models.heads import FirpProjections
from pardec.models.pseudo import DECODING_ATTENTION, PSEUDO_ATTENTION, forward_pseudo
from pardec.training.drafter.types import DrafterType, check_layer_list, register_drafter_type

#: FIRP's loss, per (anchor, step): KL(P~ || P) with P~ the pseudo state's distribution and P the target's at the
#: same future position (paper Eq. 4: ``rkl`` in :func:`pardec.training.losses.token_divergence`'s naming, where the
#: student is q); ``fkl``: KL(P || P~), pardec's earlier choice (Medusa's self-distillation direction)
FIRP_DISTANCES = ("rkl", "fkl")


@dataclass
class FirpOptions:
    layers: list[int] | None = field(default=None, metadata={
        "help": "the target layer each pseudo step's projection reads the state entering (nondecreasing; required)"})
    attention: str = field(default="real", metadata={
        "help": "what a pseudo state sees in training (PSEUDO_ATTENTION; the paper's §3.3: real)"})
    distance: str = field(default="rkl", metadata={"help": "the depth loss's divergence (FIRP_DISTANCES; Eq. 4: rkl)"})

    def __post_init__(self) -> None:
        layers = check_layer_list(self.layers, "one per pseudo step")
        if layers != sorted(layers):
            raise ConfigError(f"drafter.layers={layers} is not valid: the layers must be nondecreasing")
        check_choice("drafter.attention", self.attention, PSEUDO_ATTENTION)
        check_choice("drafter.distance", self.distance, FIRP_DISTANCES)


@register_drafter_type
class FirpType(DrafterType):
    name = "firp"
    options = FirpOptions
    default_distance = "rkl"  # Eq. 4: KL(q || p)
    # held out in both views a pseudo state can have at decoding (FIRP §4.3 / Fig. 7), decoding's first
    eval_views = (DECODING_ATTENTION, *(a for a in PSEUDO_ATTENTION if a != DECODING_ATTENTION))
    view_names = {"pseudo": "No masked", "real": "Masked"}

    def new(self, spec, base, lm, records: list[dict]) -> tuple[Any, dict]:
        return FirpProjections.from_section(base.config, spec.drafter), {}

    def trainer_options(self, options: dict, head_decay: float) -> dict[str, Any]:
        return {"distance": options["distance"]}

    def facts(self, options: dict, head_decay: float) -> dict[str, Any]:
        return {"distance": options["distance"]}

    def depth_logits(self, base, call, drafter, ids, anchors, *, training: bool, attention: str | None = None,
                     checkpoint: bool = False):
        """Each anchor's pseudo states through the target's upper layers (:func:`forward_pseudo`): in training
        under the attention the drafter was trained for (``real``: teacher-forced) with the upper layers
        recomputed in backward under ``checkpoint``; held out under decoding's conditions (no real token after the
        anchor) in the view ``attention`` (default: decoding's)."""
        cm = CachedModel(base)
        if training:
            out = forward_pseudo(cm, ids, call, drafter.layers, anchors=anchors, logits_at=anchors, split=True,
                                 attention=drafter.attention, teacher_forced=drafter.attention == "real",
                                 checkpoint=checkpoint)
        else:
            out = forward_pseudo(cm, ids, call, drafter.layers, anchors=anchors, logits_at=anchors,
                                 attention=attention or DECODING_ATTENTION)
        return out.logits.detach(), cm.lm_head(out.pseudo)
