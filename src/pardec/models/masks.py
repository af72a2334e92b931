"""Visibility of new tokens over a KV cache, as transformers takes it: a bool ``[B, T, past+T]`` (True = may attend)
turned into an additive float mask (0 where attended, ``finfo.min`` elsewhere; a 4D bool mask is silently wrong under
eager attention, transformers 5.2x)."""

from __future__ import annotations

import torch

from pardec.models.cache import to_device


class FlashAttentionMaskError(ValueError):
    """A forward needs a custom attention mask and the model runs flash_attention_2, which cannot take one."""


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype, flash_model: str | None = None) -> torch.Tensor:
    """[B, Q, K] bool (True = may attend) -> [B, 1, Q, K] additive float mask: 0 = attend, finfo.min = masked (the
    form transformers needs for a 4D mask, with explicit position ids). ``flash_model``: the name of a model that runs
    flash-attention, which takes no such mask (refused in one line)."""
    if flash_model is not None:
        raise FlashAttentionMaskError(
            f"model {flash_model!r} runs attn_implementation=flash_attention_2, which takes no custom attention "
            f"mask, and this forward needs one (a token tree, a Jacobi/lookahead window, injected or pseudo "
            f"states, or padded batch rows); use model.attn_implementation=sdpa (or eager) for this method")
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


def allowed(bsz: int, t: int, past: int, attend: torch.Tensor | None, key_valid: torch.Tensor | None,
            device: torch.device) -> torch.Tensor:
    """[B, T, past+T] bool visibility of ``t`` new tokens over ``past`` cached + the new positions: ``attend`` None
    (causal), [.., T, T] (among the new tokens; every cached position visible) or [.., T, past+T]; ``key_valid``
    [B, past+T] False for padding positions nobody may attend to. A row that would see nothing sees itself."""
    if attend is None:
        attend = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    attend = to_device(attend, device).to(torch.bool)
    if attend.dim() == 2:
        attend = attend[None].expand(bsz, *attend.shape)
    if attend.shape[-2:] == (t, t):
        out = torch.cat([torch.ones(bsz, t, past, dtype=torch.bool, device=device), attend], dim=-1)
    elif attend.shape[-2:] == (t, past + t):
        out = attend.clone()
    else:
        raise ValueError(f"attend has shape {tuple(attend.shape)}; expected [.., {t}, {t}] (new tokens) or "
                         f"[.., {t}, {past + t}] (cached + new positions)")
    if key_valid is not None:
        out = out & key_valid.to(device, torch.bool)[:, None, :]
    # a fully masked row (a padding query) would give NaNs; let it see itself
    diag = torch.arange(t, device=device)
    out[:, diag, past + diag] |= ~out.any(-1)
    return out


def padded(ids, positions, attend, key_valid, pad: int):
    """``pad`` padding rows after the ``t`` new ones (copies of the last token, positions after the last): no new row
    sees them (causal order already ensures it; a custom ``attend`` gets False columns) and they see only themselves
    under a custom mask. The caller cuts them from the cache and the logits."""
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
