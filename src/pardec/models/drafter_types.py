"""The drafter types' model side, one registry: ``heads.type`` = drafter.json's ``kind`` -> the model class.

Each registered class (``@register_drafter("<type>")``) is a ``torch.nn.Module`` with

* ``kind`` (its type name), ``k`` (drafter.json's ``k``) and ``meta()`` (what drafter.json needs to rebuild it);
* ``fresh(base_config, target, options)`` (a classmethod): an untrained drafter for a target with ``base_config``;
  ``target``: :class:`TargetParts`, what of the target a type starts from (its LM head, its embedding), and
  ``options`` the type's settings (the ``heads`` section's keys it reads, e.g. ``num_heads``, ``layers``);
* ``from_heads(base_config, heads)`` (a classmethod): the same from a ``heads`` config section alone, without the
  target's weights or a corpus (a memory plan builds it on the meta device);
* ``from_saved(meta, state, base_config)`` (a classmethod): the module shaped as drafter.json says, before
  ``state`` (its safetensors) is loaded into it (a type whose buffers shape it reads them from ``state``).

:func:`pardec.models.heads.new_drafter` and :func:`~pardec.models.heads.load_drafter` look the type up here and
name no type. The built-in types register when their modules are imported (:data:`BUILTIN`, on first lookup); a
plug-in type registers from its own module, imported before the lookup.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from torch import nn

from pardec.config import ConfigError
from pardec.registry import Registry, UnknownNameError

DRAFTER_MODELS: Registry[type] = Registry("drafter type")
#: the modules of the built-in types, imported on first lookup
BUILTIN = ("pardec.models.heads", "pardec.models.eagle", "pardec.models.dflash")


@dataclass
class TargetParts:
    """What of the target a fresh drafter may start from (None: start without it)."""

    lm_head: nn.Linear | None = None
    embed: nn.Embedding | None = None


def register_drafter(name: str):
    """Class decorator: register a drafter model class under its type name (also its ``kind``)."""

    def deco(cls: type) -> type:
        if getattr(cls, "kind", None) != name:
            raise ValueError(f"drafter class {cls.__name__} registers as {name!r} but its kind is "
                             f"{getattr(cls, 'kind', None)!r}")
        DRAFTER_MODELS.add(name, cls)
        return cls

    return deco


def only(options: dict[str, Any], kind: str, allowed: tuple[str, ...]) -> dict[str, Any]:
    """``options`` of a fresh drafter of type ``kind``, refused in one line when one is not the type's."""
    bad = sorted(set(options) - set(allowed))
    if bad:
        raise ConfigError(f"a {kind} drafter has no option(s) {bad}; its options: {', '.join(allowed)}")
    return options


def _builtins() -> None:
    for module in BUILTIN:
        importlib.import_module(module)


def drafter_class(name: Any, key: str = "heads.type") -> type:
    """The model class of drafter type ``name``; one line naming the valid types for another."""
    _builtins()
    try:
        return DRAFTER_MODELS.get(str(name))
    except UnknownNameError:
        raise ConfigError(f"{key}={name!r} is not valid; choose one of: {', '.join(drafter_types())}") from None


def drafter_types() -> list[str]:
    """Every registered drafter type, sorted."""
    _builtins()
    return DRAFTER_MODELS.names()
