"""FIRP's pseudo states (§3.3) and injected hidden states, over a :class:`~pardec.models.cached.CachedModel`'s cache:

* :func:`forward_pseudo` -> ``CachedModel.forward`` plus K pseudo hidden states per anchor, born at intermediate
  layers by ``project`` and run through the rest of the model, seeing real states only (FIRP §3.3, the "Masked"
  ablation of §4.3) or also each other (the paper's inference, "No masked"); they are not kept;
* :func:`run_upper` -> logits of hidden states injected entering a layer and run through the layers above it, the
  final norm and the LM head, seeing the cache; nothing is appended.

Both run transformers' decoder layers (the forward implementations of :mod:`pardec.models.forward` do not take
injected states) and leave the cache as :meth:`CachedModel.forward` would: the pseudo / injected states' keys are
dropped right after the call (``cache.transient_from``, ``cache.drop_after``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.checkpoint

from pardec.models.cache import to_device
from pardec.models.cached import CachedModel
from pardec.models.compat import cache_kw
from pardec.models.masks import allowed

#: what a FIRP pseudo state attends to (:func:`forward_pseudo`): real states only (FIRP §3.3) or also the anchor's
#: earlier pseudo states
PSEUDO_ATTENTION = ("real", "pseudo")
#: what a pseudo state sees when FIRP decodes, by default: the anchor's earlier pseudo states too (FIRP §4.3 / Fig. 7,
#: "No masked", the paper's inference); ``real`` is its "Masked" ablation
DECODING_ATTENTION = "pseudo"


@dataclass
class PseudoOut:
    logits: torch.Tensor  # [B, T', V] of the new tokens (all, or the ``logits_at`` ones)
    pseudo: torch.Tensor  # [B, A, K, H] pseudo states after the final norm (LM head input): anchor a, step i
    layers: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer input (+ the last output): new
    #: tokens [B, T, H] and pseudo states born so far [B, A, i, H]; ``capture=True`` only


def _transient(cm: CachedModel, start: int | None) -> None:
    """Positions from ``start`` on are dropped when the current call ends (None: that call ended)."""
    cm.cache.transient_from = start


@torch.inference_mode()
def run_upper(
    cm: CachedModel,
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
    if not 0 <= layer < cm.num_layers:
        raise ValueError(f"layer={layer} is out of range: the model has layers 0..{cm.num_layers - 1}")
    cm.check_finite()
    inner = cm.inner()
    hidden = hidden.to(cm.device, cm.dtype)
    if hidden.dim() == 2:
        hidden = hidden[None]
    bsz, t, _ = hidden.shape
    past = cm.length
    positions = cm.positions_for(positions, bsz, t, past)
    mask = cm.additive(allowed(bsz, t, past, attend, None, cm.device))
    rope = inner.rotary_emb(hidden, position_ids=positions)
    _transient(cm, past)
    try:
        for block in inner.layers[layer : cm.num_layers]:
            hidden = block(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions,
                           **cache_kw(block, cm.cache), use_cache=True)
    finally:  # the layers appended the injected states' keys/values to their caches: drop them
        _transient(cm, None)
        cm.cache.drop_after(past)
    logits = cm.model.lm_head(inner.norm(hidden))
    cm.check_logits(logits, past, t, False, None)
    return logits


def forward_pseudo(
    cm: CachedModel,
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

    * ``"real"`` (FIRP §3.3, the default): real states only, and itcm. The pseudo state of position j + i
      sees the real states of positions up to j + i - 1 that exist: what its anchor sees (cached and new
      tokens, as ``attend`` says) and, with ``teacher_forced`` (training on a known sequence: ``attend`` None,
      the new tokens after an anchor are its true continuation), the new tokens ``a + 1 .. a + i`` too.
      Decoding has no real state after the anchor, so there it sees the anchor's view and itcm. No pseudo
      state sees another, so step i depends on projection i alone (each projection trains on its own);
    * ``"pseudo"`` (pardec's earlier pattern): what its anchor sees, the anchor's earlier pseudo states (stand-ins
      for the real states in between) and itcm.

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
    inner = cm.inner()
    cm.check_finite()
    if ids.dim() == 1:
        ids = ids[None]
    given = ids
    ids = to_device(ids, cm.device)
    bsz, t = ids.shape
    past = cm.length
    k = len(layers)
    if k < 1 or any(not 0 <= x < cm.num_layers for x in layers):
        raise ValueError(f"pseudo layers={list(layers)} are out of range: give 1+ indices in "
                         f"0..{cm.num_layers - 1}")
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
    positions = cm.positions_for(positions, bsz, t, past)
    anc_dev = to_device(anchors, cm.device)
    pseudo_pos = (positions[:, anc_dev, None] + torch.arange(1, k + 1, device=cm.device)).transpose(1, 2)
    all_pos = torch.cat([positions, pseudo_pos.reshape(bsz, k * n_a)], dim=1)  # rows: new, then (i, a)
    # visibility over [cached, new, pseudo (i, a) in row order]
    real = allowed(bsz, t, past, attend, None, cm.device)  # [B, T, past+T]
    n = t + k * n_a
    visible = torch.zeros(bsz, n, past + n, dtype=torch.bool, device=cm.device)
    visible[:, :t, : past + t] = real
    own = torch.arange(k, device=cm.device)
    # [K, K]: step i sees step i' (of the same anchor): itself only ("real"), or i' <= i ("pseudo")
    sees_pseudo = own[None, :] == own[:, None] if attention == "real" else own[None, :] <= own[:, None]
    same = torch.eye(n_a, dtype=torch.bool, device=cm.device)
    block = (sees_pseudo[:, None, :, None] & same[None, :, None, :]).reshape(k * n_a, k * n_a)
    visible[:, t:, : past + t] = real[:, anc_dev].repeat(1, k, 1)
    if teacher_forced:  # step i of anchor a also sees the true tokens a + 1 .. a + i (positions < its own)
        new_idx = torch.arange(t, device=cm.device)
        ahead = (new_idx[None, None, :] > anc_dev[None, :, None]) & \
            (new_idx[None, None, :] <= anc_dev[None, :, None] + own[:, None, None])  # [K, A, T]
        visible[:, t:, past : past + t] |= ahead.reshape(k * n_a, t)[None]
    visible[:, t:, past + t :] = block
    mask = cm.additive(visible)
    hidden = inner.embed_tokens(ids)
    rope = inner.rotary_emb(hidden, position_ids=all_pos)
    if split and capture:
        raise ValueError("forward_pseudo: capture needs split=False")
    if checkpoint and not split:
        raise ValueError("forward_pseudo: checkpoint needs split=True (training)")
    if split:
        return _pseudo_split(cm, given, ids, hidden, project, layers, anc_dev, all_pos, rope, mask, logits_at,
                                  checkpoint)
    born = 0
    caught: list[tuple[torch.Tensor, torch.Tensor]] = []
    _transient(cm, past + t)
    try:
        for layer in range(cm.num_layers):
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
                **cache_kw(inner.layers[layer], cm.cache), use_cache=True)
    finally:  # drop the pseudo states' keys/values (and everything on an error part-way)
        _transient(cm, None)
        cm.cache.drop_after(past + t if born == k else past)
    normed = inner.norm(hidden)
    real_h = normed[:, :t]
    if logits_at is not None:
        real_h = real_h[:, to_device(torch.as_tensor(logits_at, dtype=torch.long), real_h.device)]
    logits = cm.model.lm_head(real_h)
    cm.appended(given, t)
    cm.check_logits(logits, past, t, False, None if logits_at is None else torch.as_tensor(logits_at))
    pseudo = normed[:, t:].reshape(bsz, k, n_a, -1).transpose(1, 2)  # [B, A, K, H]
    if capture:
        caught.append((hidden[:, :t], hidden[:, t:]))
    return PseudoOut(logits, pseudo, [(r, p.reshape(bsz, -1, n_a, p.shape[-1]).transpose(1, 2)) for r, p in caught]
                     if capture else None)


def _pseudo_split(cm: CachedModel, given, ids, hidden, project, layers, anc, all_pos, rope, mask, logits_at,
                  checkpoint: bool = False) -> PseudoOut:
    """:meth:`forward_pseudo` in two passes: the new tokens (no gradients), then the pseudo states alone."""
    inner = cm.inner()
    bsz, t = ids.shape
    past, k, n_a = cm.length, len(layers), anc.numel()
    births: dict[int, torch.Tensor] = {}
    pseudo = None
    born = 0
    _transient(cm, past + t)
    try:
        with torch.no_grad():
            for layer in range(cm.num_layers):
                if layer in layers:
                    births[layer] = hidden[:, anc.to(hidden.device)]
                hidden = inner.layers[layer](
                    hidden, attention_mask=mask[:, :, :t, : past + t],
                    position_embeddings=tuple(x[:, :t] for x in rope), position_ids=all_pos[:, :t],
                    **cache_kw(inner.layers[layer], cm.cache), use_cache=True)
            real = inner.norm(hidden)
        for layer in range(layers[0], cm.num_layers):
            while born < k and layers[born] == layer:
                into = births[layer] if pseudo is None else pseudo  # split models: layers on several devices
                new = project(born, births[layer]).to(into.device, hidden.dtype)
                pseudo = new if pseudo is None else torch.cat([pseudo, new], dim=1)
                born += 1
            m = born * n_a
            args = (layer, pseudo, mask[:, :, t : t + m, : past + t + m],
                    tuple(x[:, t : t + m] for x in rope), all_pos[:, t : t + m], past + t)
            if checkpoint and torch.is_grad_enabled():
                pseudo = torch.utils.checkpoint.checkpoint(_pseudo_layer, cm, *args, use_reentrant=False)
            else:
                pseudo = _pseudo_layer(cm, *args)
    finally:
        _transient(cm, None)
        cm.cache.drop_after(past + t if born == k else past)
    if logits_at is not None:
        real = real[:, torch.as_tensor(logits_at, dtype=torch.long, device=real.device)]
    with torch.no_grad():
        logits = cm.model.lm_head(real)
    cm.appended(given, t)
    cm.check_logits(logits, past, t, False, None if logits_at is None else torch.as_tensor(logits_at))
    out = inner.norm(pseudo).reshape(bsz, k, n_a, -1).transpose(1, 2)  # [B, A, K, H]
    return PseudoOut(logits, out)


def _pseudo_layer(cm: CachedModel, layer: int, pseudo: torch.Tensor, mask: torch.Tensor, rope: tuple, positions,
                  keep: int) -> torch.Tensor:
    """Decoder layer ``layer`` over pseudo states that see the cache's first ``keep`` positions and each other
    as ``mask`` says; their keys/values are not kept. Safe to run again in backward (gradient checkpointing)."""
    block = cm.inner().layers[layer]
    before = cm.cache.transient_from
    _transient(cm, keep)  # the preallocated cache stores nothing past ``keep``
    try:
        return block(pseudo, attention_mask=mask, position_embeddings=rope, position_ids=positions,
                     **cache_kw(block, cm.cache), use_cache=True)
    finally:
        _transient(cm, before)
        cm.cache.drop_after(keep)  # (a dynamic cache appended them)
