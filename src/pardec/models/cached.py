"""The cached-model seam: the only module that touches transformers' KV cache and mask internals.

Every decoder talks to the target (and draft) model through :class:`CachedModel`'s verbs:

* ``prefill(ids)``                               -> logits of the last prompt position
* ``forward(ids, positions, attend, ...)``       -> logits of the new positions (all, the last, or chosen
  ones), optionally the hidden states entering a chosen layer; the new tokens are appended to the cache
* ``run_upper(hidden, layer, positions, attend)`` -> logits of injected hidden states run through layers
  ``layer..L-1``, the final norm and the LM head, seeing the cache; nothing is appended (FIRP's pseudo states)
* ``forward_pseudo(ids, project, layers, anchors)`` -> ``forward`` plus K pseudo hidden states per anchor, born
  at intermediate layers by ``project`` and run through the rest of the model, seeing real states only (FIRP §3.3)
  or also each other (``attention``); they are not kept (FIRP)
* ``truncate(length)``                           -> drop cached positions past ``length``
* ``keep(indices, start)``                       -> keep a subset of the positions from ``start`` on (default: the
  last-appended ones; tree paths, a chosen beam)
* ``sync(seq)``                                  -> truncate to the common prefix with a committed sequence
  and return the tokens still to feed (a draft model catching up with the target's output)
* ``take_rows(rows)`` / ``join_rows(other)``     -> move batch rows into a new CachedModel / append another's
  rows (the shorter cache left-padded): rows leaving and joining a batch (continuous batching)
* ``length`` / ``tokens`` / ``rows``             -> cached positions / the token ids they hold / batch rows

Visibility: by default a new token sees every cached position and the new tokens before it. ``attend`` narrows
that: a bool ``[T, T]`` mask among the new tokens (a tree: each token sees its ancestors), or ``[T, length+T]``
over cached and new positions, so that branches an earlier forward left in the cache (several drafts, beams)
stay invisible to each other.

Every forward checks its logits: NaN or inf raises :class:`NonFiniteLogitsError` naming the model and the
position, instead of decoding garbage. On the CPU the check runs at once (the forward raises). On an accelerator it
costs no host sync in the forward: a device-side flag per forward is copied to the host asynchronously and read when
the model is next used (the next forward, ``run_upper``, ``forward_pseudo``, ``prefill``/``reset``, ``tokens``,
``sync``) or by :meth:`CachedModel.check_finite`; by then the caller has read the logits, so the read waits for
nothing. The error then comes one call later, before that call computes anything (a token decoded from bad logits
is never run through the model); call ``check_finite()`` after the last forward to surface one it produced.

The KV cache (``cache=``): ``"preallocated"`` (the default, :mod:`pardec.models.kvcache`) writes new keys in place
into buffers that grow by doubling, truncates by moving a length, compacts only the kept positions and moves batch
rows without copying the others where it can; ``"dynamic"`` is transformers' ``DynamicCache`` (a concatenation per
forward; kept for comparison and for models with non-attention layers). The reasons, and why not transformers'
``StaticCache``, are in that module's docstring. The token ids the cache holds are kept where they arrived (the
caller's host tensors, or device tensors): no copy back to the host per forward; :attr:`CachedModel.tokens` gathers
them on the host when read.

Facts this file relies on (transformers 5.2x): a 4D attention mask must be an *additive* float mask
(0 where attended, ``finfo.min`` elsewhere) passed with explicit ``position_ids`` (a bool mask is silently
wrong under eager attention); ``DynamicCache.crop(-n)`` removes ``n`` positions (positive values raise);
``logits_to_keep`` takes an int (the last n) or a tensor of positions; Llama-style models keep their decoder
layers in ``model.model.layers`` with ``model.model.norm``, ``model.model.rotary_emb`` and ``model.lm_head``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from transformers import DynamicCache, PreTrainedModel

from pardec.config import FORWARD_IMPLS
from pardec.config import KV_CACHES as CACHES
from pardec.models import compiled, lean
from pardec.models.compat import cache_kw, output_cache
from pardec.models.kvcache import PreallocatedCache, to_device

#: CACHES: the KV caches a CachedModel can use (``cache=``; module docstring)

#: what a FIRP pseudo state attends to (:meth:`CachedModel.forward_pseudo`): real states only (FIRP §3.3) or also the
#: anchor's earlier pseudo states
PSEUDO_ATTENTION = ("real", "pseudo")
#: what a pseudo state sees when FIRP decodes, by default: the anchor's earlier pseudo states too (FIRP §4.3 / Fig. 7,
#: "No masked", the paper's inference); ``real`` is its "Masked" ablation
DECODING_ATTENTION = "pseudo"


class FlashAttentionMaskError(ValueError):
    """A forward needs a custom attention mask and the model runs flash_attention_2, which cannot take one."""


class NonFiniteLogitsError(RuntimeError):
    """A model produced NaN or inf logits; the message names the model and the position."""


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, T', V]: every new position, the last one, or the ``logits_at`` ones
    hidden: torch.Tensor | None = None  # [B, T, H] entering the layer asked for (``hidden_layer``)


@dataclass
class PseudoOut:
    logits: torch.Tensor  # [B, T', V] of the new tokens (all, or the ``logits_at`` ones)
    pseudo: torch.Tensor  # [B, A, K, H] pseudo states after the final norm (LM head input): anchor a, step i
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer input (+ the last output): new
    #: tokens [B, T, H] and pseudo states born so far [B, A, i, H]; ``capture=True`` only


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, Q, K] bool (True = may attend) -> [B, 1, Q, K] additive float mask: 0 = attend, finfo.min = masked (the
    form transformers needs for a 4D mask, with explicit position ids)."""
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` [B, H, L, D] with ``n`` zero positions prepended."""
    return torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2) if n else t


class _TokenLog:
    """The token ids of the cached positions, ``[rows, length]``, as chunks left where they arrived (a forward's ids,
    on the host or on the device: no copy to the host per forward); :meth:`host` gathers them on the host."""

    def __init__(self, rows: int = 1, parts: list[torch.Tensor] | None = None):
        self.rows = rows
        self.parts = [p for p in parts or [] if p.shape[1]]  # [rows, t_i] each

    @property
    def length(self) -> int:
        return sum(p.shape[1] for p in self.parts)

    def append(self, ids: torch.Tensor) -> None:
        if ids.shape[0] != self.rows:  # the first forward after a reset sets the batch size
            self.parts = [p.expand(ids.shape[0], -1) for p in self.parts]
            self.rows = ids.shape[0]
        self.parts.append(ids)
        if len(self.parts) > 16:  # merge neighbours on the same device (host and device chunks stay apart)
            merged: list[torch.Tensor] = []
            for p in self.parts:
                if merged and merged[-1].device == p.device:
                    merged[-1] = torch.cat([merged[-1], p], dim=1)
                else:
                    merged.append(p)
            self.parts = merged

    def dense(self, device: torch.device | None = None) -> torch.Tensor:
        """All of them as one tensor, on ``device`` (default: the last chunk's)."""
        if not self.parts:
            return torch.zeros(self.rows, 0, dtype=torch.long, device=device)
        dev = device or self.parts[-1].device
        parts = [to_device(p, dev) for p in self.parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def host(self) -> torch.Tensor:
        out = self.dense(torch.device("cpu"))
        self.parts = [out] if out.shape[1] else []
        return out

    def _split(self, at: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        head, tail, seen = [], [], 0
        for p in self.parts:
            n = p.shape[1]
            if seen + n <= at:
                head.append(p)
            elif seen >= at:
                tail.append(p)
            else:
                head.append(p[:, : at - seen])
                tail.append(p[:, at - seen :])
            seen += n
        return head, tail

    def truncate(self, length: int) -> None:
        self.parts = self._split(length)[0]

    def host_prefix(self) -> int:
        """How many leading positions sit in chunks on the host (the rest arrived as device tensors)."""
        n = 0
        for p in self.parts:
            if p.device.type != "cpu":
                break
            n += p.shape[1]
        return n

    def settle(self, start: int, values: list[int]) -> None:
        """Positions ``start`` .. are ``values`` (batch 1; known on the host): keep them as a host chunk."""
        head = self._split(start)[0]
        self.parts = [*head, torch.tensor([values], dtype=torch.long)] if values else head

    def keep(self, start: int, idx: torch.Tensor) -> None:
        """Keep positions ``start + idx`` of those from ``start`` on (``idx`` on the host)."""
        head, tail = self._split(start)
        rest = _TokenLog(self.rows, tail).dense()
        self.parts = [p for p in [*head, rest[:, to_device(idx, rest.device)]] if p.shape[1]]

    def select(self, rows: list[int]) -> _TokenLog:
        index = torch.tensor(rows, dtype=torch.long)
        return _TokenLog(len(rows), [p[index.to(p.device)] for p in self.parts])

    def join(self, other: _TokenLog, pad_self: int, pad_other: int) -> _TokenLog:
        """These rows then ``other``'s, each side left-padded with token 0."""
        a = self.dense()
        b = other.dense(a.device)
        pad = lambda t, n: torch.cat([t.new_zeros(t.shape[0], n), t], dim=1)  # noqa: E731
        return _TokenLog(self.rows + other.rows, [torch.cat([pad(a, pad_self), pad(b, pad_other)], dim=0)])


def auto_forward_impl(model: PreTrainedModel, cache: str = "preallocated") -> str:
    """``forward_impl=auto``: the fastest exact forward that runs ``model`` where its weights are. On CUDA
    ``cudagraph`` (7B on an H200: 10.7x ``generate()``, README "On a GPU"; it needs the preallocated cache), else
    ``lean``; on the CPU ``lean`` (fp32 and int8 ``ar`` 1.10x ``hf``'s on a 2-core EPYC, README "forward_impl=lean";
    ``compiled``'s fp32 step was no faster than lean's there, 58.3 vs 57.7 ms, and it compiles first). ``hf`` where
    the others cannot run the model (split over several devices, another architecture or attention kernel)."""
    if cache != "preallocated":  # (the lean and compiled forwards are measured and tested on pardec's own cache)
        return "hf"
    if next(model.parameters()).device.type == "cuda" and compiled.unsupported(model) is None:
        return "cudagraph"
    return "lean" if lean.unsupported(model) is None else "hf"


class CachedModel:
    """An HF causal LM plus its KV cache. Batch size is fixed by the first forward after a reset.

    ``cache``: ``"preallocated"`` or ``"dynamic"`` (module docstring); default :attr:`default_cache`.
    ``forward_impl``: ``"hf"`` (``model(...)``), ``"lean"`` (:mod:`pardec.models.lean`, Llama-family models: the
    same ops without transformers' module stack), ``"compiled"`` or ``"cudagraph"`` (:mod:`pardec.models.compiled`);
    default :attr:`default_forward_impl`."""

    #: the KV cache a CachedModel gets when ``cache`` is not given
    default_cache = "preallocated"
    #: the forward a CachedModel gets when ``forward_impl`` is not given ("hf" or "lean": :mod:`pardec.models.lean`)
    default_forward_impl = "hf"

    def __init__(self, model: PreTrainedModel, name: str | None = None, cache: str | None = None,
                 forward_impl: str | None = None):
        self.model = model.eval()
        self.config = model.config
        self.name = name or getattr(model.config, "_name_or_path", "") or type(model).__name__
        self.cache_kind = cache or self.default_cache
        if self.cache_kind not in CACHES:
            raise ValueError(f"cache={self.cache_kind!r} is not valid; choose one of: {', '.join(CACHES)}")
        forward_impl = forward_impl or self.default_forward_impl
        if forward_impl == "auto":
            forward_impl = auto_forward_impl(model, self.cache_kind)
        if forward_impl not in FORWARD_IMPLS:
            raise ValueError(f"forward_impl={forward_impl!r} is not valid; choose one of: auto, "
                             f"{', '.join(FORWARD_IMPLS)}")
        check = {"lean": lean.unsupported, "compiled": compiled.unsupported,
                 "cudagraph": compiled.unsupported}.get(forward_impl)
        if check is not None and (why := check(model)) is not None:
            raise ValueError(f"forward_impl={forward_impl} cannot run model {self.name!r}: {why}; use forward_impl=hf")
        if forward_impl == "cudagraph" and (dev := next(model.parameters()).device).type != "cuda":
            raise ValueError(f"forward_impl=cudagraph replays CUDA graphs and needs a model on a CUDA device; model "
                             f"{self.name!r} is on {dev}: use forward_impl=compiled there")
        if forward_impl in ("compiled", "cudagraph"):
            if self.cache_kind != "preallocated":
                raise ValueError(f"forward_impl={forward_impl} needs cache='preallocated' (it writes the preallocated "
                                 f"buffers in place); got cache={self.cache_kind!r}")
            compiled.register_opaque(model)
        #: "hf": every forward is ``model(...)``; "lean": ``forward``/``prefill`` run :mod:`pardec.models.lean`;
        #: "compiled": lean, with one-token steps as one compiled graph (:mod:`pardec.models.compiled`);
        #: "cudagraph": compiled, each one-token step a replay of a captured CUDA graph (CUDA only)
        self.forward_impl = forward_impl
        self.cache = self._new_cache()
        self._tokens = _TokenLog()  # the token ids held by the cache, [rows, length]
        self._last_appended = 0  # positions appended by the most recent forward (for ``keep``)
        #: per forward on an accelerator, not yet read: (finite [B, T'] on the device, all-finite flag, the event
        #: after its copy to the host (CUDA) or None, (past, t, last_only, kept)) (module docstring)
        self._unchecked: list[tuple] = []
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
        return self.model.device

    @property
    def head_device(self) -> torch.device:
        """Where the final norm and the LM head read their input: ``device`` unless the model is split over several
        devices (``model.device_map``), where it is the last one's."""
        return self._inner().norm.weight.device

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
        old, self.cache = self.cache, self._new_cache()
        if self.forward_impl == "cudagraph" and isinstance(old, PreallocatedCache):
            self.cache.reuse(old)  # (the graphs are keyed by the cache's buffers: keep them from prompt to prompt)
        self._tokens = _TokenLog()
        self._last_appended = 0

    def check_finite(self) -> None:
        """Raise :class:`NonFiniteLogitsError` if an earlier forward's logits held NaN/inf (on an accelerator the
        check is deferred to the next use of the model: module docstring). Reads flags the device already copied
        to the host: no wait once the caller has read that forward's logits."""
        pending, self._unchecked = self._unchecked, []
        for finite, ok, done, where in pending:
            if done is not None:
                done.synchronize()
            if not bool(ok):
                self._raise_non_finite(finite, *where, late=True)

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
        hidden_layer: int | None = None,
    ) -> ForwardOut:
        """Run new tokens ``ids`` [B, T] after the cached ones and append them to the cache.

        positions:    [B, T] or [T] absolute positions; default ``length .. length+T-1``.
        attend:       bool [T, T] / [B, T, T] (new token i sees new token j; cached positions all visible) or
                      [T, length+T] / [B, T, length+T] (over cached and new positions); default causal.
        key_valid:    bool [B, length+T], False for padding positions nobody may attend to.
        last_only:    logits of the last new position only ([B, 1, V]).
        logits_at:    indices of the new positions whose logits are wanted ([B, len, V]); saves the LM head's
                      work on the others.
        hidden_layer: also return the hidden states entering decoder layer ``hidden_layer`` (0 = embeddings;
                      ``num_layers`` = after the final norm, what the LM head reads: Medusa's heads).
        """
        self.check_finite()
        if ids.dim() == 1:
            ids = ids[None]
        given = ids  # the token log keeps the caller's ids where they are (host ids: no copy back)
        ids = to_device(ids, self.device)
        bsz, t = ids.shape
        past = self.length
        positions = self._positions(positions, bsz, t, past)
        # a verification (several new rows after a cached prefix): compiled: one compiled function for every row
        # count; cudagraph: that function replayed as a graph captured per row count (a power of two)
        several = t > 1 and past and not last_only
        graphs = self.forward_impl == "cudagraph"
        # (under cudagraph a graph per width past the limit would pile up: those run the lean forward)
        rows = several and self.forward_impl in ("compiled", "cudagraph") and not (
            graphs and t > compiled.MAX_GRAPHED_ROWS)
        if rows and graphs:
            pad = compiled.graph_rows(t) - t
        else:
            pad = self.cost.cheapest_at_least(t) - t if self.cost is not None and several else 0
        if pad:
            ids, positions, attend, key_valid = self._padded(ids, positions, attend, key_valid, pad, past)
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
        captured: list[torch.Tensor] = []
        logits = None
        if rows and tail_at is None and (hidden_layer is None or 0 <= hidden_layer <= self.num_layers):
            logits = self._compiled_rows(ids, positions, kwargs, past, hidden_layer, captured)
        if logits is None:
            logits = self._run(ids, positions, kwargs, past, hidden_layer, tail_at, captured)
        if tail_at is not None:
            logits = logits[:, tail_at.to(logits.device)]
            kwargs["logits_to_keep"] = tail_at + (width - kwargs["logits_to_keep"])
        if pad:  # the padding rows leave the cache and their outputs are never read
            self.cache.crop(-pad)
            ids = ids[:, :t]
            if logits_at is None:
                logits = logits[:, :t]
            if captured:
                captured[0] = captured[0][:, :t]
            self.padded_rows += pad
        self._tokens.append(given.to(torch.long, copy=True))
        self._last_appended = t
        self._check_finite(logits, past, t, last_only, kwargs.get("logits_to_keep"))
        return ForwardOut(logits, captured[0] if captured else None)

    def _compiled_rows(self, ids, positions, kwargs, past: int, hidden_layer: int | None,
                       captured: list[torch.Tensor]) -> torch.Tensor | None:
        """``forward_impl=compiled``'s and ``cudagraph``'s multi-row forward (:func:`pardec.models.compiled.rows_step`,
        graphed under cudagraph); None when the cache's layout does not allow it."""
        mask = kwargs.get("attention_mask")
        if mask is None:  # causal after the cached prefix
            mask = self._additive_mask(ids.shape[0], ids.shape[1], past, None, None)
        graphs = self.forward_impl == "cudagraph"
        keep = kwargs.get("logits_to_keep")  # (None or position indices: last_only forwards do not come here)
        out = compiled.rows_step(self.model, ids, positions, mask, self.cache, hidden_layer, graphs=graphs,
                                 keep=None if graphs else keep)
        if out is None:
            return None
        self.graphed_forwards += graphs
        if hidden_layer is not None:
            out, hidden = out
            captured.append(hidden)
        return out[:, keep] if graphs and keep is not None else out

    def _run(self, ids, positions, kwargs, past: int, hidden_layer: int | None, tail_at,
             captured: list[torch.Tensor]) -> torch.Tensor:
        """The forward's logits through the lean / compiled forward or transformers' (which also fills ``captured``
        with the hidden states ``hidden_layer`` asks for)."""
        bsz, width = ids.shape
        if self.forward_impl != "hf" and hidden_layer is None and tail_at is None:
            mask = kwargs.get("attention_mask")
            keep = kwargs.get("logits_to_keep")
            one = not isinstance(keep, torch.Tensor) or keep.numel() == 1  # (the step returns the one row's logits)
            logits = None
            if self.forward_impl in ("compiled", "cudagraph") and width == 1 and mask is None and one:
                logits = compiled.decode_step(self.model, ids, positions, self.cache,
                                              graphs=self.forward_impl == "cudagraph")
            if logits is None:
                if mask is None and width > 1 and past:  # causal after a cached prefix: SDPA's flag aligns top-left
                    mask = self._additive_mask(bsz, width, past, None, None)
                logits = lean.lean_logits(self.model, ids, positions, mask, self.cache, keep)
            return logits
        hook = None
        if hidden_layer is not None and hidden_layer == self.num_layers:
            hook = self._inner().norm.register_forward_hook(lambda _m, _args, out: captured.append(out))
        elif hidden_layer is not None:
            hook = self._layer(hidden_layer).register_forward_pre_hook(
                lambda _m, args, kw: captured.append(args[0] if args else kw["hidden_states"]), with_kwargs=True)
        try:
            out = self.model(input_ids=ids, position_ids=positions, **cache_kw(self.model, self.cache),
                             use_cache=True, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        self.cache = output_cache(out)
        return out.logits

    @torch.inference_mode()
    def run_upper(
        self,
        hidden: torch.Tensor,
        layer: int,
        positions: torch.Tensor,
        attend: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, T, V] of hidden states ``hidden`` [B, T, H] injected *entering* decoder layer ``layer`` at
        ``positions`` ([T] or [B, T]) and run through layers ``layer..L-1``, the final norm and the LM head.

        They see every cached position of those layers (narrowed by ``attend`` as in :meth:`forward`) and each
        other causally by default; their keys and values are not kept, so the cache is unchanged afterwards.
        """
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer={layer} is out of range: the model has layers 0..{self.num_layers - 1}")
        self.check_finite()
        inner = self._inner()
        hidden = hidden.to(self.device, self.dtype)
        if hidden.dim() == 2:
            hidden = hidden[None]
        bsz, t, _ = hidden.shape
        past = self.length
        positions = self._positions(positions, bsz, t, past)
        mask = self._additive_mask(bsz, t, past, attend, None)
        rope = inner.rotary_emb(hidden, position_ids=positions)
        self._transient(past)
        try:
            for block in inner.layers[layer : self.num_layers]:
                hidden = block(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions,
                               **cache_kw(block, self.cache), use_cache=True)
        finally:  # the layers appended the injected states' keys/values to their caches: drop them
            self._transient(None)
            self._drop_keys_after(past)
        logits = self.model.lm_head(inner.norm(hidden))
        self._check_finite(logits, past, t, False, None)
        return logits

    def forward_pseudo(
        self,
        ids: torch.Tensor,
        project: Callable[[int, torch.Tensor], torch.Tensor],
        layers: list[int],
        anchors: list[int] | torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attend: torch.Tensor | None = None,
        logits_at: torch.Tensor | list[int] | None = None,
        capture: bool = False,
        split: bool = False,
        attention: str = "real",
        teacher_forced: bool = False,
        checkpoint: bool = False,
    ) -> PseudoOut:
        """FIRP's forward: new tokens ``ids`` [B, T] as in :meth:`forward` (appended to the cache), plus K pseudo
        hidden states per anchor that are *not* kept.

        Pseudo state ``i`` (0-based) of anchor ``a`` (an index into the new tokens) is born entering layer
        ``layers[i]`` as ``project(i, h)``, ``h`` [B, A, H] = the anchors' hidden states entering that layer, with
        position ``pos[a] + i + 1``; from there it runs through the remaining layers and sees (``attention``):

        * ``"real"`` (FIRP §3.3, the default): real states only, and itself. The pseudo state of position j + i
          sees the real states of positions up to j + i - 1 that exist: what its anchor sees (cached and new
          tokens, as ``attend`` says) and, with ``teacher_forced`` (training on a known sequence: ``attend`` None,
          the new tokens after an anchor are its true continuation), the new tokens ``a + 1 .. a + i`` too.
          Decoding has no real state after the anchor, so there it sees the anchor's view and itself. No pseudo
          state sees another, so step i depends on projection i alone (each projection trains on its own);
        * ``"pseudo"`` (pardec's earlier pattern): what its anchor sees, the anchor's earlier pseudo states (stand-ins
          for the real states in between) and itself.

        The new tokens never see pseudo states, so their logits and cache entries are those of :meth:`forward`. Its
        output after the final norm predicts the token after position ``pos[a] + i + 1``.

        Not under ``inference_mode``: training calls it with gradients (the callers of decoding wrap it).
        ``capture``: also return every layer's input for the new tokens and the pseudo states (analyses).
        ``split``: run the new tokens through every layer first, without gradients, then the pseudo states alone
        over the cache they left (same result, since the new tokens never see pseudo states): training, where
        only the pseudo states need a backward pass; one pass (the default) is one forward when decoding.
        ``checkpoint`` (with ``split``, under autograd): gradient checkpointing of the upper layers the pseudo
        states run through: each layer keeps only its input and recomputes the rest in backward (a 7B target's
        upper layers over ~K x T pseudo states otherwise keep every activation). The recompute runs after this call
        returned, so a layer's run over the pseudo states leaves nothing in the cache and sees only its first
        ``length`` positions (the real ones this call kept): the same keys in forward and in backward.
        """
        inner = self._inner()
        self.check_finite()
        if ids.dim() == 1:
            ids = ids[None]
        given = ids
        ids = to_device(ids, self.device)
        bsz, t = ids.shape
        past = self.length
        k = len(layers)
        if k < 1 or any(not 0 <= x < self.num_layers for x in layers):
            raise ValueError(f"pseudo layers={list(layers)} are out of range: give 1+ indices in "
                             f"0..{self.num_layers - 1}")
        if list(layers) != sorted(layers):
            raise ValueError(f"pseudo layers={list(layers)} are not valid: they must be nondecreasing")
        if attention not in PSEUDO_ATTENTION:
            raise ValueError(f"pseudo attention={attention!r} is not valid; choose one of: "
                             f"{', '.join(PSEUDO_ATTENTION)}")
        if teacher_forced and (attention != "real" or attend is not None):
            raise ValueError("forward_pseudo: teacher_forced needs attention='real' and a plain causal input "
                             "(attend=None)")
        anchors = torch.arange(t) if anchors is None else torch.as_tensor(anchors, dtype=torch.long).cpu()
        n_a = anchors.numel()
        if n_a and (int(anchors.min()) < 0 or int(anchors.max()) >= t):
            raise ValueError(f"anchors {anchors.tolist()} out of range for {t} new tokens")
        positions = self._positions(positions, bsz, t, past)
        anc_dev = to_device(anchors, self.device)
        pseudo_pos = (positions[:, anc_dev, None] + torch.arange(1, k + 1, device=self.device)).transpose(1, 2)
        all_pos = torch.cat([positions, pseudo_pos.reshape(bsz, k * n_a)], dim=1)  # rows: new, then (i, a)
        # visibility over [cached, new, pseudo (i, a) in row order]
        real = self._allowed(bsz, t, past, attend, None)  # [B, T, past+T]
        n = t + k * n_a
        allowed = torch.zeros(bsz, n, past + n, dtype=torch.bool, device=self.device)
        allowed[:, :t, : past + t] = real
        own = torch.arange(k, device=self.device)
        # [K, K]: step i sees step i' (of the same anchor): itself only ("real"), or i' <= i ("pseudo")
        sees_pseudo = own[None, :] == own[:, None] if attention == "real" else own[None, :] <= own[:, None]
        same = torch.eye(n_a, dtype=torch.bool, device=self.device)
        block = (sees_pseudo[:, None, :, None] & same[None, :, None, :]).reshape(k * n_a, k * n_a)
        allowed[:, t:, : past + t] = real[:, anc_dev].repeat(1, k, 1)
        if teacher_forced:  # step i of anchor a also sees the true tokens a + 1 .. a + i (positions < its own)
            new_idx = torch.arange(t, device=self.device)
            ahead = (new_idx[None, None, :] > anc_dev[None, :, None]) & \
                (new_idx[None, None, :] <= anc_dev[None, :, None] + own[:, None, None])  # [K, A, T]
            allowed[:, t:, past : past + t] |= ahead.reshape(k * n_a, t)[None]
        allowed[:, t:, past + t :] = block
        mask = self._to_additive(allowed)
        hidden = inner.embed_tokens(ids)
        rope = inner.rotary_emb(hidden, position_ids=all_pos)
        if split and capture:
            raise ValueError("forward_pseudo: capture needs split=False")
        if checkpoint and not split:
            raise ValueError("forward_pseudo: checkpoint needs split=True (training)")
        if split:
            return self._pseudo_split(given, ids, hidden, project, layers, anc_dev, all_pos, rope, mask, logits_at,
                                      checkpoint)
        born = 0
        caught: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._transient(past + t)
        try:
            for layer in range(self.num_layers):
                while born < k and layers[born] == layer:
                    h = hidden[:, anc_dev.to(hidden.device)]  # the anchors' own rows (new tokens come first)
                    hidden = torch.cat([hidden, project(born, h).to(hidden.device, hidden.dtype)], dim=1)
                    born += 1
                m = t + born * n_a
                if capture:
                    caught.append((hidden[:, :t], hidden[:, t:]))
                hidden = inner.layers[layer](
                    hidden, attention_mask=mask[:, :, :m, : past + m],
                    position_embeddings=tuple(x[:, :m] for x in rope), position_ids=all_pos[:, :m],
                    **cache_kw(inner.layers[layer], self.cache), use_cache=True)
        finally:  # drop the pseudo states' keys/values (and everything on an error part-way)
            self._transient(None)
            self._drop_keys_after(past + t if born == k else past)
        normed = inner.norm(hidden)
        real_h = normed[:, :t]
        if logits_at is not None:
            real_h = real_h[:, to_device(torch.as_tensor(logits_at, dtype=torch.long), real_h.device)]
        logits = self.model.lm_head(real_h)
        self._tokens.append(given.to(torch.long, copy=True))
        self._last_appended = t
        self._check_finite(logits, past, t, False, None if logits_at is None else torch.as_tensor(logits_at))
        pseudo = normed[:, t:].reshape(bsz, k, n_a, -1).transpose(1, 2)  # [B, A, K, H]
        if capture:
            caught.append((hidden[:, :t], hidden[:, t:]))
        return PseudoOut(logits, pseudo, [(r, p.reshape(bsz, -1, n_a, p.shape[-1]).transpose(1, 2)) for r, p in caught]
                         if capture else None)

    def _pseudo_split(self, given, ids, hidden, project, layers, anc, all_pos, rope, mask, logits_at,
                      checkpoint: bool = False) -> PseudoOut:
        """:meth:`forward_pseudo` in two passes: the new tokens (no gradients), then the pseudo states alone."""
        inner = self._inner()
        bsz, t = ids.shape
        past, k, n_a = self.length, len(layers), anc.numel()
        births: dict[int, torch.Tensor] = {}
        pseudo = None
        born = 0
        self._transient(past + t)
        try:
            with torch.no_grad():
                for layer in range(self.num_layers):
                    if layer in layers:
                        births[layer] = hidden[:, anc.to(hidden.device)]
                    hidden = inner.layers[layer](
                        hidden, attention_mask=mask[:, :, :t, : past + t],
                        position_embeddings=tuple(x[:, :t] for x in rope), position_ids=all_pos[:, :t],
                        **cache_kw(inner.layers[layer], self.cache), use_cache=True)
                real = inner.norm(hidden)
            for layer in range(layers[0], self.num_layers):
                while born < k and layers[born] == layer:
                    into = births[layer] if pseudo is None else pseudo  # split models: layers on several devices
                    new = project(born, births[layer]).to(into.device, hidden.dtype)
                    pseudo = new if pseudo is None else torch.cat([pseudo, new], dim=1)
                    born += 1
                m = born * n_a
                args = (layer, pseudo, mask[:, :, t : t + m, : past + t + m],
                        tuple(x[:, t : t + m] for x in rope), all_pos[:, t : t + m], past + t)
                if checkpoint and torch.is_grad_enabled():
                    pseudo = torch.utils.checkpoint.checkpoint(self._pseudo_layer, *args, use_reentrant=False)
                else:
                    pseudo = self._pseudo_layer(*args)
        finally:
            self._transient(None)
            self._drop_keys_after(past + t if born == k else past)
        if logits_at is not None:
            real = real[:, torch.as_tensor(logits_at, dtype=torch.long, device=real.device)]
        with torch.no_grad():
            logits = self.model.lm_head(real)
        self._tokens.append(given.to(torch.long, copy=True))
        self._last_appended = t
        self._check_finite(logits, past, t, False, None if logits_at is None else torch.as_tensor(logits_at))
        out = inner.norm(pseudo).reshape(bsz, k, n_a, -1).transpose(1, 2)  # [B, A, K, H]
        return PseudoOut(logits, out)

    def _pseudo_layer(self, layer: int, pseudo: torch.Tensor, mask: torch.Tensor, rope: tuple, positions,
                      keep: int) -> torch.Tensor:
        """Decoder layer ``layer`` over pseudo states that see the cache's first ``keep`` positions and each other
        as ``mask`` says; their keys/values are not kept. Safe to run again in backward (gradient checkpointing)."""
        block = self._inner().layers[layer]
        before = self.cache.transient_from if isinstance(self.cache, PreallocatedCache) else None
        self._transient(keep)  # the preallocated cache stores nothing past ``keep``
        try:
            return block(pseudo, attention_mask=mask, position_embeddings=rope, position_ids=positions,
                         **cache_kw(block, self.cache), use_cache=True)
        finally:
            self._transient(before)
            self._drop_keys_after(keep)  # (a dynamic cache appended them)

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
        if isinstance(self.cache, PreallocatedCache):  # copies only the kept positions not yet in place
            self.cache.keep(start, idx)
        else:
            on: dict[torch.device, torch.Tensor] = {}  # layers of a split model (device_map) sit on several devices
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    at = on.setdefault(t.device, start + idx.to(t.device))
                    setattr(layer, name, torch.cat([t[..., :start, :], t[..., at, :]], dim=-2))
        self._tokens.keep(start, idx)
        self._last_appended = idx.numel()

    def take_rows(self, rows: torch.Tensor | list[int]) -> CachedModel:
        """Move batch ``rows`` (their cache and tokens) into a new CachedModel on the same model; this one keeps
        the other rows, in order. Used to park rows that need no more forwards, or to drop finished ones.

        With the preallocated cache the taken rows stay in this cache's buffers (moved in front of the kept ones
        where needed), so taking and joining back costs little (:mod:`pardec.models.kvcache`)."""
        taken = torch.arange(self.rows)[torch.as_tensor(rows, dtype=torch.long).cpu()].tolist()
        if len(set(taken)) != len(taken):
            raise ValueError(f"take_rows: rows {taken} repeat a row")
        rest = [i for i in range(self.rows) if i not in set(taken)]
        # the taken rows run as this model's rows do: same forward implementation, same forward-cost table
        other = CachedModel(self.model, self.name, cache=self.cache_kind, forward_impl=self.forward_impl)
        other.cost = self.cost
        if isinstance(self.cache, PreallocatedCache):
            other.cache = self.cache.take_rows(taken)
        else:
            idx, keep = torch.tensor(taken, dtype=torch.long), torch.tensor(rest, dtype=torch.long)
            for src, dst in zip(self._initialized_layers(), other._layers_for(self)):
                k, v = src.keys, src.values
                dst.lazy_initialization(k, v)
                dst.keys, dst.values = k[idx.to(k.device)], v[idx.to(v.device)]
                src.keys, src.values = k[keep.to(k.device)], v[keep.to(v.device)]
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
        after them (:mod:`pardec.models.kvcache`)."""
        if self.rows == 0 or not self._holds_keys():
            self.cache, self._tokens, self._last_appended = other.cache, other._tokens, 0
            return 0, 0
        pad_self, pad_other = max(0, other.length - self.length), max(0, self.length - other.length)
        if isinstance(self.cache, PreallocatedCache):
            self.cache.join_rows(other.cache, pad_self, pad_other)
        else:
            for a, b in zip(self._initialized_layers(), other._initialized_layers(), strict=True):
                for name in ("keys", "values"):
                    x, y = _left_pad(getattr(a, name), pad_self), _left_pad(getattr(b, name), pad_other)
                    setattr(a, name, torch.cat([x, y.to(x.device)], dim=0))
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
    def _new_cache(self):
        if self.cache_kind == "dynamic":
            return DynamicCache(config=self.config)
        return PreallocatedCache(self.config)

    def _holds_keys(self) -> bool:
        if isinstance(self.cache, PreallocatedCache):
            return self.cache.initialized
        return bool(self._initialized_layers())

    def _transient(self, start: int | None) -> None:
        """Positions from ``start`` on are dropped when the current call ends (None: that call ended)."""
        if isinstance(self.cache, PreallocatedCache):
            self.cache.transient_from = start

    def _initialized_layers(self) -> list:
        layers = [lc for lc in self.cache.layers if getattr(lc, "keys", None) is not None and lc.keys.dim() == 4]
        if layers and len(layers) != len(self.cache.layers):
            raise TypeError(f"{self.name}: rows can only move between caches whose layers all hold [B, H, L, D] "
                            f"keys (a dynamic cache); got {type(self.cache.layers[0]).__name__}")
        return layers

    def _layers_for(self, src: CachedModel) -> list:
        """This (fresh) cache's layers, one per initialized layer of ``src``."""
        n = len(src._initialized_layers())
        if len(self.cache.layers) < n:
            raise TypeError(f"{self.name}: a fresh cache has {len(self.cache.layers)} layers, {src.name} holds {n}")
        return list(self.cache.layers[:n])

    def _drop_keys_after(self, n: int) -> None:
        """Cut every layer's keys/values to the first ``n`` positions (states a forward ran but must not keep). A
        dynamic cache keeps detached views: no view of a graph stays in it (a checkpoint's recompute would reach
        back into the forward's graph through one)."""
        if isinstance(self.cache, PreallocatedCache):
            self.cache.drop_after(n)
            return
        for lc in self.cache.layers:
            if lc.keys is not None and lc.keys.shape[-2] > n:
                lc.keys, lc.values = lc.keys[..., :n, :].detach(), lc.values[..., :n, :].detach()

    def _inner(self):
        inner = getattr(self.model, "model", None)
        if inner is None or not hasattr(inner, "layers") or not hasattr(self.model, "lm_head"):
            raise TypeError(f"{self.name}: run_upper/hidden_layer need a decoder-only model with "
                            f"model.model.layers and lm_head (Llama-style); got {type(self.model).__name__}")
        return inner

    def _layer(self, layer: int) -> torch.nn.Module:
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"hidden_layer={layer} is out of range: the model has layers 0..{self.num_layers - 1}")
        return self._inner().layers[layer]

    def _positions(self, positions, bsz: int, t: int, past: int) -> torch.Tensor:
        if positions is None:
            positions = torch.arange(past, past + t, device=self.device)
        positions = to_device(torch.as_tensor(positions, dtype=torch.long), self.device)
        if positions.dim() == 1:
            positions = positions[None].expand(bsz, t)
        return positions

    def _padded(self, ids, positions, attend, key_valid, pad: int, past: int):
        """``pad`` padding rows after the ``t`` new ones (copies of the last token, positions after the last): no
        new row sees them (causal order already ensures it; a custom ``attend`` gets False columns) and they see
        only themselves under a custom mask. The caller cuts them from the cache and the logits."""
        bsz, t = ids.shape
        dev = ids.device
        ids = torch.cat([ids, ids[:, -1:].expand(bsz, pad)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=dev)], dim=1)
        if attend is not None:
            attend = to_device(attend, dev).to(torch.bool)
            lead = attend.shape[:-2]
            width = attend.shape[-1]  # t (new only) or past + t
            grown = torch.zeros(*lead, t + pad, width + pad, dtype=torch.bool, device=dev)
            grown[..., :t, :width] = attend
            grown[..., t:, width:] = torch.eye(pad, dtype=torch.bool, device=dev)  # (no host value: no sync)
            attend = grown
        if key_valid is not None:
            key_valid = torch.cat([key_valid.to(dev, torch.bool),
                                   torch.ones(key_valid.shape[0], pad, dtype=torch.bool, device=dev)], dim=1)
        return ids, positions, attend, key_valid

    def _check_finite(self, logits: torch.Tensor, past: int, t: int, last_only: bool, kept) -> None:
        """NaN/inf in ``logits`` [B, T', V] raise: at once on the CPU; on an accelerator when the model is next used
        (a flag copied to the host without a sync; module docstring)."""
        finite = torch.isfinite(logits).all(-1)  # [B, T']
        if logits.device.type == "cpu":
            if not bool(finite.all()):
                self._raise_non_finite(finite, past, t, last_only, kept)
            return
        ok, done = finite.all(), None
        if ok.device.type == "cuda":
            ok = ok.to("cpu", non_blocking=True)  # into pinned memory; ``done`` says when it has arrived
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(finite.device))
        self._unchecked.append((finite, ok, done, (past, t, last_only, kept)))

    def _raise_non_finite(self, finite: torch.Tensor, past: int, t: int, last_only: bool, kept,
                          late: bool = False) -> None:
        b, j = (int(x) for x in (~finite).nonzero()[0])
        new = t - 1 if last_only else int(kept[j]) if isinstance(kept, torch.Tensor) else j
        raise NonFiniteLogitsError(
            f"model {self.name!r} produced non-finite logits (NaN/inf) at position {past + new} "
            f"(row {b}, new token {new} of {t}, cache length {past})"
            + (" in an earlier forward (found when the model was next used)" if late else ""))

    def _allowed(
        self,
        bsz: int,
        t: int,
        past: int,
        attend: torch.Tensor | None,
        key_valid: torch.Tensor | None,
    ) -> torch.Tensor:
        """[B, T, past+T] bool visibility of the new tokens over cached + new positions."""
        dev = self.device
        if attend is None:
            attend = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
        attend = to_device(attend, dev).to(torch.bool)
        if attend.dim() == 2:
            attend = attend[None].expand(bsz, *attend.shape)
        if attend.shape[-2:] == (t, t):
            allowed = torch.cat([torch.ones(bsz, t, past, dtype=torch.bool, device=dev), attend], dim=-1)
        elif attend.shape[-2:] == (t, past + t):
            allowed = attend.clone()
        else:
            raise ValueError(f"attend has shape {tuple(attend.shape)}; expected [.., {t}, {t}] (new tokens) or "
                             f"[.., {t}, {past + t}] (cached + new positions)")
        if key_valid is not None:
            allowed = allowed & key_valid.to(dev, torch.bool)[:, None, :]
        # a fully masked row (a padding query) would give NaNs; let it see itself
        diag = torch.arange(t, device=dev)
        allowed[:, diag, past + diag] |= ~allowed.any(-1)
        return allowed

    def _to_additive(self, allowed: torch.Tensor) -> torch.Tensor:
        if self.flash:
            raise FlashAttentionMaskError(
                f"model {self.name!r} runs attn_implementation=flash_attention_2, which takes no custom attention "
                f"mask, and this forward needs one (a token tree, a Jacobi/lookahead window, injected or pseudo "
                f"states, or padded batch rows); use model.attn_implementation=sdpa (or eager) for this method")
        return additive_mask(allowed, self.dtype)

    def _additive_mask(self, bsz: int, t: int, past: int, attend: torch.Tensor | None,
                       key_valid: torch.Tensor | None) -> torch.Tensor:
        """[B, 1, T, past+T] additive float mask: 0 = attend, finfo.min = masked."""
        return self._to_additive(self._allowed(bsz, t, past, attend, key_valid))
