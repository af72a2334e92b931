"""The cached-model seam: the only module that touches transformers' KV cache and mask internals.

Every decoder talks to the target (and draft) model through :class:`CachedModel`'s verbs:

* ``prefill(ids)``                               -> logits of the last prompt position
* ``forward(ids, positions, attend, ...)``       -> logits of the new positions (all, the last, or chosen
  ones), optionally the hidden states entering a chosen layer; the new tokens are appended to the cache
* ``truncate(length)``                           -> drop cached positions past ``length``
* ``keep(indices, start)``                       -> keep a subset of the positions from ``start`` on (default: the
  last-appended ones; tree paths, a chosen beam)
* ``sync(seq)``                                  -> truncate to the common prefix with a committed sequence
  and return the tokens still to feed (a draft model catching up with the target's output)
* ``take_rows(rows)`` / ``join_rows(other)``     -> move batch rows into a new CachedModel / append another's
  rows (the shorter cache left-padded): rows leaving and joining a batch (continuous batching)
* ``length`` / ``tokens`` / ``rows``             -> cached positions / the token ids they hold / batch rows

FIRP's pseudo states and injected hidden states (``forward_pseudo``, ``run_upper``) run over this cache from
:mod:`pardec.models.pseudo`.

Visibility: by default a new token sees every cached position and the new tokens before it. ``attend`` narrows
that: a bool ``[T, T]`` mask among the new tokens (a tree: each token sees its ancestors), or ``[T, length+T]``
over cached and new positions, so that branches an earlier forward left in the cache (several drafts, beams)
stay invisible to each other.

Every forward checks its logits (:mod:`pardec.models.finite`): NaN or inf raises :class:`NonFiniteLogitsError`
naming the model and the position; on an accelerator one call later (when the model is next used: the next forward,
:mod:`pardec.models.pseudo`'s calls, ``prefill``/``reset``, ``tokens``, ``sync``), without a host sync in the
forward; call ``check_finite()`` after the last forward to surface one it produced.

The KV cache (``cache=``): :mod:`pardec.models.cache` (``preallocated`` by default; ``dynamic``). The token ids it
holds stay where they arrived (no copy back to the host per forward); :attr:`CachedModel.tokens` gathers them.

The transformers facts it relies on: :mod:`pardec.models.compat`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from pardec.models import forward as forwards
from pardec.models.cache import new_cache, to_device
from pardec.models.compat import cache_kw, output_cache
from pardec.models.finite import FiniteCheck, NonFiniteLogitsError  # noqa: F401  (raised by check_finite)
from pardec.models.forward.lean import capture_layers, captured, capturing
from pardec.models.masks import FlashAttentionMaskError, additive_mask, allowed, padded  # noqa: F401 (raised)
from pardec.models.tokens import TokenLog


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T', V]: every new position, the last one, or the ``logits_at`` ones
    hidden: torch.Tensor | None = None  # [B, T, H] entering the layer asked for (``hidden_layer``; several: [B, T, n * H])


class CachedModel:
    """An HF causal LM plus its KV cache. Batch size is fixed by the first forward after a reset.

    ``cache``: ``"preallocated"`` or ``"dynamic"`` (module docstring); default :attr:`default_cache`.
    ``forward_impl``: a name of :mod:`pardec.models.forward`'s registry (``hf``, ``lean``, ``compiled``,
    ``cudagraph``) or ``auto``; default :attr:`default_forward_impl`."""

    #: the KV cache a CachedModel gets when ``cache`` is not given
    default_cache = "preallocated"
    #: the forward a CachedModel gets when ``forward_impl`` is not given ("hf" or "lean": :mod:`pardec.models.forward.lean`)
    default_forward_impl = "hf"

    def __init__(self, model: PreTrainedModel, name: str | None = None, cache: str | None = None,
                 forward_impl: str | forwards.Forward | None = None):
        self.model = model.eval()
        self._first = next(model.parameters())
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.cache_kind = cache or self.default_cache
        self.cache = new_cache(self.cache_kind, self.config)  # (checks the name first)
        #: the forward implementation (:mod:`pardec.models.forward`): hf, lean, compiled or cudagraph
        self.impl = forwards.resolve(forward_impl or self.default_forward_impl, model, self.cache_kind, self.name)
        self.forward_impl = self.impl.name
        self._tokens = TokenLog()  # the token ids held by the cache, [rows, length]
        self._last_appended = 0  # positions appended by the most recent forward (for ``keep``)
        self._finite = FiniteCheck()  # NaN/inf in the logits (module docstring)
        #: flash_attention_2 kernels take causal (or padding) masks only: forwards that need a custom one refuse
        self.flash = getattr(model.config, "_attn_implementation", None) == "flash_attention_2"
        #: this machine's forward-cost table (:mod:`pardec.models.cost`): a forward of T > 1 new rows after a cached
        #: prefix is padded to the cheapest row count >= T (None: never padded)
        self.cost = None
        self.padded_rows = 0  # padding rows run so far (a diagnostic: tests read it; summaries do not yet)
        self.graphed_forwards = 0  # multi-row forwards replayed as CUDA graphs (cudagraph; a diagnostic)

    # ---------------------------------------------------------------- properties
    @property
    def device(self) -> torch.device:
        """Where the model's (first) weights are: transformers' ``model.device`` walks the parameters on every read
        (7% of a tiny model's sampling step); the first one is kept instead (a move keeps the Parameter object)."""
        return self._first.device

    @property
    def head_device(self) -> torch.device:
        """Where the final norm and the LM head read their input: ``device`` unless the model is split over several
        devices (``model.device_map``), where it is the last one's."""
        return self.inner().norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @property
    def tokens(self) -> list[int]:
        """Token ids of the cached positions (row 0), in cache order (read back to the host here)."""
        self.check_finite()
        return self._tokens.host()[0].tolist()

    @property
    def rows(self) -> int:
        """Batch rows the cache holds (0 after :meth:`take_rows` took them all; 1 after a reset)."""
        return self._tokens.rows

    @property
    def max_length(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def num_layers(self) -> int:
        return int(self.config.num_hidden_layers)

    # ---------------------------------------------------------------- verbs
    def reset(self) -> None:
        self.check_finite()
        old, self.cache = self.cache, new_cache(self.cache_kind, self.config)
        if self.impl.graphs is not None:
            self.cache.reuse(old)  # (the graphs are keyed by the cache's buffers: keep them from prompt to prompt)
        self._tokens = TokenLog()
        self._last_appended = 0

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteLogitsError` if an earlier forward's logits held NaN/inf (on an accelerator the
        check is deferred to the next use of the model: module docstring). Reads flags the device already copied
        to the host: no wait once the caller has read that forward's logits."""
        self._finite.pending()

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
        logits_at: torch.Tensor | list[int] | None = None,
        hidden_layer: int | tuple[int, ...] | None = None,
    ) -> ForwardOut:
        """Run new tokens ``ids`` [B, T] after the cached ones and append them to the cache.

        positions:    [B, T] or [T] absolute positions; default ``length .. length+T-1``.
        attend:       bool [T, T] / [B, T, T] (new token i sees new token j; cached positions all visible) or
                      [T, length+T] / [B, T, length+T] (over cached and new positions); default causal.
        key_valid:    bool [B, length+T], False for padding positions nobody may attend to.
        last_only:    logits of the last new position only ([B, 1, V]).
        logits_at:    indices of the new positions whose logits are wanted ([B, len, V]); saves the LM head's
                      work on the others.
        hidden_layer: also return the hidden states of every new position entering decoder layer ``hidden_layer``
                      (0 = embeddings; ``num_layers`` = after the final norm, what the LM head reads: Medusa's
                      heads), or of several layers, concatenated on the last dimension in the order given
                      (EAGLE-3's low/mid/high features): [B, T, len * H]. Every forward implementation captures.
        """
        self.check_finite()
        capture = capture_layers(hidden_layer, self.num_layers, self.name)
        if ids.dim() == 1:
            ids = ids[None]
        given = ids  # the token log keeps the caller's ids where they are (host ids: no copy back)
        ids = to_device(ids, self.device)
        bsz, t = ids.shape
        past = self.length
        positions = self.positions_for(positions, bsz, t, past)
        several = t > 1 and past and not last_only  # a verification: several new rows after a cached prefix
        rows = self.impl.pad_to(t) if several else None
        if rows is None and several and self.cost is not None:
            rows = self.cost.cheapest_at_least(t)
        pad = rows - t if rows is not None else 0
        if pad:
            ids, positions, attend, key_valid = padded(ids, positions, attend, key_valid, pad)
        kwargs = {}
        tail_at = None  # split model: the logits_at positions within the kept tail
        width = t + pad  # rows this forward runs
        if attend is not None or key_valid is not None:
            kwargs["attention_mask"] = self._additive_mask(bsz, width, past, attend, key_valid)
        if last_only:
            kwargs["logits_to_keep"] = 1
        elif logits_at is not None:
            at = to_device(torch.as_tensor(logits_at, dtype=torch.long), self.device)
            if self.head_device == self.device:
                kwargs["logits_to_keep"] = at
            else:  # split model: accelerate's hooks move a tensor argument to their device, not the LM head's
                tail = width - int(at.min()) if at.numel() else 1  # (one sync; split models are the 34B+ case)
                kwargs["logits_to_keep"], tail_at = tail, at - (width - tail)
        logits = hidden = None
        mask, keep = kwargs.get("attention_mask"), kwargs.get("logits_to_keep")
        if mask is None and width > 1 and past and self.impl.own:  # causal after a cached prefix
            mask = self._additive_mask(bsz, width, past, None, None)
        if several and tail_at is None:
            out = self.impl.rows(self.model, ids, positions, mask, self.cache, capture, keep)
            if out is not None:
                self.graphed_forwards += self.impl.graphs is not None
                logits, hidden = out if capture is not None else (out, None)
        if logits is None and tail_at is None:
            out = self.impl.logits(self.model, ids, positions, mask, self.cache, keep, capture)
            if out is not None:
                logits, hidden = out if capture is not None else (out, None)
        if logits is None:
            logits, hidden = self._transformers(ids, positions, kwargs, capture)
        if tail_at is not None:
            logits = logits[:, tail_at.to(logits.device)]
            kwargs["logits_to_keep"] = tail_at + (width - kwargs["logits_to_keep"])
        if pad:  # the padding rows leave the cache and their outputs are never read
            self.cache.crop(-pad)
            ids = ids[:, :t]
            if logits_at is None:
                logits = logits[:, :t]
            if hidden is not None:
                hidden = hidden[:, :t]
            self.padded_rows += pad
        self.appended(given, t)
        self.check_logits(logits, past, t, last_only, kwargs.get("logits_to_keep"))
        return ForwardOut(logits, hidden)

    def _transformers(self, ids, positions, kwargs, capture: tuple[int, ...] | None
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The forward's logits through transformers' ``model(...)``, and the hidden states ``capture`` asks for
        (:func:`~pardec.models.forward.lean.capturing`'s hooks, :func:`~pardec.models.forward.lean.captured`'s
        layout)."""
        with capturing(self.inner() if capture else None, capture) as seen:
            out = self.model(input_ids=ids, position_ids=positions, **cache_kw(self.model, self.cache),
                             use_cache=True, **kwargs)
        self.cache = output_cache(out)
        if capture is None:
            return out.logits, None
        return out.logits, captured(seen, seen.get(self.num_layers), capture, self.num_layers)

    def lm_head(self, normed: torch.Tensor) -> torch.Tensor:
        """The LM head on hidden states that went through the final norm (pseudo states of :meth:`forward_pseudo`)."""
        return self.model.lm_head(normed.to(self.device, self.dtype))

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        n_remove = self.length - length
        if n_remove < 0:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if n_remove:
            self.cache.crop(-n_remove)
            self._tokens.truncate(length)
        self._last_appended = max(0, self._last_appended - n_remove)

    def keep(self, indices: torch.Tensor | list[int], start: int | None = None) -> None:
        """Keep only ``indices`` (relative to ``start``, increasing) of the positions from ``start`` on; ``start``
        defaults to the first position appended by the last forward.

        Used after a tree verification (the accepted path's positions move to the front, in order) and after
        several forwards of branches (beams, i.i.d. drafts: ``start`` = where the branches began).
        """
        idx = torch.as_tensor(indices, dtype=torch.long).cpu()  # checked on the host (a device tensor: one read)
        if start is None:
            start = self.length - self._last_appended
        if not 0 <= start <= self.length:
            raise ValueError(f"keep start={start} is out of range for a cache of {self.length} positions")
        n = self.length - start
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise ValueError(f"keep indices {idx.tolist()} out of range for the {n} positions from {start} on")
        if idx.numel() > 1 and bool((idx[1:] <= idx[:-1]).any()):
            raise ValueError(f"keep indices {idx.tolist()} must be strictly increasing")
        self.cache.keep(start, idx)  # (preallocated: copies only the kept positions not yet in place)
        self._tokens.keep(start, idx)
        self._last_appended = idx.numel()

    def take_rows(self, rows: torch.Tensor | list[int]) -> CachedModel:
        """Move batch ``rows`` (their cache and tokens) into a new CachedModel on the same model; this one keeps
        the other rows, in order. Used to park rows that need no more forwards, or to drop finished ones.

        With the preallocated cache the taken rows stay in this cache's buffers (moved in front of the kept ones
        where needed), so taking and joining back costs little (:mod:`pardec.models.cache.preallocated`)."""
        taken = torch.arange(self.rows)[torch.as_tensor(rows, dtype=torch.long).cpu()].tolist()
        if len(set(taken)) != len(taken):
            raise ValueError(f"take_rows: rows {taken} repeat a row")
        rest = [i for i in range(self.rows) if i not in set(taken)]
        # the taken rows run as this model's rows do: same forward implementation, same forward-cost table
        other = CachedModel(self.model, self.name, cache=self.cache_kind, forward_impl=self.impl)
        other.cost = self.cost
        other.cache = self.cache.take_rows(taken, self.config)
        other._tokens, self._tokens = self._tokens.select(taken), self._tokens.select(rest)
        self._last_appended = other._last_appended = 0
        return other

    def join_rows(self, other: CachedModel) -> tuple[int, int]:
        """Append ``other``'s batch rows after this one's (``other`` is consumed). The shorter cache is left-padded
        with zero keys/values to the longer one's length; returns (padding added to this one's rows, to
        ``other``'s rows): positions the caller must mask (``key_valid`` False). An empty or reset cache simply
        takes ``other``'s rows.

        With the preallocated cache, rows that :meth:`take_rows` parked and that come back in the order they left
        join without a copy; other rows are copied once, this cache's own rows only when its buffer has no room
        after them (:mod:`pardec.models.cache.preallocated`)."""
        if self.rows == 0 or not self.cache.initialized:
            self.cache, self._tokens, self._last_appended = other.cache, other._tokens, 0
            return 0, 0
        pad_self, pad_other = max(0, other.length - self.length), max(0, self.length - other.length)
        self.cache.join_rows(other.cache, pad_self, pad_other)
        self._tokens = self._tokens.join(other._tokens, pad_self, pad_other)
        self._last_appended = 0
        other.reset()  # consumed (its rows may now be part of this cache's buffers)
        return pad_self, pad_other

    def confirm(self, accepted: list[int]) -> None:
        """A draft's proposals were verified: of the tokens this model was last fed as device tensors (batch 1: its
        own proposals, fed back without a host read), the first ``len(accepted)`` were accepted and equal
        ``accepted``, and the next one (if fed) was rejected. Keep the accepted ones as host values and drop the
        rest, so the next :meth:`sync` compares on the host without reading the proposals back (one host sync per
        decoding step: the verification's read). A model fed only host tokens since is left alone."""
        start = self._tokens.host_prefix()
        if self.length == start:
            return
        keep = min(len(accepted), self.length - start)
        self.truncate(start + keep)
        self._tokens.settle(start, [int(t) for t in accepted[:keep]])

    def settle(self, values: list[int]) -> None:
        """The last ``len(values)`` cached positions hold ``values`` (batch 1; known on the host, e.g. the tokens of a
        tree path the verification read back): keep them as host values, so a later :meth:`sync` compares without
        reading back what was fed as device tensors."""
        if len(values) > self.length:
            raise ValueError(f"settle: {len(values)} values for a cache of {self.length} positions")
        if values:
            self._tokens.settle(self.length - len(values), [int(t) for t in values])

    def sync(self, seq: list[int] | torch.Tensor) -> list[int]:
        """Make the cache a prefix of ``seq`` (the committed sequence, batch 1): truncate it to the longest
        common prefix and return the tokens of ``seq`` it still lacks (to be fed next).

        At least the last token of ``seq`` is always returned (its logits are what the caller wants), so the
        cache is cut to ``len(seq) - 1`` when it already held all of ``seq``."""
        seq = torch.as_tensor(seq, dtype=torch.long).cpu()
        self.check_finite()
        held = self._tokens.host()[0]
        n = min(held.numel(), seq.numel() - 1)
        diff = (held[:n] != seq[:n]).nonzero()
        common = int(diff[0]) if diff.numel() else n
        self.truncate(common)
        return seq[common:].tolist()

    # ---------------------------------------------------------------- helpers
    def inner(self):
        """The decoder (``model.model``: ``layers``, ``norm``, ``rotary_emb``, ``embed_tokens``) of a Llama-style
        model."""
        inner = getattr(self.model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(self.model, "lm_head"):
            raise TypeError(f"{self.name}: run_upper/hidden_layer need a decoder-only model with "
                            f"model.model.layers and lm_head (Llama-style); got {type(self.model).__name__}")
        return inner

    def positions_for(self, positions, bsz: int, t: int, past: int) -> torch.Tensor:
        """[B, T] absolute positions of ``t`` new tokens on this model's device: ``positions`` ([T] or [B, T]) or,
        when None, those after the ``past`` cached ones."""
        if positions is None:
            positions = torch.arange(past, past + t, device=self.device)
        positions = to_device(torch.as_tensor(positions, dtype=torch.long), self.device)
        if positions.dim() == 1:
            positions = positions[None].expand(bsz, t)
        return positions

    def appended(self, given: torch.Tensor, t: int) -> None:
        """A forward appended the ``t`` new tokens ``given`` to the cache: log them (where they arrived)."""
        self._tokens.append(given.to(torch.long, copy=True))
        self._last_appended = t

    def check_logits(self, logits: torch.Tensor, past: int, t: int, last_only: bool, kept) -> None:
        """NaN/inf in ``logits`` [B, T', V] raise: at once on the CPU; on an accelerator when the model is next used."""
        self._finite.check(logits, self.name, past, t, last_only, kept)

    def additive(self, visible: torch.Tensor) -> torch.Tensor:
        """The additive mask of a [B, T, K] bool visibility, in this model's dtype; refused under flash-attention."""
        return additive_mask(visible, self.dtype, flash_model=self.name if self.flash else None)

    def _additive_mask(self, bsz: int, t: int, past: int, attend: torch.Tensor | None,
                       key_valid: torch.Tensor | None) -> torch.Tensor:
        """[B, 1, T, past+T] additive float mask: 0 = attend, finfo.min = masked."""
        return self.additive(allowed(bsz, t, past, attend, key_valid, self.device))
