"""``cache="dynamic"``: transformers' ``DynamicCache`` (a concatenation per forward) with the verbs CachedModel
needs, so the seam runs either cache through one interface (:mod:`pardec.models.cache`). Kept for comparison and for
models with non-attention layers, which the preallocated cache does not hold."""

from __future__ import annotations

import torch
from transformers import DynamicCache


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` [B, H, L, D] with ``n`` zero positions prepended."""
    return torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2) if n else t


def held_layers(cache) -> list:
    """The layers of ``cache`` (either kind) that hold keys, each [B, H, L, D]."""
    layers = [lc for lc in cache.layers if getattr(lc, "keys", None) is not None and lc.keys.dim() == 4]
    if layers and len(layers) != len(cache.layers):
        raise TypeError(f"rows can only move between caches whose layers all hold [B, H, L, D] keys; got "
                        f"{type(cache.layers[0]).__name__}")
    return layers


class DynamicRows(DynamicCache):
    """``DynamicCache`` plus :meth:`keep`, :meth:`drop_after`, :meth:`take_rows`, :meth:`join_rows`."""

    #: positions a call drops right after it (the preallocated cache then stores nothing there); a dynamic cache
    #: appends them and :meth:`drop_after` cuts them
    transient_from: int | None = None

    @property
    def initialized(self) -> bool:
        return bool(self.initialized_layers())

    def reuse(self, old) -> None:
        """(The preallocated cache keeps its buffers from prompt to prompt; here there is nothing to keep.)"""

    def initialized_layers(self) -> list:
        return held_layers(self)

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions ``start + idx`` (``idx`` increasing, on the host) of those from ``start`` on."""
        on: dict[torch.device, torch.Tensor] = {}  # layers of a split model (device_map) sit on several devices
        for layer in self.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                at = on.setdefault(t.device, start + idx.to(t.device))
                setattr(layer, name, torch.cat([t[..., :start, :], t[..., at, :]], dim=-2))

    def drop_after(self, n: int) -> None:
        """Cut every layer's keys/values to the first ``n`` positions, as detached views: no view of a graph stays in
        the cache (a checkpoint's recompute would reach back into the forward's graph through one)."""
        for lc in self.layers:
            if lc.keys is not None and lc.keys.shape[-2] > n:
                lc.keys, lc.values = lc.keys[..., :n, :].detach(), lc.values[..., :n, :].detach()

    def take_rows(self, rows: list[int], config) -> DynamicRows:
        """Batch ``rows`` leave into a new cache (built from ``config``); this one keeps the other rows, in order."""
        mine = self.initialized_layers()
        other = DynamicRows(config=config)
        if len(other.layers) < len(mine):
            raise TypeError(f"a fresh cache has {len(other.layers)} layers, this one holds {len(mine)}")
        rest = [i for i in range(mine[0].keys.shape[0]) if i not in set(rows)] if mine else []
        idx, keep = torch.tensor(rows, dtype=torch.long), torch.tensor(rest, dtype=torch.long)
        for src, dst in zip(mine, other.layers):
            k, v = src.keys, src.values
            dst.lazy_initialization(k, v)
            dst.keys, dst.values = k[idx.to(k.device)], v[idx.to(v.device)]
            src.keys, src.values = k[keep.to(k.device)], v[keep.to(v.device)]
        return other

    def join_rows(self, other, pad_self: int, pad_other: int) -> None:
        """Append ``other``'s rows (either kind of cache; consumed), left-padding the shorter side with zero
        keys/values."""
        for a, b in zip(held_layers(self), held_layers(other), strict=True):
            for name in ("keys", "values"):
                x, y = _left_pad(getattr(a, name), pad_self), _left_pad(getattr(b, name), pad_other)
                setattr(a, name, torch.cat([x, y.to(x.device)], dim=0))
