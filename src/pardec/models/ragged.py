"""A batch of sequences of different lengths over one model: the KV cache of batched decoding (``batch_size > 1``).

:class:`~pardec.models.cached.CachedModel`'s caches hold one length for all rows, which is what one prompt's
branches need (a tree, beams, i.i.d. drafts), but not a batch of prompts: each accepts its own number of draft tokens
per round, so each row's cache has its own length. Re-padding the whole batch to a common length every round would
copy every row's cache. Here each row keeps its positions at slots ``0 .. length-1`` of its own row of one buffer per
layer ``[rows, kv_heads, capacity, head_dim]``, and a forward of ``T`` new tokens per row writes row ``b``'s at
slots ``length_b .. length_b + T - 1`` (positions ``length_b + j``, or ``length_b + depth_j`` in a tree), whatever
the other rows' lengths: one scatter per layer. Attention reads ``[:n, :, :max(length) + T]`` (a view) under a mask
built on the device from the lengths: row ``b``'s query ``j`` sees its cached slots ``< length_b`` and its new
tokens as ``attend`` says (causal by default). Slots past a row's length hold stale keys nobody sees, so dropping
rejected tokens only moves the length (:meth:`RaggedModel.set_lengths`), and a forward whose rows have fewer real
tokens than ``T`` pads them (their padding columns land past the row's new length).

Rows are the active requests 0..n-1: a request joins at row ``n`` (its prompt prefilled alone, batch 1, so its first
token is exactly batch-1 decoding's), and one that leaves is replaced by the last row (one copy of that row's cached
slots), so the active rows stay one contiguous view (continuous batching).

The forward is :mod:`pardec.models.forward.lean`'s (embed, decoder layers, final norm and head) with this cache's
attention: Llama-family models, plain or int8 linears (``lean.unsupported`` names what else is refused).

With ``model.attn_implementation=invariant`` the attention is batch-invariant: :func:`pardec.models.forward.invariant.attend`
on this cache, every query row of every batch row (a prompt's too) an item of its own over exactly the keys it may
see in cache order (its row's prefix, a tree node's ancestors gathered after it), which is what a batch-1 one-token
step computes at that position. With per-token int8 linears (row by row themselves) every row's logits are then
bitwise batch-1 ``ar``'s, whatever its neighbours; the cost is one host read of the mask per forward: a CPU
exactness mode."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pardec.models.cache import to_device
from pardec.models.finite import FiniteCheck
from pardec.models.forward import compiled, invariant, lean
from pardec.models.masks import additive_mask


@dataclass
class Window:
    """Where one forward of ``T`` new entries per row reads and writes (:meth:`RaggedKV.window`)."""

    lens: torch.Tensor  # [n] each row's length before the forward, on the device
    rows: torch.Tensor  # [n, T] the buffer row of each new entry
    slots: torch.Tensor  # [n, T] its slot: length_b + j
    visible: torch.Tensor  # [n, T, W] bool: new entry j of row b may see slot k (W = the longest length + T)
    first: int
    width: int

    def additive(self, dtype: torch.dtype) -> torch.Tensor:
        """``visible`` as SDPA's additive mask [n, 1, T, W]."""
        return additive_mask(self.visible, dtype)


