"""``model.attn_implementation=invariant``: batch-invariant attention for transformers' forward.

A forward of T new rows (a verification, a Jacobi block, a tree) and T one-row steps compute the same rows, but
not with the same kernels: attention's scores and weighted sums are small-M GEMMs over the keys whose summation
order depends on how many query rows share the call, so a row's result differs in its last bits from the step's.
In fp32 that stays below the argmax almost always; with int8 activations (``dtype=int8``) a last-bit difference
moves a value across a quantization step, and a few layers later the rows differ by whole steps: int8 ``tokens``
methods left int8 ``ar`` within 8-52 tokens on every GSM8K prompt (docs/cpu_speed.md "Per-token int8"), although the per-token
int8 linears themselves are batch-invariant.

This attention runs **one query row at a time over exactly the keys that row may see**, in their cache order (a
prefix of the cache is sliced, any other set, e.g. a tree node's ancestors, gathered), through the same
``scaled_dot_product_attention`` call with no mask, which is the call a one-row step at that position makes. The
other ops of a Llama-style layer work row by row (norms, RoPE, activations), and so do per-token int8 linears
(``model.int8_weights=per_token``, the int8 default), so with them a row's logits are bitwise the ones the one-row
step computes and ``tokens`` methods equal ``ar`` by construction rather than up to near-ties (tested bitwise on the
tiny model, measured on SmolLM2 in docs/cpu_speed.md). fp32 and bf16 linears are small-M GEMMs, not batch-invariant: there
this attention removes one source of last-bit differences, not all.

The cost: T calls per layer instead of one, and one host read of the mask per forward (each row's allowed keys,
kept for the forward's other layers, :func:`_plan`): a CPU exactness mode. Tree rows share one scratch buffer per
layer: it keeps the cache's leading keys, so each row copies only its few ancestors after them (before, every row
gathered its whole prefix anew: a copy of the cache per row and layer). On a GPU it works but every layer syncs; use ``sdpa`` there. The lean and
compiled forwards run their own attention and refuse it. Registered with transformers' attention and mask
interfaces on import (:func:`register`).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "invariant"


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


#: the last forward's plan: every layer of a forward gets the same mask, so it is read once per forward, not per layer
_LAST: dict = {"mask": None, "key": None, "plan": None}


def _plan(mask: torch.Tensor | None, batch: int, rows: int, keys: int, device, first: bool) -> list[list[tuple]]:
    """Per batch row, per query row: ``(n, None)``: attend over the first ``n`` keys (a slice); ``(n, (p, tail))``:
    over the first ``p`` keys and then the keys at ``tail`` (on ``device``, in cache order; ``n`` = p + len(tail):
    a tree node's prefix and its ancestors); ``(0, None)``: none. Read from the mask at
    a forward's ``first`` layer, and by any layer given another mask object (a weak reference: a freed mask is
    never mistaken for a new one) or other shapes; the forward's other layers reuse it. (Masks are made anew for
    every forward and are inference tensors, which have no version counter to check.)"""
    key = (batch, rows, keys, str(device), None if mask is None else tuple(mask.shape))
    held = _LAST["mask"]
    same = (held is None) if mask is None else (held is not None and held() is mask)
    if not first and same and _LAST["key"] == key:
        return _LAST["plan"]
    allowed = _allowed(mask, batch, rows, keys, device).cpu()  # the one host read
    plan = []
    for b in range(batch):
        row_plans = []
        for i in range(rows):
            idx = allowed[b, i].nonzero().squeeze(1)
            n = idx.numel()
            if n == 0 or int(idx[-1]) == n - 1:
                row_plans.append((n, None))
                continue
            run = int((idx == torch.arange(n)).cumprod(0).sum())  # the leading keys 0, 1, ..., p - 1
            row_plans.append((n, (run, idx[run:].to(device))))
        plan.append(row_plans)
    _LAST.update(mask=None if mask is None else weakref.ref(mask), key=key, plan=plan)
    return plan


def attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
              **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (query [B, H, T, D], key/value [B, H_kv, S, D]) -> ([B, T, H, D],
    None), one query row per ``scaled_dot_product_attention`` call over the keys it may see."""
    if dropout:
        raise ValueError(f"attn_implementation={NAME!r} is for inference: dropout {dropout} given")
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None or kwargs.get("sinks") is not None:
        raise ValueError(f"attn_implementation={NAME!r} supports plain masked attention only (no softcap, bias, sinks)")
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    batch, heads, rows, _ = query.shape
    out = query.new_empty(batch, rows, heads, value.shape[-1])
    first = getattr(module, "layer_idx", 0) == 0
    for b, plan in enumerate(_plan(attention_mask, batch, rows, key.shape[2], key.device, first)):
        # gathered rows (tree nodes) share one scratch buffer: its first ``valid`` slots hold the cache's first keys,
        # so each row copies only what it lacks of its leading run and then its few tail keys, not its whole prefix
        width = max((n for n, at in plan if at is not None), default=0)
        if width:
            sk, sv = key.new_empty(1, heads, width, key.shape[-1]), value.new_empty(1, heads, width, value.shape[-1])
        valid = 0
        for i, (n, at) in enumerate(plan):
            if n == 0:
                out[b, i] = 0  # a padding row that sees nothing (never read)
                continue
            if at is None:  # a prefix of the cache: the slice a one-row step attends over
                k, v = key[b : b + 1, :, :n], value[b : b + 1, :, :n]
            else:  # e.g. a tree node: its leading run of the cache, then its ancestors, in cache order
                run, tail = at
                if valid < run:
                    sk[:, :, valid:run] = key[b : b + 1, :, valid:run]
                    sv[:, :, valid:run] = value[b : b + 1, :, valid:run]
                sk[:, :, run:n] = key[b : b + 1].index_select(2, tail)
                sv[:, :, run:n] = value[b : b + 1].index_select(2, tail)
                valid = run  # the slots from ``run`` on now hold this row's tail
                k, v = sk[:, :, :n], sv[:, :, :n]
            o = F.scaled_dot_product_attention(query[b : b + 1, :, i : i + 1], k, v, scale=scaling)
            out[b, i] = o[0, :, 0]
    return out, None


def register() -> None:
    """Make ``attn_implementation="invariant"`` known to transformers (attention and mask interfaces; the masks are
    SDPA's: None when causal, else a 4D bool mask)."""
    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
