"""A preallocated KV cache for :class:`~pardec.models.cached.CachedModel` (the default; ``cache="dynamic"`` picks
transformers' ``DynamicCache``).

Why not ``DynamicCache``: every forward re-concatenates each layer's whole cache with the new keys (a copy of the
cache per layer per forward), and compaction, rows leaving and rows joining copy it again. Why not transformers'
``StaticCache``: its length is fixed up front (no growth), it makes every forward attend over the whole buffer
(``get_mask_sizes`` returns the capacity, so masks must be materialised and empty slots are computed on), and it has
no crop, compaction or row moves. Here:

* each layer owns key/value buffers ``[rows, heads, capacity, dim]``, created on the first update on the device and
  dtype of that layer's keys (a model split over GPUs gets per-layer buffers on each); new keys are written in place
  and attention reads the view ``[:, :, begin : begin + length]`` (the same shapes as ``DynamicCache``, so the
  model computes the same thing); capacity grows by doubling when exceeded (a copy, rarely);
* :meth:`PreallocatedCache.crop` (``truncate``) only moves the length;
* :meth:`PreallocatedCache.keep` copies only the kept positions from ``start`` on that are not already in place,
  never the prefix; dropping the first positions (``start=0`` and a contiguous run) moves ``begin`` instead;
* rows leaving / joining a batch (:meth:`PreallocatedCache.take_rows` / :meth:`join_rows`): the rows of several
  caches may share one buffer. Attention needs a batch's rows contiguous and in batch order, so a slot map per row
  would cost a gather of the whole cache per forward; instead each cache owns a contiguous row range of the buffer.
  ``take_rows`` reorders the range in place to [taken rows | kept rows] (copying only rows that are not already in
  that place, cached positions only), and the taken rows become a cache of their own over the same buffer, without
  a copy. ``join_rows`` is free when the joining rows sit right after this cache's range with their positions
  aligned (rows parked by ``take_rows`` that come back in the order they left, as CLLM collection does); otherwise
  it copies the joining rows only (into free rows after this range), moving this cache's own rows only when the
  buffer has no free rows after them (then to the buffer's start if free, else to a new buffer). Rows are free when
  no live cache holds them (holders are tracked with weak references);
* keys that require grad (training through ``forward_pseudo``) are stored detached and attention gets the
  concatenation ``DynamicCache`` would give, so no buffer ever joins an autograd graph; positions at or past
  ``transient_from`` (FIRP's pseudo states, ``run_upper``'s injected ones: dropped right after) are then not
  stored at all.

Only attention layers are supported (full or sliding-window attention: the masks apply the window, the cache keeps
every position); a model with other layer types (linear attention, shared KV) needs ``cache="dynamic"``.
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

#: layer types whose cache is plain keys/values over every position
_ATTENTION_TYPES = ("full_attention", "sliding_attention")
_ROUND = 64  # capacities are multiples of this


def _round_up(n: int) -> int:
    return -(-n // _ROUND) * _ROUND


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. A host tensor goes to a CUDA device through pinned memory without blocking: a plain copy
    from pageable memory makes the host wait for everything queued on the stream (``set_sync_debug_mode`` counts
    it as a sync; the H200 smoke found one to two per decoding step). PyTorch's pinned allocator keeps the source
    alive until the copy is done."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _Store:
    """One layer's key/value buffers ``[rows, heads, capacity, dim]``, whose row ranges one or more caches hold."""

    def __init__(self, rows: int, heads: int, capacity: int, k_dim: int, v_dim: int, dtype, device):
        # normal tensors even under inference_mode: forward_pseudo writes them outside it
        with torch.inference_mode(False), torch.no_grad():
            self.keys = torch.zeros(rows, heads, capacity, k_dim, dtype=dtype, device=device)
            self.values = torch.zeros(rows, heads, capacity, v_dim, dtype=dtype, device=device)
        self.holders: weakref.WeakSet[PreallocatedLayer] = weakref.WeakSet()

    @property
    def rows(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def like(self, rows: int, capacity: int) -> _Store:
        k, v = self.keys, self.values
        return _Store(rows, k.shape[1], capacity, k.shape[3], v.shape[3], k.dtype, k.device)

    def free(self, r0: int, r1: int, asking: PreallocatedLayer) -> bool:
        """Rows ``r0..r1-1`` exist and no live cache but ``asking`` holds any of them."""
        return r1 <= self.rows and all(h is asking or h.store is not self or h.r1 <= r0 or h.r0 >= r1 or h.r0 == h.r1
                                       for h in list(self.holders))


class PreallocatedLayer(CacheLayerMixin):
    """One layer's cache: rows ``r0..r1-1`` and positions ``begin..begin+length-1`` of a :class:`_Store`."""

    is_sliding = False
    is_croppable = True
    is_compileable = False
    #: positions reserved past the first update (growth beyond them doubles the capacity)
    headroom = 256

    def __init__(self) -> None:  # (CacheLayerMixin's __init__ would assign keys/values, properties here)
        self.is_initialized = False
        self.store: _Store | None = None
        self.r0 = self.r1 = 0  # rows of the store
        self.begin = 0  # the buffer slot of cached position 0
        self.length = 0
        #: a store the first update takes if it fits, instead of allocating one (:meth:`PreallocatedCache.reuse`)
        self.spare: _Store | None = None

    def __repr__(self) -> str:
        return f"PreallocatedLayer(rows={self.rows}, length={self.length})"

    # ---------------------------------------------------------------- views
    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def keys(self) -> torch.Tensor | None:
        """The cached keys ``[rows, heads, length, dim]`` (a view into the buffer)."""
        return None if self.store is None else self.store.keys[self.r0 : self.r1, :, self.begin : self.begin + self.length]

    @property
    def values(self) -> torch.Tensor | None:
        s = self.store
        return None if s is None else s.values[self.r0 : self.r1, :, self.begin : self.begin + self.length]

    def _hold(self, store: _Store | None, r0: int = 0, r1: int = 0, begin: int = 0, length: int = 0) -> None:
        if self.store is not None and self.store is not store:
            self.store.holders.discard(self)
        if store is not None:
            store.holders.add(self)
        self.store, self.r0, self.r1, self.begin, self.length = store, r0, r1, begin, length
        self.is_initialized = store is not None

    # ---------------------------------------------------------------- transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, t, _ = key_states.shape
        spare, self.spare = self.spare, None
        k, v = key_states, value_states
        if (spare is not None and spare.rows == b and spare.capacity >= t + self.headroom and spare.free(0, b, self)
                and spare.keys.shape[1] == h and spare.keys.shape[3] == k.shape[3]
                and spare.values.shape[3] == v.shape[3] and spare.keys.dtype == k.dtype
                and spare.keys.device == k.device):
            self._hold(spare, 0, b)  # (its stale slots are never read: attention covers begin..begin+length only)
            return
        self._hold(_Store(b, h, _round_up(t + self.headroom), k.shape[3], v.shape[3], k.dtype, k.device), 0, b)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, transient_from: int | None = None,
               **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values after the cached ones and return all of them (views into the buffer)."""
        if self.store is None:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.rows:
            raise ValueError(f"the cache holds {self.rows} batch rows; the forward has {key_states.shape[0]}")
        t = key_states.shape[-2]
        grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        if not grad:
            self._reserve(self.length + t)
            self._write(key_states, value_states, self.length)
            self.length += t
            return self.keys, self.values
        old_k, old_v = self.keys, self.values
        n = t if transient_from is None else max(0, min(t, transient_from - self.length))
        if n:
            self._reserve(self.length + n)
            self._write(key_states[:, :, :n].detach(), value_states[:, :, :n].detach(), self.length)
            self.length += n
        return torch.cat([old_k, key_states], dim=-2), torch.cat([old_v, value_states], dim=-2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1  # grows

    def reset(self) -> None:
        self._hold(None)

    def crop(self, tokens_to_remove: int) -> None:
        """``crop(-n)`` drops the last ``n`` positions (transformers' meaning; a positive value raises, as there)."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): give a negative number of positions to remove")
        self.length = max(0, self.length + tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._gather_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._gather_rows(torch.arange(self.rows)[torch.as_tensor(indices).cpu()])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._gather_rows(torch.arange(self.rows).repeat_interleave(repeats))

    # ---------------------------------------------------------------- pardec's verbs (one layer)
    def keep(self, start: int, src: torch.Tensor | None, dst: int, new_length: int, shift: int) -> None:
        """Positions ``start + src`` (a device index, None: nothing to move) to ``dst..``; ``shift``: drop the first
        ``shift`` positions by moving ``begin``; then ``new_length`` positions."""
        if self.store is None:
            return
        if src is not None:
            for buf in (self.store.keys, self.store.values):
                region = buf[self.r0 : self.r1, :, self.begin : self.begin + self.length]
                moved = region.index_select(2, src.to(buf.device))
                region[:, :, dst : dst + moved.shape[2]].copy_(moved)
        self.begin += shift
        self.length = new_length

    def take(self, rows: list[int]) -> PreallocatedLayer:
        """Rows ``rows`` (increasing indices into this layer's rows) leave: the range is reordered to [taken | kept],
        copying only rows not yet in place; the taken rows become a new layer over the same buffer."""
        other = PreallocatedLayer()
        if self.store is None:
            return other
        gone = set(rows)
        order = rows + [i for i in range(self.rows) if i not in gone]
        moved = [j for j, i in enumerate(order) if i != j]
        if moved:
            self._move_rows([self.r0 + i for i in order[moved[0] : moved[-1] + 1]], self.r0 + moved[0])
        other._hold(self.store, self.r0, self.r0 + len(rows), self.begin, self.length)
        self._hold(self.store, self.r0 + len(rows), self.r1, self.begin, self.length)
        return other

    def join(self, other: CacheLayerMixin, pad_self: int, pad_other: int) -> None:
        """Append ``other``'s rows after these; the shorter side is left-padded with zero keys/values to a common
        length. ``other`` (a layer of either kind) is consumed."""
        if self.store is None:
            raise ValueError("join_rows: this cache holds no keys yet")
        ok, ov = other.keys, other.values
        n = 0 if ok is None or ok.dim() != 4 else ok.shape[0]
        length = self.length + pad_self
        if n and ok.shape[2] + pad_other != length:
            raise ValueError(f"cannot join rows of {ok.shape[2]} positions (+{pad_other} padding) to rows of "
                             f"{self.length} (+{pad_self})")
        begin = self.begin - pad_self
        adjacent = (isinstance(other, PreallocatedLayer) and other.store is self.store and other.r0 == self.r1
                    and begin >= 0 and other.begin == begin + pad_other)
        if not adjacent:
            if begin < 0 or begin + length > self.store.capacity or not self.store.free(self.r1, self.r1 + n, self):
                self._relocate(self.rows + n, length, pad_self, spare=True)
                begin = 0
            if n:
                at = (slice(self.r1, self.r1 + n), slice(None), slice(begin + pad_other, begin + length))
                self.store.keys[at].copy_(ok)
                self.store.values[at].copy_(ov)
        for r0, r1, pad in ((self.r0, self.r1, pad_self), (self.r1, self.r1 + n, pad_other)):
            if pad:
                self.store.keys[r0:r1, :, begin : begin + pad] = 0
                self.store.values[r0:r1, :, begin : begin + pad] = 0
        if isinstance(other, PreallocatedLayer):
            other._hold(None)
        self._hold(self.store, self.r0, self.r1 + n, begin, length)

    # ---------------------------------------------------------------- buffer moves
    def _write(self, k: torch.Tensor, v: torch.Tensor, at: int) -> None:
        a = self.begin + at
        self.store.keys[self.r0 : self.r1, :, a : a + k.shape[2]].copy_(k)
        self.store.values[self.r0 : self.r1, :, a : a + v.shape[2]].copy_(v)

    def _reserve(self, length: int) -> None:
        """Make room for ``length`` positions after ``begin``: shift to the buffer's first slot if that is enough,
        else move to a buffer of twice the capacity (or more)."""
        if self.begin + length <= self.store.capacity:
            return
        if length <= self.store.capacity:
            for buf in (self.store.keys, self.store.values):
                src = buf[self.r0 : self.r1, :, self.begin : self.begin + self.length].clone()
                buf[self.r0 : self.r1, :, : self.length].copy_(src)
            self.begin = 0
            return
        self._relocate(self.rows, length, 0)

    def _relocate(self, rows: int, length: int, pad: int, spare: bool = False) -> None:
        """Move this layer's positions to slots ``pad..`` of rows ``0..`` of a store whose first ``rows`` rows are
        free and that has room for ``length`` positions: this store if it can, else a new one (with as many rows as
        this one when ``spare``: room for rows joining later)."""
        s = self.store
        cap = s.capacity if length <= s.capacity else _round_up(max(2 * s.capacity, length))
        dest = s if cap == s.capacity and s.free(0, rows, self) else s.like(max(rows, s.rows) if spare else rows, cap)
        n = self.rows
        for old, new in ((s.keys, dest.keys), (s.values, dest.values)):
            src = old[self.r0 : self.r1, :, self.begin : self.begin + self.length]
            new[:n, :, pad : pad + self.length].copy_(src.clone() if dest is s else src)
        self._hold(dest, 0, n, pad, self.length)

    def _move_rows(self, src: list[int], dst: int) -> None:
        """Store rows ``src`` (absolute) to rows ``dst..`` (cached positions only)."""
        index = torch.tensor(src, dtype=torch.long, device=self.store.keys.device)
        for buf in (self.store.keys, self.store.values):
            region = buf[:, :, self.begin : self.begin + self.length]
            region[dst : dst + len(src)].copy_(region.index_select(0, index))

    def _gather_rows(self, index: torch.Tensor) -> None:
        """Rows ``index`` (any order, repeats allowed) into a new store (transformers' beam-search verbs)."""
        if self.store is None:
            return
        index = index.to(self.store.keys.device)
        dest = self.store.like(index.numel(), self.store.capacity)
        for old, new in ((self.keys, dest.keys), (self.values, dest.values)):
            new[:, :, : self.length].copy_(old.index_select(0, index))
        self._hold(dest, 0, index.numel(), 0, self.length)


class PreallocatedCache(Cache):
    """transformers ``Cache`` of :class:`PreallocatedLayer` (see the module docstring), plus the verbs CachedModel
    needs: :meth:`keep`, :meth:`drop_after`, :meth:`take_rows`, :meth:`join_rows`."""

    def __init__(self, config=None, layers: list[PreallocatedLayer] | None = None):
        if layers is None:
            text = config.get_text_config(decoder=True)
            types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
            other = sorted(set(types) - set(_ATTENTION_TYPES))
            if other:
                raise TypeError(f"the preallocated KV cache holds attention layers only; this model also has "
                                f"{', '.join(other)} layers: use CachedModel(..., cache='dynamic')")
            layers = [PreallocatedLayer() for _ in types]
        super().__init__(layers=layers)
        #: positions at or past this are dropped right after the current call (set by CachedModel around FIRP's
        #: pseudo states and run_upper's injected ones): keys that require grad are then not stored
        self.transient_from: int | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, transient_from=self.transient_from)

    @property
    def initialized(self) -> bool:
        return any(layer.store is not None for layer in self.layers)

    def reuse(self, old: PreallocatedCache) -> None:
        """Let this (new, empty) cache take ``old``'s buffers, which ``old`` gives up, where they fit its first
        forward: the buffers keep their addresses from one prompt to the next, so the CUDA graphs captured over them
        (``forward_impl=cudagraph``, keyed by the buffers) are replayed rather than captured again per prompt."""
        for new, layer in zip(self.layers, old.layers):
            new.spare = layer.store
            layer.reset()

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions ``start + idx`` (``idx``: increasing, on the host) of those from ``start`` on, moved to
        ``start..``; the prefix is never touched, kept positions already in place are not copied."""
        m = idx.numel()
        moved = (idx != torch.arange(m)).nonzero()
        first = int(moved[0]) if moved.numel() else m  # idx[:first] are already in place
        shift = 0
        if first < m and start == 0 and int(idx[-1]) - int(idx[0]) == m - 1:  # drop the first idx[0] positions
            shift, first = int(idx[0]), m
        src = (start + idx[first:]) if first < m else None
        on: dict[torch.device, torch.Tensor] = {}  # layers of a split model sit on several devices
        for layer in self.layers:
            dev = None if layer.store is None or src is None else layer.store.keys.device
            layer.keep(start, None if dev is None else on.setdefault(dev, to_device(src, dev)), start + first, start + m,
                       shift)

    def buffers_for(self, rows: int, width: int) -> tuple[list[torch.Tensor], list[torch.Tensor], int, int] | None:
        """For a forward that writes ``width`` new positions straight into the buffers (the compiled forwards):
        every layer's whole key and value buffer, the slot of cached position 0 and the cached length, with room
        reserved for the new positions (a reserve may move the positions to the buffer's start); None when the
        layers do not each hold all ``rows`` rows of a buffer of their own at the same slots (the layout a graph
        needs: one cache per buffer, the usual case). :meth:`advance` then records the new positions."""
        first = self.layers[0]
        if first.store is None:
            return None
        for layer in self.layers:
            s = layer.store
            if (s is None or layer.r0 != 0 or layer.r1 != s.rows or layer.begin != first.begin
                    or layer.length != first.length or s.rows != rows):
                return None
        length = first.length
        for layer in self.layers:
            layer._reserve(length + width)
        return ([layer.store.keys for layer in self.layers], [layer.store.values for layer in self.layers],
                self.layers[0].begin, length)

    def advance(self, width: int) -> None:
        """``width`` new positions were written into the buffers after the cached ones (:meth:`buffers_for`)."""
        for layer in self.layers:
            layer.length += width

    def drop_after(self, length: int) -> None:
        """Every layer keeps at most its first ``length`` positions (states a call ran but must not keep)."""
        for layer in self.layers:
            layer.length = min(layer.length, length)

    def take_rows(self, rows: list[int], config=None) -> PreallocatedCache:
        """Batch ``rows`` (increasing) leave into a new cache sharing these buffers; this one keeps the others
        (``config``: unused here, the dynamic cache's signature)."""
        return PreallocatedCache(layers=[layer.take(rows) for layer in self.layers])

    def join_rows(self, other: Cache, pad_self: int, pad_other: int) -> None:
        """Append ``other``'s rows (either kind of cache; consumed), left-padding the shorter side."""
        if len(other.layers) != len(self.layers):
            raise ValueError(f"cannot join a cache of {len(other.layers)} layers to one of {len(self.layers)}")
        for a, b in zip(self.layers, other.layers):
            a.join(b, pad_self, pad_other)
