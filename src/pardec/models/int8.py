"""The ``dtype=int8`` CPU mode: every ``nn.Linear`` of a loaded model (attention, MLP, LM head) holds int8
weights (per-output-channel scales: ``quantize_dynamic``'s default qconfig is per *tensor*, one scale for a whole
matrix, which costs a 4-layer draft and the 49k-row LM head much accuracy; measured in the README) and runs fbgemm's dynamic-quantized GEMM; embeddings, norms and activations
stay fp32. On the CPUs pardec is developed on this is ~2.5x faster than fp32 for one new token, and nearly flat
from 1 to 5 rows (``scripts/forward_cost.py --dtype int8``): the memory-bound regime in which drafting pays.

Library: ``torch.ao.quantization.quantize_dynamic``. It is deprecated (torch says "will be removed"; still present
in torch 2.13) in favour of torchao, whose int8 configs in eager mode measured slower than fp32 here (118 ms dynamic
activation + weight, 29 ms weight-only, against 47 ms fp32 for SmolLM2's linears at one row); torchao needs
``torch.compile`` to be fast, which pardec's dynamic shapes (cache lengths, tree sizes) would recompile constantly.
When ``quantize_dynamic`` goes, this module is the one place to change.

Exactness: fbgemm quantizes the *whole input* of a linear with one dynamic scale (per tensor, not per token), so
a row's result depends on the other rows of the same forward: a multi-token verification forward is not bitwise
equal to single-token steps (nor, in general, to fp32). ``tokens`` methods therefore match int8 ``ar`` only up to
near-ties; runs report the exact-match rate beside speed. (Per-token scales would make the integer GEMM
batch-invariant, but ``torch._int_mm`` on CPU is a reference kernel, ~5x slower than fp32 here: measured.)

The quantized weights are cached (``data/models/int8/<key>.pt``, keyed by the model's identity and its weight
files' size and mtime), since quantizing a model costs seconds (SmolLM2-135M: 3-6 s) and loading the cache well
under one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import warnings
from pathlib import Path

import torch

from pardec import DATA_DIR

log = logging.getLogger(__name__)

#: the warnings torch raises for the deprecated eager-mode quantization API (one per call and per quantized tensor)
_DEPRECATION = ("ignore", ".*(deprecated|will be removed).*")


def _quantized_linear_type() -> type:
    from torch.ao.nn.quantized.dynamic import Linear

    return Linear


def is_int8(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs int8 linears (it was loaded with ``dtype=int8``)."""
    qlin = _quantized_linear_type()
    return any(isinstance(m, qlin) for m in model.modules())


#: how the weights are scaled: ``per_channel`` (one scale per output row; the default) or ``per_tensor`` (one scale
#: per matrix: what ``quantize_dynamic(model, {nn.Linear})`` gives when no qconfig is named, kept for comparisons)
SCHEMES = ("per_channel", "per_tensor")


def quantize(model: torch.nn.Module, scheme: str = "per_channel") -> torch.nn.Module:
    """Every ``nn.Linear`` of ``model`` -> int8 weights (``scheme``: :data:`SCHEMES`) + fbgemm dynamic GEMM, in
    place. CPU only."""
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    if scheme not in SCHEMES:
        raise ValueError(f"int8 weight scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    qconfig = per_channel_dynamic_qconfig if scheme == "per_channel" else default_dynamic_qconfig
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        return torch.ao.quantization.quantize_dynamic(model, {torch.nn.Linear: qconfig}, dtype=torch.qint8,
                                                      inplace=True)


def weight_scheme(model: torch.nn.Module) -> str | None:
    """``per_channel`` or ``per_tensor``: how the int8 linears of ``model`` scale their weights (None: no int8)."""
    qlin = _quantized_linear_type()
    for m in model.modules():
        if isinstance(m, qlin):
            return "per_channel" if m.weight().qscheme() == torch.per_channel_affine else "per_tensor"
    return None


def _skeleton(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each ``nn.Linear`` replaced by an empty int8 linear of the same shape, ready for a cached
    state dict (no weight is quantized: building it costs milliseconds)."""
    qlin = _quantized_linear_type()
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        for mod in list(model.modules()):
            for child_name, child in list(mod.named_children()):
                if type(child) is torch.nn.Linear:
                    new = qlin(child.in_features, child.out_features, bias_=child.bias is not None, dtype=torch.qint8)
                    setattr(mod, child_name, new)
    return model


def cache_key(identity: dict, weight_files: list[Path], scheme: str = "per_channel") -> str:
    """A key that changes when the model's identity, any of its weight files (size, mtime) or the weight
    ``scheme`` changes."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(weight_files) if f.is_file()]
    blob = json.dumps({"identity": identity, "files": stats, "torch": torch.__version__, "scheme": scheme},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def quantize_cached(model: torch.nn.Module, key: str | None, cache_dir: Path | None = None,
                    scheme: str = "per_channel") -> torch.nn.Module:
    """``quantize(model, scheme)``, reading the int8 weights from ``<cache_dir>/<key>.pt`` when written before and writing
    them there otherwise (``key=None``: no cache, e.g. an in-memory tiny model). A cache file that does not read
    (a truncated copy, another torch) is rebuilt, not trusted."""
    if key is None:
        return quantize(model, scheme)
    cache_dir = cache_dir or DATA_DIR / "models" / "int8"
    f = cache_dir / f"{key}.pt"
    state = None
    if f.is_file():
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(*_DEPRECATION)
                state = torch.load(f, weights_only=False)
        except Exception as e:  # noqa: BLE001 - rebuilt below
            log.warning("int8 cache %s unreadable (%s); quantizing again", f, e)
    if state is not None:
        skel = _skeleton(model)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(*_DEPRECATION)
                skel.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise RuntimeError(f"the int8 cache {f} does not fit this model ({str(e)[:200]}); delete it") from e
        return skel
    model = quantize(model, scheme)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        torch.save(model.state_dict(), tmp)
    tmp.replace(f)  # atomic: a killed write leaves no half file under the final name
    log.info("int8 weights cached in %s", f)
    return model
