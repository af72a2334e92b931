"""The cached-model seam: the only module that touches transformers' KV cache and mask internals.

Every decoder talks to the target (and draft) model through :class:`CachedModel`'s verbs:

* ``prefill(ids)``                          -> logits of the last prompt position
* ``forward(ids, positions, attend, ...)``  -> logits of every new position, appended to the cache
* ``truncate(length)``                      -> drop cached positions past ``length``
* ``keep(indices)``                         -> keep a subset of the last-appended positions (tree paths)
* ``length``                                -> cached positions

Facts this file relies on (transformers 5.2x): a 4D attention mask must be an *additive* float mask
(0 where attended, ``finfo.min`` elsewhere) passed with explicit ``position_ids`` (a bool mask is silently
wrong under eager attention); ``DynamicCache.crop(-n)`` removes ``n`` positions (positive values raise).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T, V] (or [B, 1, V] when only the last position was asked for)
    hidden_states: tuple[torch.Tensor, ...] | None = None  # per layer, [B, T, H], embeddings first


class CachedModel:
    """An HF causal LM plus its KV cache. Batch size is fixed by the first forward after a reset."""

    def __init__(self, model: PreTrainedModel):
        self.model = model.eval()
        self.config = model.config
        self.cache = DynamicCache(config=model.config)
        self._last_appended = 0  # positions appended by the most recent forward (for ``keep``)

    # ---------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    # ---------------------------------------------------------------- verbs
    def reset(self) -> None:
        self.cache = DynamicCache(config=self.config)
        self._last_appended = 0

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Reset the cache and run the prompt ``ids`` [B, T]; returns logits of the last position [B, V]."""
        self.reset()
        out = self.forward(ids, last_only=True)
        return out.logits[:, -1]

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
        key_valid: torch.Tensor | None = None,
        last_only: bool = False,
        hidden_states: bool = False,
    ) -> ForwardOut:
        """Run new tokens ``ids`` [B, T] after the cached ones and append them to the cache.

        positions: [B, T] or [T] absolute positions; default ``length .. length+T-1``.
        attend:    bool [T, T] or [B, T, T], ``attend[i, j]`` = new token i sees new token j (a tree mask);
                   default causal. Every new token always sees every cached position that is valid.
        key_valid: bool [B, length+T], False for padding positions nobody may attend to.
        """
        ids = ids.to(self.device)
        if ids.dim() == 1:
            ids = ids[None]
        bsz, t = ids.shape
        past = self.length
        if positions is None:
            positions = torch.arange(past, past + t, device=self.device)
        positions = positions.to(self.device)
        if positions.dim() == 1:
            positions = positions[None].expand(bsz, t)
        kwargs = {}
        if attend is not None or key_valid is not None:
            kwargs["attention_mask"] = self._additive_mask(bsz, t, past, attend, key_valid)
        if last_only:
            kwargs["logits_to_keep"] = 1
        out = self.model(
            input_ids=ids,
            position_ids=positions,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=hidden_states,
            **kwargs,
        )
        self.cache = out.past_key_values
        self._last_appended = t
        return ForwardOut(out.logits, out.hidden_states if hidden_states else None)

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        n_remove = self.length - length
        if n_remove < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if n_remove:
            self.cache.crop(-n_remove)
        self._last_appended = max(0, self._last_appended - n_remove)

    def keep(self, indices: torch.Tensor | list[int]) -> None:
        """Keep only ``indices`` (relative, increasing) of the positions appended by the last forward.

        Used after a tree verification: the accepted path's positions are moved to the front, in order.
        """
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.device)
        n = self._last_appended
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"keep indices {idx.tolist()} out of range for {n} last-appended positions")
        start = self.length - n
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name)
                setattr(layer, name, torch.cat([t[..., :start, :], t[..., start + idx, :]], dim=-2))
        self._last_appended = idx.numel()

    # ---------------------------------------------------------------- masks
    def _additive_mask(
        self,
        bsz: int,
        t: int,
        past: int,
        attend: torch.Tensor | None,
        key_valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """[B, 1, T, past+T] additive float mask: 0 = attend, finfo.min = masked."""
        dev = self.device
        if attend is None:
            attend = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        attend = attend.to(dev, torch.bool)
        if attend.dim() == 2:
            attend = attend[None].expand(bsz, t, t)
        allowed = torch.cat([torch.ones(bsz, t, past, dtype=torch.bool, device=dev), attend], dim=-1)
        if key_valid is not None:
            allowed = allowed & key_valid.to(dev, torch.bool)[:, None, :]
        # a fully masked row (a padding query) would give NaNs; let it see itself
        diag = torch.arange(t, device=dev)
        allowed[:, diag, past + diag] |= ~allowed.any(-1)
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev)
        mask.masked_fill_(~allowed, torch.finfo(self.dtype).min)
        return mask[:, None]
