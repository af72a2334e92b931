"""The drafter types' model side, one registry: ``drafter.type`` = drafter.json's ``kind`` -> the model class.

Each registered class (``@register_drafter("<type>")``) is a ``torch.nn.Module`` with

* ``kind`` (its type name), ``k`` (drafter.json's ``k``) and ``meta()`` (what drafter.json needs to rebuild it);
* ``fresh(base_config, target, options)`` (a classmethod): an untrained drafter for a target with ``base_config``;
  ``target``: :class:`TargetParts`, what of the target a type starts from (its LM head, its embedding), and
  ``options`` the type's settings (the ``drafter`` section's keys it reads, e.g. ``num_heads``, ``layers``);
* ``from_section(base_config, options, target=None)`` (a classmethod): the same from a ``drafter`` config section (the
  one mapping of its keys to the options; without ``target`` a memory plan builds it on the meta device);
* ``from_saved(meta, state, base_config)`` (a classmethod): the module shaped as drafter.json says, before
  ``state`` (its safetensors) is loaded into it (a type whose buffers shape it reads them from ``state``).

:func:`pardec.models.drafters.new_drafter` and :func:`~pardec.models.drafters.load_drafter` look the type up here and
name no type. The built-in types register when their modules are imported (:data:`BUILTIN`, on first lookup); a
plug-in type registers from its own module, imported before the lookup.

A type that can be served by other engines also registers an :class:`Exporter` (``@register_exporter("<type>")``:
the published layouts it writes, its config and expected tensor shapes read from a saved drafter, the files of each
layout and the serving commands); ``python -m pardec.export`` looks it up (:data:`EXPORT_BUILTIN`).
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
EXPORTERS: Registry[Exporter] = Registry("drafter export")
#: the modules of the built-in exporters, imported on first lookup
EXPORT_BUILTIN = ("pardec.models.eagle_export", "pardec.models.dflash_export")


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


def _import(modules: tuple[str, ...]) -> None:
    for module in modules:
        importlib.import_module(module)


def drafter_class(name: Any, key: str = "drafter.type") -> type:
    """The model class of drafter type ``name``; one line naming the valid types for another."""
    _import(BUILTIN)
    try:
        return DRAFTER_MODELS.get(str(name))
    except UnknownNameError:
        raise ConfigError(f"{key}={name!r} is not valid; choose one of: {', '.join(drafter_types())}") from None


def drafter_types() -> list[str]:
    """Every registered drafter type, sorted."""
    _import(BUILTIN)
    return DRAFTER_MODELS.names()


class Exporter:
    """How a drafter type is written in the layouts other engines serve (``python -m pardec.export``)."""

    formats: tuple[str, ...] = ()  # the layouts (``--format``) it writes

    def config(self, meta: dict, state: dict) -> tuple[Any, dict[str, tuple]]:
        """(its config from drafter.json, the tensor shapes its state must have); KeyError, TypeError or ValueError
        when the saved drafter does not load."""
        raise NotImplementedError

    def write(self, meta: dict, state: dict, config, fmt: str, *, verifier: str | None, architectures: list[str],
              speculative_tokens: int | None, with_embeddings, notes: list[str]) -> tuple[dict, dict, int]:
        """(the weights to write, config.json, draft tokens per step) of layout ``fmt``; every check first (one
        line), notes on what a serving engine will not read appended to ``notes``."""
        raise NotImplementedError

    def describe(self, config) -> str:
        """What the "wrote ..." line says of the export (its shape)."""
        return ""

    def serve(self, out, target: str, fmt: str, n: int) -> list[str]:
        """The commands that serve the export ``out`` beside ``target`` with ``n`` draft tokens per step."""
        return []


def register_exporter(name: str):
    """Class decorator: register a drafter type's :class:`Exporter` (an instance) under the type's name."""

    def deco(cls: type) -> type:
        EXPORTERS.add(name, cls())
        return cls

    return deco


def exporter(name: str) -> Exporter | None:
    """The exporter of drafter type ``name`` (None: the type is not exported)."""
    _import(EXPORT_BUILTIN)
    return EXPORTERS.get(name) if name in EXPORTERS else None


def exported_types() -> list[str]:
    """Every drafter type with an exporter, sorted."""
    _import(EXPORT_BUILTIN)
    return EXPORTERS.names()
