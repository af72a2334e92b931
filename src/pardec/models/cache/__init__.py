"""KV caches for :class:`~pardec.models.cached.CachedModel`, one interface (``cache=``, :data:`KV_CACHES`):

* :class:`~pardec.models.cache.preallocated.PreallocatedCache` (``preallocated``, the default): buffers written in
  place, growing by doubling; truncation moves a length; rows move without copying the others where they can;
* :class:`~pardec.models.cache.dynamic.DynamicRows` (``dynamic``): transformers' ``DynamicCache``.

Both are transformers ``Cache`` objects (a model's forward takes either) with the verbs the seam calls:
``initialized``, ``reuse(old)``, ``keep(start, idx)``, ``drop_after(n)``, ``take_rows(rows, config)``,
``join_rows(other, pad_self, pad_other)``, ``crop(-n)``, ``get_seq_length()`` and the ``transient_from``
attribute (positions a call drops right after it).

Why preallocated by default: it writes new keys in place, truncates by moving a length, compacts only the kept
positions and moves batch rows without copying the others where it can, where ``DynamicCache`` concatenates per
forward (kept for comparison and for models with non-attention layers); why not transformers' ``StaticCache``:
:mod:`pardec.models.cache.preallocated`."""

from __future__ import annotations

from transformers.cache_utils import Cache

from pardec.config import KV_CACHES
from pardec.models.cache.dynamic import DynamicRows
from pardec.models.cache.preallocated import PreallocatedCache, to_device

__all__ = ["KV_CACHES", "DynamicRows", "PreallocatedCache", "new_cache", "to_device"]

_KINDS = {"preallocated": PreallocatedCache, "dynamic": DynamicRows}
assert tuple(_KINDS) == KV_CACHES  # one list of names (the config's), one implementation per name


def new_cache(kind: str, config) -> Cache:
    """An empty cache of ``kind`` for a model of ``config``."""
    if kind not in _KINDS:
        raise ValueError(f"cache={kind!r} is not valid; choose one of: {', '.join(KV_CACHES)}")
    return _KINDS[kind](config=config)
