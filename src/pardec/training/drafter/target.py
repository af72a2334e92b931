"""The frozen target's pass that hidden-state drafters (EAGLE-3, DFlash) train on: one forward over a batch giving
the states entering the draft's target layers, the logits and the embeddings."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pardec.models.forward.lean import captured, capturing

log = logging.getLogger(__name__)


@dataclass
class TargetPass:
    """One frozen target forward over ``ids`` [B, T]: ``features`` [B, T, n * H] (the states entering the draft's
    layers), ``logits`` [B, T, V] (None when not asked for), ``emb`` [B, T, H] (the target's embeddings of ``ids``)."""

    features: torch.Tensor
    logits: torch.Tensor | None
    emb: torch.Tensor


class _Enough(Exception):
    """Raised by a hook once the last state a truncated pass needs is captured."""


@torch.no_grad()
def target_pass(base, ids: torch.Tensor, layer_ids, logits: bool = True) -> TargetPass:
    """``base``: the target (a causal LM with ``.model.embed_tokens``); right-padded ids need no mask (causal). The
    features: the states entering each layer of ``layer_ids`` (``L``: after the final norm), concatenated in that
    order, captured by hooks (:func:`pardec.models.forward.lean.capturing`): only those layers' states are kept, not
    all ``L + 1`` as ``output_hidden_states`` would (33 of [B, T, 4096] for Llama-3.1-8B). Without ``logits`` the
    forward stops where the last state it needs enters its layer (a DFlash draft reading the target's first 5 of 30
    layers costs 4 of them): the states are the same, the layers after them never run."""
    layers, n_layers = tuple(int(i) for i in layer_ids), len(base.model.layers)
    stop = None if logits or n_layers in layers else max(layers)
    out = None
    with capturing(base.model, layers) as seen:
        if stop is None:
            out = base(input_ids=ids)
        else:
            def enough(_module, _args, _kwargs):
                raise _Enough

            hook = base.model.layers[stop].register_forward_pre_hook(enough, with_kwargs=True)  # after capture's
            try:
                base(input_ids=ids)
            except _Enough:
                pass
            finally:
                hook.remove()
    features = captured(seen, seen.get(n_layers), layers, n_layers)
    return TargetPass(features, None if out is None else out.logits, base.model.embed_tokens(ids))


class FeatureCache:
    """The frozen target's pass per training sequence, kept on disk (``drafter.feature_cache``; the paper trains offline
    on regenerated data too): the states entering the draft's target layers and, where the loss needs the target's
    distribution (EAGLE-3's soft labels, DFlash's ``loss: kl``), its final-normed state, from which the logits are
    recomputed by its LM head, in ``dtype`` (bf16 by default: half of fp32's bytes, the named difference from a live
    pass). Filled as training first meets each sequence, one file per sequence written whole (a temporary file
    renamed), so a killed run loses at most the sequence in flight and a resumed one, every rank and every later run
    of the same target, layers and dtype read what is there. ``<root>/<key>/``: ``meta.json`` (the target's identity,
    the layers, the dtype) and ``<sha1 of the token ids>.safetensors``."""

    def __init__(self, root, identity: dict, layer_ids, final: bool, dtype: torch.dtype = torch.bfloat16):
        self.layers, self.final, self.dtype = tuple(int(i) for i in layer_ids), bool(final), dtype
        meta = {"format": "pardec-feature-cache", "version": 1, "target": identity, "layers": list(self.layers),
                "final_state": self.final, "dtype": str(dtype).removeprefix("torch.")}
        key = hashlib.sha1(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.dir = Path(root) / key
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "meta.json"
        if not path.is_file():
            tmp = path.with_name(f".meta.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(meta, indent=2, default=str) + "\n")
            tmp.replace(path)
        self.hits = self.misses = 0
        log.info("feature cache: %s", self.dir)

    def _file(self, ids: torch.Tensor) -> Path:
        return self.dir / f"{hashlib.sha1(ids.to('cpu', torch.int64).numpy().tobytes()).hexdigest()}.safetensors"

    def get(self, ids: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The kept tensors of one sequence ``ids`` [T] (``features`` [T, n * H], ``final`` [T, H] where kept), or
        None."""
        f = self._file(ids)
        return load_file(f) if f.is_file() else None

    def put(self, ids: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
        f = self._file(ids)
        tmp = f.with_name(f".{f.stem}.{os.getpid()}.tmp")
        save_file({k: v.detach().to("cpu", self.dtype).contiguous() for k, v in tensors.items()}, str(tmp))
        tmp.replace(f)

    def target_pass(self, base, ids: torch.Tensor, valid: torch.Tensor, logits: bool = True) -> TargetPass:
        """:func:`target_pass` of right-padded ``ids`` [B, T] (``valid`` [B, T]: the real tokens) from the kept
        states: each row's sequence read from disk, or computed alone (the states of a causal forward do not depend
        on padding) and kept. Padding positions get zeros; the logits, where asked for, are the LM head's of the
        kept final state (the pass must keep it: ``final``)."""
        if logits and not self.final:
            raise ValueError("this feature cache keeps no final state: the logits cannot be recomputed")
        n_layers = len(base.model.layers)
        want = self.layers + ((n_layers,) if self.final and n_layers not in self.layers else ())
        dev, width = ids.device, ids.shape[1]
        feats, finals = [], []
        for row, ok in zip(ids.cpu(), valid.to(torch.bool).cpu()):  # the keys: one host read for the batch
            seq = row[ok]
            kept = self.get(seq)
            if kept is None:
                self.misses += 1
                parts = target_pass(base, seq[None].to(dev), want, logits=False).features[0].split(
                    base.config.hidden_size, -1)
                kept = {"features": torch.cat(parts[: len(self.layers)], -1)}
                if self.final:  # the final-normed state (layer index n_layers), wherever it is in ``want``
                    kept["final"] = parts[want.index(n_layers)]
                self.put(seq, kept)
                kept = {k: v.to(self.dtype) for k, v in kept.items()}  # what a later run reads
            else:
                self.hits += 1
            pad = width - seq.numel()
            feats.append(torch.nn.functional.pad(kept["features"].to(dev), (0, 0, 0, pad)))
            if self.final:
                finals.append(torch.nn.functional.pad(kept["final"].to(dev), (0, 0, 0, pad)))
        dtype = base.lm_head.weight.dtype
        features = torch.stack(feats).to(dtype)
        with torch.no_grad():
            out = base.lm_head(torch.stack(finals).to(dtype)) if logits else None
            return TargetPass(features, out, base.model.embed_tokens(ids))
