"""The KV cache's name in transformers' signatures, whichever release pardec runs on.

transformers 5.24 renamed the cache argument of every model and decoder layer, and the cache field of every model
output, from ``past_key_values`` to ``cache``; the old name still works there but logs a deprecation warning and is
removed in 5.40. pardec supports ``transformers>=5.20`` (pyproject), so the name is read off the callee's own
signature (once per class) instead of a version check: the same code runs on 5.20–5.23 (``past_key_values``) and
on 5.24+ (``cache``), and on a custom model class whichever name its ``forward`` declares.

Other facts of transformers 5.2x that :mod:`pardec.models.cached` relies on: a 4D attention mask must be an
*additive* float mask (0 where attended, ``finfo.min`` elsewhere) passed with explicit ``position_ids`` (a bool mask
is silently wrong under eager attention); ``DynamicCache.crop(-n)`` removes ``n`` positions (positive values raise);
``logits_to_keep`` takes an int (the last n) or a tensor of positions; Llama-style models keep their decoder layers
in ``model.model.layers`` with ``model.model.norm``, ``model.model.rotary_emb`` and ``model.lm_head``.
"""

from __future__ import annotations

import functools
import inspect

import torch

NEW, OLD = "cache", "past_key_values"


@functools.cache
def _forward_takes(cls: type) -> str:
    params = inspect.signature(cls.forward).parameters  # follows functools.wraps (deprecate_kwarg) to the real one
    return NEW if NEW in params else OLD


def cache_kwarg(module: torch.nn.Module) -> str:
    """The keyword under which ``module``'s forward takes the KV cache: ``"cache"`` or ``"past_key_values"``."""
    return _forward_takes(type(module))


def cache_kw(module: torch.nn.Module, cache) -> dict:
    """``{name: cache}`` for ``module(**cache_kw(module, cache), ...)``."""
    return {cache_kwarg(module): cache}


def output_cache_field(output_cls: type) -> str:
    """The name of ``output_cls``'s cache field (``cache`` on 5.24+, ``past_key_values`` before)."""
    return NEW if NEW in getattr(output_cls, "__dataclass_fields__", {}) else OLD


def output_cache(out):
    """The KV cache a model output carries."""
    return getattr(out, output_cache_field(type(out)))