class RaggedKV:
    """Keys/values of a ragged batch, ``layers`` of them: ``[rows, kv_heads, capacity, head_dim]`` per layer
    (allocated on the first write, in the dtype of the keys written; moved to a larger capacity when a forward needs
    it), and the length of each active row (on the host: every length is known there without a read)."""

    def __init__(self, layers: int, rows: int, capacity: int, name: str = "model"):
        if rows < 1 or capacity < 1:
            raise ValueError(f"a batch cache needs rows >= 1 and capacity >= 1; got rows={rows}, capacity={capacity}")
        self.name = name
        self.max_rows, self.capacity = rows, capacity
        self.buffer_rows = rows  # rows of each buffer: the active ones and, under graphs, padding rows past them
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    def _buffers(self) -> list[torch.Tensor]:
        return [b for b in (*self.keys, *self.values) if b is not None]

    def new_row(self) -> int:
        """A new active row (empty); its index."""
        if self.rows >= self.max_rows:
            raise ValueError(f"{self.name}: all {self.max_rows} batch rows are taken; a row must leave first")
        self.lengths.append(0)
        return self.rows - 1

    @torch.inference_mode()
    def clone_row(self, row: int) -> int:
        """A new active row holding a copy of row ``row``'s cached positions (branches of one request, each grown in
        a row of its own); its index."""
        if not 0 <= row < self.rows:
            raise ValueError(f"clone_row: row {row} is not one of the {self.rows} active rows")
        n = self.lengths[row]
        new = self.new_row()
        for buf in self._buffers():
            buf[new, :, :n].copy_(buf[row, :, :n])
        self.lengths[new] = n
        return new

    @torch.inference_mode()
    def drop(self, row: int) -> None:
        """Row ``row`` leaves; the last row takes its place (its cached slots copied once)."""
        if not 0 <= row < self.rows:
            raise ValueError(f"drop: row {row} is not one of the {self.rows} active rows")
        last = self.rows - 1
        if row != last:
            n = self.lengths[last]
            for buf in self._buffers():
                buf[row, :, :n].copy_(buf[last, :, :n])
            self.lengths[row] = n
        self.lengths.pop()

    def set_lengths(self, lengths: list[int]) -> None:
        """Each active row keeps its first ``lengths[b]`` cached positions (rejected drafts and padding leave)."""
        if len(lengths) != self.rows:
            raise ValueError(f"set_lengths: {len(lengths)} lengths for {self.rows} rows")
        bad = [(b, n) for b, (n, held) in enumerate(zip(lengths, self.lengths)) if not 0 <= n <= held]
        if bad:
            raise ValueError(f"set_lengths: row {bad[0][0]} holds {self.lengths[bad[0][0]]} positions, cannot keep "
                             f"{bad[0][1]}")
        self.lengths = [int(n) for n in lengths]

    @torch.inference_mode()
    def keep_rows(self, starts: list[int], paths: list[list[int]]) -> None:
        """Every active row ``b`` keeps positions ``starts[b] + paths[b]`` (increasing) of those from ``starts[b]``
        on, moved to ``starts[b]..`` (each row's accepted tree path): one gather and one scatter per buffer for the
        whole batch."""
        n = self.rows
        if len(starts) != n or len(paths) != n:
            raise ValueError(f"keep_rows: {len(starts)} starts and {len(paths)} paths for {n} rows")
        for b, (st, idx) in enumerate(zip(starts, paths)):
            if not idx or any(q <= p for p, q in zip(idx, idx[1:])) or idx[0] < 0 or st + idx[-1] >= self.lengths[b]:
                raise ValueError(f"keep_rows: path {idx} from {st} does not fit row {b}'s {self.lengths[b]} positions")
        width = max(len(p) for p in paths)
        src = [[st + p[min(j, len(p) - 1)] for j in range(width)] for st, p in zip(starts, paths)]
        dst = [[st + j for j in range(width)] for st in starts]  # (past a row's path: slots it no longer holds)
        host = torch.tensor([src, dst])
        on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}  # (a model split over devices: per device)
        for buf in self._buffers():
            if buf.device not in on:
                both = to_device(host, buf.device)
                on[buf.device] = (torch.arange(n, device=buf.device)[:, None].expand(n, width), both)
            rows, both = on[buf.device]
            buf[rows, :, both[1]] = buf[rows, :, both[0]]
        self.lengths = [st + len(p) for st, p in zip(starts, paths)]

    def past(self, first: int, n: int, t: int, device: torch.device, attend: torch.Tensor | None = None):
        """For a module that reads the cached entries as one past and appends its ``t`` new ones after it (the
        drafters' layers): (every layer's keys/values of rows ``first ..`` over the longest row's length S
        [n, kv, S, d], None when S is 0; the bool mask [n, T, S + T]: each row's own cached entries, then the new
        ones as ``attend`` [T, T] says, causal by default; the rows' lengths [n] on ``device``)."""
        base = self.lengths[first : first + n]
        s = max(base)
        lens = to_device(torch.tensor(base, dtype=torch.long), device)  # (an upload, no read)
        new = torch.ones(t, t, dtype=torch.bool, device=device).tril() if attend is None else to_device(attend, device)
        mask = torch.cat([(torch.arange(s, device=device)[None] < lens[:, None])[:, None].expand(n, t, s),
                          new.to(torch.bool)[None].expand(n, t, t)], 2)
        if not s:
            return None, mask, lens
        views = [(k[first : first + n, :, :s], v[first : first + n, :, :s]) for k, v in zip(self.keys, self.values)]
        return views, mask, lens

    def window(self, first: int, n: int, t: int, device: torch.device, attend: torch.Tensor | None = None
               ) -> Window:
        """Rows ``first .. first+n-1`` get ``t`` new entries each: where they go and what each may see (its row's
        cached slots, and the new entries as ``attend`` [T, T] / [n, T, T] says: causal by default)."""
        base = self.lengths[first : first + n]
        self._grow(max(base) + t)
        lens = to_device(torch.tensor(base, dtype=torch.long), device)  # (an upload, no read)
        width = max(base) + t
        if attend is None:
            attend = torch.ones(t, t, dtype=torch.bool, device=device).tril()
        attend = to_device(attend, device).to(torch.bool)
        if attend.dim() == 2:
            attend = attend[None].expand(n, t, t)
        rel = torch.arange(width, device=device)[None] - lens[:, None]  # [n, W]: key slot - the row's length
        inside = (rel >= 0) & (rel < t)
        new = attend.gather(2, rel.clamp(0, t - 1)[:, None].expand(n, t, width)) & inside[:, None]
        rows = torch.arange(first, first + n, device=device)[:, None].expand(n, t)
        slots = lens[:, None] + torch.arange(t, device=device)
        return Window(lens, rows, slots, (rel < 0)[:, None] | new, first, width)

    def write(self, layer: int, w: Window, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values [n, kv_heads, T, d] of ``layer`` where ``w`` says; returns the rows' keys and
        values over the window's width [n, kv_heads, W, d] (views)."""
        if self.keys[layer] is None:
            shape = (self.buffer_rows, k.shape[1], self.capacity, k.shape[3])
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        kb, vb = self.keys[layer], self.values[layer]
        kb[w.rows, :, w.slots] = k.transpose(1, 2).to(kb.dtype)  # row b's new entry j at slot length_b + j
        vb[w.rows, :, w.slots] = v.transpose(1, 2).to(vb.dtype)
        n = w.rows.shape[0]
        return kb[w.first : w.first + n, :, : w.width], vb[w.first : w.first + n, :, : w.width]

    def advance(self, w: Window, widths: list[int] | None = None) -> None:
        """The window's rows hold their new entries (``widths``: the real ones per row; default all T)."""
        t = w.rows.shape[1]
        for i, b in enumerate(range(w.first, w.first + w.rows.shape[0])):
            self.lengths[b] += t if widths is None else widths[i]

    def _grow(self, need: int) -> None:
        """Room for ``need`` positions per row: the buffers move to twice the capacity (or more) when exceeded."""
        if need <= self.capacity:
            return
        cap = max(2 * self.capacity, need)
        held = max(self.lengths, default=0)
        for bufs in (self.keys, self.values):
            for i, old in enumerate(bufs):
                if old is not None:
                    new = old.new_zeros(old.shape[0], old.shape[1], cap, old.shape[3])
                    new[:, :, :held].copy_(old[:, :, :held])
                    bufs[i] = new
        self.capacity = cap


#: the forwards a ragged batch runs: the lean one (eager), or every forward after the prefill as one compiled graph
#: over the whole buffers (:func:`pardec.models.forward.compiled.ragged_step`), or that graph captured as a CUDA
#: graph per padded row count and width (:meth:`RaggedModel._graphed`)
BATCH_FORWARDS = ("lean", "compiled", "cudagraph")


class RaggedModel(RaggedKV):
    """A Llama-family model over a :class:`RaggedKV` of at most ``rows`` rows (the module docstring)."""

    def __init__(self, model: nn.Module, rows: int, capacity: int, name: str | None = None,
                 forward_impl: str = "lean", graphs: compiled.Graphs | None = None):
        name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        why = lean.unsupported(model, attention=("sdpa", "eager", "invariant"))
        if why is not None:
            raise ValueError(f"batched decoding runs pardec's lean forward, which cannot run {name!r}: {why}")
        super().__init__(int(model.config.num_hidden_layers), rows, capacity, name)
        self.invariant = getattr(model.config, "_attn_implementation", None) == "invariant"
        if forward_impl not in BATCH_FORWARDS:
            raise ValueError(f"forward_impl={forward_impl!r} is not valid for a batch; choose one of: "
                             f"{', '.join(BATCH_FORWARDS)}")
        self.compiled = forward_impl in ("compiled", "cudagraph")
        self.device = next(model.parameters()).device
        if self.compiled:
            why = "its attention is invariant (one host read per forward)" if self.invariant else \
                compiled.unsupported(model)
            if why is None and forward_impl == "cudagraph" and graphs is None and self.device.type != "cuda":
                why = f"it is on {self.device} (CUDA graphs need a GPU; use forward_impl=compiled)"
            if why is not None:
                raise ValueError(f"forward_impl={forward_impl} cannot run {name!r} over a batch: {why}")
            compiled.register_opaque(model)
        #: forward_impl=cudagraph: the graphs replayed (default the process's CUDA graphs; tests inject a stand-in)
        self.graphs = (graphs or compiled.CUDA_GRAPHS) if forward_impl == "cudagraph" else None
        if self.graphs is not None:  # a batch of n active rows replays the graph of graph_rows(n) rows
            self.buffer_rows = compiled.graph_rows(rows)
        self.model = model.eval()
        self.num_layers = int(model.config.num_hidden_layers)
        self._finite = FiniteCheck()  # NaN/inf in the logits raise (pardec.models.finite)

    @torch.inference_mode()
    def add(self, ids: torch.Tensor | list[int], hidden_layer: tuple[int, ...] | None = None,
            logits_from: int | None = None):
        """A new row (index ``rows``) with the prompt ``ids`` [T], prefilled alone; returns its last logits [1, V]
        (with ``hidden_layer``: and the hidden states entering those layers at every prompt position, [T, n * H];
        with ``logits_from``: the logits at positions ``logits_from .. T - 1`` instead, [T - logits_from, V])."""
        ids = to_device(torch.as_tensor(ids, dtype=torch.long).reshape(1, -1), self.device)
        t = ids.shape[1]
        if t == 0:
            raise ValueError("empty prompt")
        if logits_from is not None and not 0 <= logits_from < t:
            raise ValueError(f"add: logits_from={logits_from} must be in 0..{t - 1}")
        at = None if logits_from is None else torch.arange(logits_from, t, device=self.device)[None]
        row = self.new_row()
        try:
            out = self._forward(ids, row, last_only=at is None, logits_at=at, hidden_layer=hidden_layer)
        except BaseException:
            self.lengths.pop()
            raise
        logits = (out[0] if hidden_layer is not None else out)[0]
        logits = logits if at is not None else logits[-1:]
        return (logits, out[1][0]) if hidden_layer is not None else logits

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, depths: torch.Tensor | None = None, attend: torch.Tensor | None = None,
                widths: list[int] | None = None, logits_at: torch.Tensor | None = None,
                hidden_layer: tuple[int, ...] | None = None):
        """New tokens ``ids`` [n, T] for every active row after its cached ones; returns logits [n, T, V] (or of
        the columns ``logits_at`` [n, K] picks per row: [n, K, V]); with ``hidden_layer``, (logits, the hidden
        states entering those layers [n, T, len * H]).

        depths: [T] or [n, T] offsets of the new tokens' positions from each row's length (default ``0..T-1``).
        attend: bool [T, T] / [n, T, T], new token j sees new token i (default causal); cached positions all seen.
        widths: real tokens per row (default T): row ``b`` then holds ``length_b + widths[b]`` positions.
        """
        n, t = ids.shape
        if n != self.rows:
            raise ValueError(f"{self.name}: a forward of {n} rows for {self.rows} active rows")
        if widths is not None and (len(widths) != n or any(not 0 <= w <= t for w in widths)):
            raise ValueError(f"forward: widths {widths} must be {n} values in 0..{t}")
        return self._forward(to_device(ids, self.device), 0, depths=depths, attend=attend, logits_at=logits_at,
                             widths=widths, hidden_layer=hidden_layer)

    def _forward(self, ids: torch.Tensor, first: int, depths=None, attend=None, last_only: bool = False,
                 logits_at: torch.Tensor | None = None, widths: list[int] | None = None,
                 hidden_layer: tuple[int, ...] | None = None):
        """Rows ``first .. first+n-1`` (their lengths advance by ``widths``, default T)."""
        self._finite.pending()
        n, t = ids.shape
        dev = self.device
        capture = lean.capture_layers(hidden_layer, self.num_layers, self.name)
        base = self.lengths[first : first + n]
        w = self.window(first, n, t, dev, attend)
        offs = torch.arange(t, device=dev) if depths is None else to_device(torch.as_tensor(depths), dev).long()
        positions = w.lens[:, None] + (offs if offs.dim() == 2 else offs[None])  # [n, T]
        if self.compiled and first == 0 and not last_only and all(k is not None for k in self.keys):
            return self._compiled(ids, positions, w, base, widths, logits_at, capture)
        mask = w.additive(self.model.dtype)
        h, cos, sin = lean.embed(self.model, ids, positions)

        plans = []  # invariant attention's plan of this forward (read from the mask at its first layer)

        def attend_fn(a, q, k, v):
            ks, vs = self.write(a.layer_idx, w, k, v)
            gqa = q.shape[1] != ks.shape[1]
            if self.invariant:
                plans[:] = plans or invariant.plan_rows(w.visible.cpu(), q.shape[-1], q.device)
                return invariant.attend(q, ks.to(q.dtype), vs.to(q.dtype), plans, a.scaling).transpose(1, 2)
            # grouped-query attention inside SDPA, masked: the same values as repeating the keys/values per head
            # (bitwise, measured), without the copy of the whole batch's cache per layer (23x faster at 16 rows)
            return F.scaled_dot_product_attention(q, ks.to(q.dtype), vs.to(q.dtype), attn_mask=mask, scale=a.scaling,
                                                  enable_gqa=gqa)

        seen: dict[int, torch.Tensor] = {}
        h = lean.decoder_layers(self.model, h, cos, sin, attend_fn, on_layer=seen.__setitem__ if capture else None)
        self.advance(w, widths)
        full = h
        if last_only:
            h = h[:, -1:]
        elif logits_at is not None:
            h = h.gather(1, to_device(logits_at, dev)[..., None].expand(-1, -1, h.shape[-1]))
        logits = lean.head(self.model, h)
        self._finite.check(logits, self.name, base, t, last_only, None)
        if capture is None:
            return logits
        final = lean._rms(self.model.model.norm, full) if self.num_layers in capture else full
        return logits, lean.captured(seen, final, capture, self.num_layers)

    def _graphed(self, rows: int, ids, positions, slots, visible, capture):
        """``forward_impl=cudagraph``: the compiled ragged forward replayed as a graph captured for ``rows`` rows
        (the active ones padded to a power of two, as the engines pad a batch to its captured sizes), ``T`` new
        tokens and these buffers. The padding rows are inactive rows of the buffers: they write at their slots
        ``0 .. T-1`` (a slot an inactive row's next prompt overwrites) and see their first slot; their outputs are
        dropped. Returns the active rows' outputs."""
        n, t = ids.shape
        pad = rows - n
        if pad:
            zeros = ids.new_zeros(pad, t)
            ids, positions = torch.cat([ids, zeros]), torch.cat([positions, zeros])
            slots = torch.cat([slots, torch.arange(t, device=self.device).expand(pad, t)])
            visible[n:, :, 0] = True
        fn = self.graphs.ragged_fn(self.model)
        keys, values = self.keys, self.values
        out = self.graphs(self.model, ("ragged", capture), keys, values,
                          lambda: lambda i, p, s, m: fn(self.model, i, p, keys, values, s, m, capture),
                          (ids, positions, slots, additive_mask(visible, self.model.dtype)))
        return tuple(o[:n] for o in out) if isinstance(out, tuple) else out[:n]

    def _compiled(self, ids, positions, w: Window, base, widths, logits_at, capture):
        """:meth:`_forward` of every active row as one compiled graph over the whole buffers
        (:func:`~pardec.models.forward.compiled.ragged_step`: the mask admits each row's visible slots)."""
        n, t = ids.shape
        rows = n if self.graphs is None else compiled.graph_rows(n)  # (<= buffer_rows)
        visible = torch.zeros(rows, t, self.capacity, dtype=torch.bool, device=self.device)
        visible[:n, :, : w.width] = w.visible
        if self.graphs is None:
            out = compiled.ragged_step(self.model, ids, positions, self.keys, self.values, w.slots,
                                       additive_mask(visible, self.model.dtype), capture)
        else:
            out = self._graphed(rows, ids, positions, w.slots, visible, capture)
        logits, hidden = out if capture is not None else (out, None)
        self.advance(w, widths)
        if logits_at is not None:
            logits = logits.gather(1, to_device(logits_at, self.device)[..., None].expand(-1, -1, logits.shape[-1]))
        self._finite.check(logits, self.name, base, t, False, None)
        return logits if capture is None else (logits, hidden)
