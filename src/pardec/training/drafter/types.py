"""The drafter types' training side, one registry: ``drafter.type`` -> a :class:`DrafterType`.

A type declares its ``drafter`` keys as an options dataclass (:attr:`DrafterType.options`: a field per key with its default
and help text, its checks in ``__post_init__``; validated by :func:`~pardec.config.to_dataclass` before anything
loads, defaults filled), builds the
drafter a run trains (from the frozen target and the training corpus), and what its collator, trainer options,
training facts and held-out evaluation are. The kind (:mod:`pardec.training.drafter`) and the train and eval stages
(:mod:`.trainer`) look the type up and name none. Its model (construction from options, save/load) is
registered in :mod:`pardec.models.drafter_types` under the same name.

Built-in types: ``medusa`` (:mod:`.medusa`), ``firp`` (:mod:`.firp`), ``eagle3`` (:mod:`.eagle`), ``dflash``
(:mod:`.dflash`), registered when their modules are imported (:data:`BUILTIN`, on first lookup).
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, fields
from typing import Any, ClassVar

from pardec.config import ConfigError, is_int, to_dataclass
from pardec.registry import Registry, UnknownNameError
from pardec.training.drafter.batches import RightPadCollator, term_count
from pardec.training.kinds import check_layers

TYPES: Registry[DrafterType] = Registry("drafter type")
BUILTIN = ("pardec.training.drafter.medusa", "pardec.training.drafter.firp", "pardec.training.drafter.eagle",
           "pardec.training.drafter.dflash")
#: keys every type's ``drafter`` section may hold besides ``type`` and its own
COMMON_KEYS = ("corpus_fraction", "init_from", "feature_cache")


class DrafterType:
    """One drafter type's training side (the defaults: a drafter of heads ranked at every depth, as Medusa and
    FIRP are; EAGLE-3 and DFlash, which draft a chain from the target's states, set ``chain``)."""

    name: ClassVar[str]
    #: its options: a dataclass with a field per ``drafter`` key it reads (default, ``metadata["help"]``), checked in
    #: its ``__post_init__``
    options: ClassVar[type]
    #: held-out evaluation: a chain's acceptance by position (True) or the ranks of the true future tokens at every
    #: depth and trees searched on them (False)
    chain: ClassVar[bool] = False
    #: what its per-depth training loss in the logs is: a KL to the target ("kl") or a cross-entropy ("ce")
    logged_loss: ClassVar[str] = "kl"
    #: the divergence of the depth loss when ``drafter.distance`` does not say (``fkl``: KL(target || drafter))
    default_distance: ClassVar[str] = "fkl"
    #: held-out attention views (FIRP: what a pseudo state sees; None: the drafter's only one) and their names
    eval_views: ClassVar[tuple] = (None,)
    view_names: ClassVar[dict] = {}
    #: trains on the frozen target's states at chosen layers (:func:`~pardec.training.drafter.target.target_pass`), so
    #: ``drafter.feature_cache`` can keep them (EAGLE-3, DFlash); Medusa and FIRP read the target's logits at every depth
    reads_target_states: ClassVar[bool] = False

    # -- config (validate: before anything loads) ------------------------------------------------------------
    @property
    def keys(self) -> tuple[str, ...]:
        """The ``drafter`` keys the type reads: its options' fields."""
        return tuple(f.name for f in fields(self.options))

    def check(self, options: dict) -> None:
        """Check the ``drafter`` section's keys of this type against its options (types, ranges, choices; one line naming a bad
        value) and fill in their defaults."""
        opts = to_dataclass(self.options, {k: options[k] for k in self.keys if k in options}, "drafter")
        options.update(asdict(opts))

    def check_target(self, options: dict, model) -> None:
        """Check the ``drafter`` section against the target (``model``: its ModelConfig) where that needs no weights: by default
        its ``layers``, where set, are layers of the target."""
        if options.get("layers") is not None:
            check_layers(options["layers"], model, "drafter.layers")

    # -- training ------------------------------------------------------------------------------------------
    def new(self, spec, base, lm, records: list[dict]) -> tuple[Any, dict]:
        """(a fresh drafter for ``base``, the facts of its making that drafter.json keeps); ``lm``: the loaded
        target (its tokenizer and EOS ids), ``records``: the training completions."""
        raise NotImplementedError

    def fresh_on_continue(self, drafter, prior) -> set[str]:
        """The tensors of a fresh ``drafter`` that ``drafter.init_from``'s trained ``prior`` does not hold and that
        keep their fresh values (none by default: every tensor must match)."""
        return set()

    def collator(self, pad_id: int, options: dict, seed: int):
        return RightPadCollator(pad_id)

    def callbacks(self, collator) -> list:
        """Trainer callbacks the type's training needs (none by default)."""
        return []

    def needs_target_logits(self, options: dict) -> bool:
        """Whether the loss reads the target's logits (a feature cache then keeps its final state too)."""
        return True

    def trainer_options(self, options: dict, head_decay: float) -> dict[str, Any]:
        """Keyword arguments of :class:`~pardec.training.drafter.trainer.DrafterTrainer` for this type."""
        return {}

    def facts(self, options: dict, head_decay: float) -> dict[str, Any]:
        """The training settings drafter.json records beside the run's facts."""
        return {}

    def loss_k(self, drafter, trainer) -> int:
        """The terms per anchor the loss has (and the logs: one loss and agreement per depth): the drafter's K."""
        return drafter.k

    def depth_weights(self, k: int, head_decay: float) -> list[float]:
        """The weight of each depth's loss (1 each by default)."""
        return [1.0] * k

    def window_count(self, batches: list[dict], k: int) -> int:
        """The loss's normaliser over an accumulation window: its (position, depth) terms."""
        return sum(term_count(b["loss_mask"], k) for b in batches)

    def loss(self, trainer, model, drafter, inputs: dict, return_outputs: bool, num_items_in_batch):
        """The training loss of a batch (:meth:`DrafterTrainer.compute_loss`): by default the depth loss of heads
        ranked at every depth (:meth:`~pardec.training.drafter.trainer.DrafterTrainer.depth_loss`)."""
        return trainer.depth_loss(model, drafter, inputs, return_outputs, num_items_in_batch)

    def depth_logits(self, base, call, drafter, ids, anchors, *, training: bool, attention: str | None = None,
                     checkpoint: bool = False):
        """(the target's logits at ``anchors`` [B, A, V] (detached), the drafter's [B, A, K, V]) for the depth loss
        and the held-out ranks; ``call``: the (possibly wrapped) module to call, ``drafter`` the bare one."""
        raise NotImplementedError


def register_drafter_type(cls: type[DrafterType]) -> type[DrafterType]:
    """Class decorator: register a type's training side under ``cls.name``."""
    TYPES.add(cls.name, cls())
    return cls


def drafter_type(name: Any) -> DrafterType:
    """The training side of drafter type ``name``; one line naming the valid types for another."""
    for module in BUILTIN:
        importlib.import_module(module)
    try:
        return TYPES.get(str(name))
    except UnknownNameError:
        raise ConfigError(f"drafter.type={name!r} is not valid; choose one of: {', '.join(TYPES.names())}") from None


def check_layer_list(layers: Any, what: str) -> list[int]:
    """``drafter.layers`` as a non-empty list of layer indices; ``what``: what the layers are, for the error."""
    if not isinstance(layers, list) or not layers or not all(is_int(i) for i in layers):
        raise ConfigError(f"drafter.layers={layers!r} is not valid: give a non-empty list of target layer indices "
                          f"({what})")
    return layers
