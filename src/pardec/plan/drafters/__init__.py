"""The memory-plan terms of each drafter type a ``drafter`` recipe trains, one module per type in this package, each
registering a function ``terms(h, a, tokens, seq, b, act_bytes, run_bytes, eager, ckpt) -> DrafterTerms`` under its
``drafter.type`` (``@plan_terms("<type>")``). Every module here is imported on first lookup: a new type's terms are a
new file, no edit to the plan (:mod:`pardec.plan.plans` names no type)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from pardec.config import ConfigError
from pardec.registry import Registry

PLAN_TERMS: Registry[Callable[..., DrafterTerms]] = Registry("drafter type")


@dataclass
class DrafterTerms:
    """What a drafter's training adds on the device, in bytes: its activations, the loss's logits (the target's
    included), keys/values it keeps, and a note for the plan."""

    activations: float
    logits: float
    kv: float = 0.0
    note: str = ""


def plan_terms(name: str):
    """Decorator: register a drafter type's terms function under ``name``."""

    def deco(fn):
        PLAN_TERMS.add(name, fn)
        return fn

    return deco


def drafter_terms(name) -> Callable[..., DrafterTerms]:
    """The terms function of drafter type ``name``; one line naming the types the plan knows for another."""
    for m in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{m.name}")
    if name not in PLAN_TERMS:
        raise ConfigError(f"drafter.type={name!r} has no memory model in pardec.plan; it knows: "
                          f"{', '.join(PLAN_TERMS.names())}")
    return PLAN_TERMS.get(name)
