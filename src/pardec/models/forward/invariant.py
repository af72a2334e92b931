"""``model.attn_implementation=invariant``: batch-invariant attention for transformers' forward.

A forward of T new rows (a verification, a Jacobi block, a tree) and T one-row steps compute the same rows, but
not with the same kernels: attention's scores and weighted sums are small-M GEMMs over the keys whose summation
order depends on how many query rows share the call, so a row's result differs in its last bits from the step's.
In fp32 that stays below the argmax almost always; with int8 activations (``dtype=int8``) a last-bit difference
moves a value across a quantization step, and a few layers later the rows differ by whole steps: int8 ``tokens``
methods left int8 ``ar`` within 8-52 tokens on every GSM8K prompt (docs/cpu_speed.md "Per-token int8"), although the per-token
int8 linears themselves are batch-invariant.

Here every query row is its own item of the attention kernel: one query row, one head, over the keys that row may
see in their cache order, so its arithmetic is the same whoever shares the call, and a row's output is a function of
its query and its keys only. The other ops of a Llama-style layer work row by row (norms, RoPE, activations), and so
do per-token int8 linears (``model.int8_weights=per_token``, the int8 default), so with them a row's logits are
bitwise the ones the one-row step computes and ``tokens`` methods equal ``ar`` by construction rather than up to
near-ties (tested bitwise on the tiny model, measured on SmolLM2 in docs/cpu_speed.md). fp32 and bf16 linears are
small-M GEMMs, not batch-invariant: there this attention removes one source of last-bit differences, not all.

How, on PyTorch's CPU flash-attention kernel (``_scaled_dot_product_flash_attention_for_cpu``): it computes each
(batch, head) item alone, one query row against blocks of at most 512 keys, in a scratch buffer of the thread that
runs it. The items of one call are spread over the threads by their count, so which thread computes a row depends
on its neighbours, and the threads' scratch buffers start ``keys + 2 + head_dim`` floats apart: unless that is a
multiple of 16 floats (64 bytes), they sit at different alignments and the BLAS calls inside sum in another order
(measured: a head computed by the second thread differs in its last bits from the same head on the first). So
(:class:`_Schedule`) a row attends over chunks of ``chunk(head_dim)`` keys at fixed places (510 for head_dim 64: the
longest length <= 512 of that residue) and then over its last ``m`` keys within ``bucket(m)`` (``m`` rounded up to
the residue; the extra keys masked: their weights are exactly 0, and their values, spare slots of the cache or
zeros, are finite). All rows of one (chunk, length) go in one call whose batch is the key/value heads and whose
heads are (row, query head) (grouped-query attention by a stride-0 view, no copy of the cache); a row over several
chunks merges their outputs by their log-sum-exps in chunk order, elementwise (:func:`_merge`). Rows that see other
keys than a prefix of the cache (a tree node: the prefix and its ancestors) are gathered into a scratch buffer in
cache order, one row at a time (the buffer keeps the cache's leading keys, so each row copies only its few
ancestors after them), and attended like a prefix of it. The mask is read once per forward (each row's allowed
keys, kept for the forward's other layers, :func:`_plan`). The cost against one call per row: an 11-row verification
13-19% cheaper, a one-row step the same up to 510 keys and 8% dearer at 800 (docs/cpu_speed.md "Batched invariant
attention"). On a GPU it works (plain ops stand in for the CPU kernel) but syncs every forward and promises
nothing: use ``sdpa`` there. The lean and compiled forwards run their own attention and refuse it. Registered with
transformers' attention and mask interfaces on import (:func:`register`); :class:`pardec.models.ragged.RaggedModel`
(batched decoding) runs the same :func:`attend`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "invariant"

_BLOCK = 512  # the CPU flash kernel's key block: a call over more keys splits them
_LINE = 16  # floats per 64-byte line


def _residue(head_dim: int) -> int:
    """Key counts ``L`` with ``L + 2 + head_dim`` a multiple of 16: the kernel's per-thread scratch buffers are then
    equally aligned (module docstring)."""
    return -(2 + head_dim) % _LINE


def chunk(head_dim: int) -> int:
    """The most keys a row attends over in a shared call (510 for head_dim 64)."""
    return _BLOCK - (_BLOCK - _residue(head_dim)) % _LINE


def bucket(n: int, head_dim: int) -> int:
    """The keys a row that sees ``n <= chunk(head_dim)`` of them attends over, the last ``bucket - n`` masked."""
    return n + (_residue(head_dim) - n) % _LINE


def _allowed(mask: torch.Tensor | None, batch: int, rows: int, keys: int, device) -> torch.Tensor:
    """[batch, rows, keys] bool: which keys each row may see. ``mask``: None (causal, the rows being the last ones of
    the keys), a bool mask (True: attend) or an additive float mask (0: attend, very negative: not), [batch, 1 or
    heads, rows, keys]; a float mask with other values (a position bias) is refused."""
    if mask is None:
        pos = torch.arange(keys, device=device)
        last = torch.arange(keys - rows, keys, device=device)
        return (pos[None, :] <= last[:, None]).expand(batch, rows, keys)
    if mask.dim() != 4:
        raise ValueError(f"attn_implementation={NAME!r} takes a 4D attention mask, got shape {tuple(mask.shape)}")
    if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
        raise ValueError(f"attn_implementation={NAME!r}: a mask that differs between heads is not supported")
    m = mask[:, 0].expand(batch, rows, keys)
    if m.dtype == torch.bool:
        return m
    allowed = m > torch.finfo(m.dtype).min / 2
    if bool((m[allowed] != 0).any()):
        raise ValueError(f"attn_implementation={NAME!r}: the mask carries a bias (values other than 0 and -inf); "
                         "only masks that allow or forbid keys are supported")
    return allowed


_PAD = 32  # a merge's per-row values padded to this many: elementwise ops then run their vector loop on every one
_SLICE = 512  # rows x chunks merged per op (512 * 32 values: below ATen's parallel grain, so one loop over them)


@dataclass
class _Call:
    """Query rows that each see the first ``seen`` of the ``keys`` keys from ``start`` on: one kernel call."""

    start: int
    keys: int
    rows: torch.Tensor  # [r] long: the query rows
    seen: list[int]
    direct: tuple[torch.Tensor, torch.Tensor] | None  # (picks of this call's results, their rows): one-chunk rows
    merged: tuple[torch.Tensor, torch.Tensor] | None  # (picks, their places among the schedule's merged rows)
    first: int | None = None  # the rows are first, first + 1, ...: read and written as a slice
    at: int | None = None  # every row is merged, at places at, at + 1, ... among the merged rows
    masks: dict = field(default_factory=dict)

    def mask(self, groups: int, dtype: torch.dtype, device) -> torch.Tensor | None:
        """Additive [1, r * groups, 1, keys] (0: seen, -inf: a bucket's padding), or None when every row sees all."""
        if all(n == self.keys for n in self.seen):
            return None
        if (groups, dtype) not in self.masks:
            seen = torch.tensor(self.seen, device=device).repeat_interleave(groups)
            hidden = torch.arange(self.keys, device=device)[None] >= seen[:, None]
            self.masks[groups, dtype] = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill(
                hidden, float("-inf"))[None, :, None]
        return self.masks[groups, dtype]


def _first(xs: list[int]) -> int | None:
    """``xs[0]`` if ``xs`` is ``xs[0], xs[0] + 1, ...``, else None."""
    return xs[0] if xs == list(range(xs[0], xs[0] + len(xs))) else None


class _Schedule:
    """The kernel calls for query ``rows`` that see the first ``lengths`` keys: a row over ``n`` keys attends over
    chunks of ``chunk(head_dim)`` keys at fixed places and then its last ``m`` keys within ``bucket(m)`` (masked);
    rows of one (chunk, length) share a call; a row over several chunks merges their results by their log-sum-exps,
    in chunk order (:func:`_merge`)."""

    def __init__(self, rows: list[int], lengths: list[int], head_dim: int, device):
        size = chunk(head_dim)
        calls: dict[tuple[int, int], list[tuple[int, int]]] = {}
        counts = []
        for row, n in zip(rows, lengths):
            k = -(-n // size)
            counts.append(k)
            for c in range(k - 1):
                calls.setdefault((c * size, size), []).append((row, size))
            m = n - (k - 1) * size
            calls.setdefault(((k - 1) * size, bucket(m, head_dim)), []).append((row, m))
        merged = [row for row, k in zip(rows, counts) if k > 1]
        where = {row: i for i, row in enumerate(merged)}
        self.size, self.chunks = size, max(counts, default=0)
        self.merged = torch.tensor(merged, dtype=torch.long, device=device)
        self.width = max((start + keys for start, keys in calls), default=0)  # keys read, padding included
        self.calls = []
        for (start, keys), members in sorted(calls.items()):
            own = [j for j, (row, _) in enumerate(members) if row not in where]
            many = [j for j, (row, _) in enumerate(members) if row in where]

            def pick(js, to):
                return None if not js else (torch.tensor(js, device=device), torch.tensor(to, device=device))

            rows = [row for row, _ in members]
            places = [where[row] for row in rows] if not own else []
            self.calls.append(_Call(start, keys, torch.tensor(rows, device=device), [n for _, n in members],
                                    pick(own, [members[j][0] for j in own]),
                                    pick(many, [where[members[j][0]] for j in many]), _first(rows),
                                    _first(places) if places else None))
        self.merged_first = _first(merged) if merged else None

    def run(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float | None,
            out: torch.Tensor) -> None:
        """Query ``q`` [Hq, T, D] over ``keys``/``values`` [Hkv, S, D]; writes the scheduled rows of ``out``
        [T, Hq, Dv]."""
        if not self.calls:
            return
        hq, many = q.shape[0], self.merged.numel()
        keys, values = _keys(keys, self.width), _keys(values, self.width)
        if many:  # each merged row's chunks, in chunk order; a chunk a row does not have weighs exactly 0
            outs = out.new_zeros(self.chunks, many, hq, out.shape[-1])
            lses = torch.zeros(self.chunks, many, -(-hq // _PAD) * _PAD, device=out.device)
            lses[:, :, :hq] = float("-inf")
        for call in self.calls:
            o, lse = _call(q, keys, values, call, scale)  # [Hkv, r, groups, Dv], [Hkv, r, groups]
            r = call.rows.numel()
            if call.merged is None and call.first is not None:  # a run of rows, each done: written in place
                out[call.first : call.first + r].view(r, o.shape[0], o.shape[2], -1).copy_(o.transpose(0, 1))
                continue
            if call.merged is not None and call.direct is None and call.at is not None:  # a run of merged rows
                c, at = call.start // self.size, call.at
                outs[c, at : at + r].view(r, o.shape[0], o.shape[2], -1).copy_(o.transpose(0, 1))
                lses[c, at : at + r, :hq].view(r, o.shape[0], o.shape[2]).copy_(lse.transpose(0, 1))
                continue
            o = _rows(o)
            if call.direct is not None:
                picks, rows = call.direct
                out.index_copy_(0, rows, o if call.merged is None else o.index_select(0, picks))
            if call.merged is not None:
                picks, at = call.merged
                c = call.start // self.size
                outs[c].index_copy_(0, at, o.index_select(0, picks))
                lses[c, :, :hq].index_copy_(0, at, _rows(lse).index_select(0, picks).float())
        if many:
            merged = _merge(outs, lses, hq)
            if self.merged_first is not None:
                out[self.merged_first : self.merged_first + many] = merged
            else:
                out.index_copy_(0, self.merged, merged)


def _merge(outs: torch.Tensor, lses: torch.Tensor, heads: int) -> torch.Tensor:
    """Each row's attention from its chunks' outputs ``outs`` [C, R, Hq, Dv] and log-sum-exps ``lses`` [C, R, P]
    (P >= Hq, a multiple of 32): weights exp(lse - max) / their sum, summed in chunk order. Each op is elementwise
    (the exp over whole rows of 32 values, fewer than ATen's parallel grain at a time, so every value takes the same
    vector loop), so a row's result does not depend on how many rows are merged with it."""
    step = max(1, _SLICE // lses.shape[0])
    parts = []
    for s in range(0, outs.shape[1], step):
        o, lse = outs[:, s : s + step], lses[:, s : s + step]
        w = torch.exp(lse - lse.amax(0))
        total = w[0]
        for c in range(1, w.shape[0]):
            total = total + w[c]
        terms = (w / total)[:, :, :heads, None].to(o.dtype) * o
        acc = terms[0]
        for c in range(1, terms.shape[0]):
            acc = acc + terms[c]
        parts.append(acc)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _call(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, call: _Call, scale: float | None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``call.rows`` of ``q`` [Hq, T, D] over ``call.keys`` keys of ``keys``/``values`` [Hkv, S, D] from
    ``call.start`` on, one kernel call whose batch is the key/value heads and whose heads are (row, query head of that
    key head); -> (out [Hkv, r, groups, Dv], log-sum-exp [Hkv, r, groups]): query head ``g * groups + j``."""
    hq, _, d = q.shape
    hkv = keys.shape[0]
    groups, r = hq // hkv, call.rows.numel()
    picked = q[:, call.first : call.first + r] if call.first is not None else q.index_select(1, call.rows)
    qs = picked.view(hkv, groups, r, d).transpose(1, 2).reshape(hkv, r * groups, 1, d)
    span = slice(call.start, call.start + call.keys)
    k = keys[:, None, span].expand(hkv, r * groups, call.keys, d)
    v = values[:, None, span].expand(hkv, r * groups, call.keys, values.shape[-1])
    mask = call.mask(groups, q.dtype, q.device)
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, k, v, 0.0, False, attn_mask=mask,
                                                                            scale=scale)
    else:  # (other devices: the same arithmetic in plain ops; invariance is a CPU promise)
        scores = qs @ k.transpose(-1, -2) * (scale if scale is not None else d**-0.5)
        scores = scores if mask is None else scores + mask
        lse = scores.logsumexp(-1)
        o = (scores - lse[..., None]).exp() @ v
    return o.view(hkv, r, groups, -1), lse.view(hkv, r, groups)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[Hkv, r, groups, ...] -> [r, Hq, ...] (query head g * groups + j)."""
    return x.transpose(0, 1).reshape(x.shape[1], x.shape[0] * x.shape[2], *x.shape[3:])


@dataclass
class RowPlan:
    """One batch row's query rows by how they attend (:func:`plan_rows`)."""

    head_dim: int
    prefix: _Schedule  # rows over a prefix of the keys
    gathered: list[tuple[int, int, int, torch.Tensor]]  # (row, n, p, tail): the first p keys, then those at tail
    empty: list[int]  # rows that see no key (padding, never read)
    device: object = None
    _single: dict = field(default_factory=dict)  # n -> the schedule of one gathered row over n keys

    def single(self, n: int) -> _Schedule:
        if n not in self._single:
            self._single[n] = _Schedule([0], [n], self.head_dim, self.device)
        return self._single[n]


def plan_rows(allowed: torch.Tensor, head_dim: int, device) -> list[RowPlan]:
    """Per batch row, its query rows by how they attend, from ``allowed`` [batch, rows, keys] bool on the host (the
    one host read of a forward's mask); index tensors on ``device``."""
    plans = []
    for seen_by_row in allowed:
        rows, lengths, gathered, empty = [], [], [], []
        for i, seen in enumerate(seen_by_row):
            idx = seen.nonzero().squeeze(1)
            n = idx.numel()
            if n == 0:
                empty.append(i)
            elif int(idx[-1]) != n - 1:  # not a prefix: its leading run of keys 0, 1, ..., p - 1, then the rest
                run = int((idx == torch.arange(n)).cumprod(0).sum())
                gathered.append((i, n, run, idx[run:].to(device)))
            else:
                rows.append(i)
                lengths.append(n)
        plans.append(RowPlan(head_dim, _Schedule(rows, lengths, head_dim, device), gathered, empty, device))
    return plans


def _keys(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` keys of ``x`` [heads, S, dim], read past ``S`` where the memory behind the view holds them
    (a cache's spare slots, or the next head's), else padded with zeros. A bucket's mask hides them, so they must only
    be finite (0 * inf is NaN): pardec's caches (preallocated, ragged) zero their buffers when they make them, and
    transformers' dynamic cache holds exactly its keys (padded here); NaN logits would be caught by
    :mod:`pardec.models.finite`."""
    heads, s, dim = x.shape
    if n <= s:
        return x
    st = x.stride()
    end = x.storage_offset() + (heads - 1) * st[0] + (n - 1) * st[1] + (dim - 1) * st[2]
    if end < x.untyped_storage().nbytes() // x.element_size():
        return x.as_strided((heads, n, dim), st, x.storage_offset())
    return torch.cat([x, x.new_zeros(heads, n - s, dim)], 1)


def attend(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plans: list[RowPlan], scale: float | None
           ) -> torch.Tensor:
    """Query ``q`` [B, Hq, T, D] over ``key``/``value`` [B, Hkv, S, D] as ``plans`` say -> [B, T, Hq, D]."""
    batch, heads, rows, _ = q.shape
    out = q.new_empty(batch, rows, heads, value.shape[-1])
    for b, plan in enumerate(plans):
        qb, kb, vb, ob = q[b], key[b], value[b], out[b]
        plan.prefix.run(qb, kb, vb, scale, ob)
        for i in plan.empty:
            ob[i] = 0
        if not plan.gathered:
            continue
        # gathered rows share one scratch buffer: its first ``valid`` slots hold the cache's first keys, so each
        # row copies only what it lacks of its leading run and then its few tail keys, not its whole prefix
        width = max(plan.single(n).width for _, n, _, _ in plan.gathered)
        sk, sv = kb.new_zeros(kb.shape[0], width, kb.shape[-1]), vb.new_zeros(vb.shape[0], width, vb.shape[-1])
        valid = 0
        for i, n, run, tail in plan.gathered:
            if valid < run:
                sk[:, valid:run] = kb[:, valid:run]
                sv[:, valid:run] = vb[:, valid:run]
            sk[:, run:n] = kb.index_select(1, tail)
            sv[:, run:n] = vb.index_select(1, tail)
            valid = run  # the slots from ``run`` on now hold this row's tail
            plan.single(n).run(qb[:, i : i + 1], sk, sv, scale, ob[i : i + 1])
    return out


#: the last forward's plan: every layer of a forward gets the same mask, so it is read once per forward, not per layer
_LAST: dict = {"mask": None, "key": None, "plan": None}


def _plan(mask: torch.Tensor | None, batch: int, rows: int, keys: int, head_dim: int, device, first: bool
          ) -> list[RowPlan]:
    """:func:`plan_rows` of the mask, read at a forward's ``first`` layer and by any layer given another mask object
    (a weak reference: a freed mask is never mistaken for a new one) or other shapes; the forward's other layers reuse
    it. (Masks are made anew for every forward and are inference tensors, which have no version counter to check.)"""
    key = (batch, rows, keys, head_dim, str(device), None if mask is None else tuple(mask.shape))
    held = _LAST["mask"]
    same = (held is None) if mask is None else (held is not None and held() is mask)
    if not first and same and _LAST["key"] == key:
        return _LAST["plan"]
    plan = plan_rows(_allowed(mask, batch, rows, keys, device).cpu(), head_dim, device)  # the one host read
    _LAST.update(mask=None if mask is None else weakref.ref(mask), key=key, plan=plan)
    return plan


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query [B, H, T, D], key/value [B, H_kv, S, D]) -> ([B, T, H, D],
    None): :func:`attend` over the keys each row may see."""
    if dropout:
        raise ValueError(f"attn_implementation={NAME!r} is for inference: dropout {dropout} given")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"attn_implementation={NAME!r} supports plain masked attention only (no softcap, bias, sinks)")
    batch, _, rows, head_dim = query.shape
    first = getattr(module, "layer_idx", 0) == 0
    plans = _plan(attention_mask, batch, rows, key.shape[2], head_dim, key.device, first)
    return attend(query, key, value, plans, scaling), None


def register() -> None:
    """Make ``attn_implementation="invariant"`` known to transformers (attention and mask interfaces; the masks are
    SDPA's: None when causal, else a 4D bool mask)."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
