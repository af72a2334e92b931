"""The ``dtype=int8`` CPU mode: the ``nn.Linear`` layers of a loaded model (attention, MLP, LM head) hold int8
weights with one scale per output row; embeddings, norms, attention and the residual stream stay fp32. Four schemes
(``model.int8_weights``):

* ``weight_only`` (:class:`WeightOnlyLinear`; the drafts' default, ``conf/draft/*.yaml``): the activations are
  *not* quantized. A linear rounds
  its input to bf16 and runs ``torch.ops.aten._weight_int8pack_mm`` (int8 weights widened in registers, fp32
  accumulation, bf16 output). Against fp32 on the fp32 target's own greedy text (``scripts/int8_quality.py``, 40
  GSM8K / 24 HumanEval records): top-1 agreement 0.974 / 0.983, perplexity 1.492 / 1.357 against fp32's 1.484 /
  1.352 (+0.5%), the distilled draft's agreement unchanged. SmolLM2's linears at one row (``scripts/linear_cost.py``): 9.2 ms against
  40 ms fp32 and 9.2 ms for fbgemm's dynamic int8, rising to 12.6 ms at 4 rows (AMD EPYC Zen 4 with avx512_bf16; a CPU
  without native bf16 instructions was not measured and may be slower: loading warns there). Its linears are
  **batch-invariant**: each row's result is
  bitwise the same alone or among other rows (tested), but attention's small-M GEMMs are not (in fp32 either), and the
  bf16 rounding of the linears' inputs magnifies their last-bit differences, so on SmolLM2 ``tokens`` methods left
  int8 ``ar`` at near-ties in 3-4 of 5 prompts. The cost: the kernel works in blocks of 4 rows, so a forward of
  2-4 new rows costs ~1.3x one row and 5-8 rows ~2.2x (``python -m pardec.bench cost``): drafting loses on a
  weight-only target, which is why targets default to ``per_token`` (flat rows) and drafts (one-row steps) to this one.
* ``per_channel`` / ``per_tensor``: fbgemm's dynamic int8 (``torch.ao.quantization.quantize_dynamic``, one weight
  scale per row / per matrix): the activations are quantized too, with one dynamic scale for a linear's whole
  input. SmolLM2's MLP activations have outlier channels (``down_proj`` inputs up to 500x their median), so plain
  ``per_channel`` agrees with fp32's top-1 token on only 0.60 of positions (perplexity 4.8 against 1.48);
  SmoothQuant (:mod:`pardec.models.quant.smooth`, ``model.int8_smooth=0.8``, calibrated once on built-in text)
  and ``down_proj`` kept
  in fp32 (``model.int8_skip=[down_proj]``) bring it to 0.91-0.93 (perplexity 1.55 / 1.41): "fbgemm's recipe",
  the targets' default before ``per_token``. Nearly flat cost from 1 to 5 rows (the regime in which drafting pays), but slower than ``weight_only`` at one row
  (``down_proj`` in fp32 is ~40% of its step). The per-tensor activation scale makes a
  row's result depend on the other rows of the forward, so ``tokens`` methods match int8 ``ar`` only up to
  near-ties. ``quantize_dynamic`` is deprecated (torch says "will be removed"; present in torch 2.13).

* ``per_token`` (:class:`PerTokenLinear`; the targets' default, ``model.int8_weights`` with SmoothQuant 0.5): fbgemm's
  integer GEMM with one activation scale **per token**: each
  row of a linear's input is divided by its own largest magnitude and quantized with one fixed scale
  (``quantized::linear_with_input_q_dq_qweight_dq_output_fp32``), and the output row multiplied back. Integer sums
  are exact and a row's quantization depends on that row only, so the linears are **batch-invariant** (tested
  bitwise). Tokens with massive activations no longer squeeze the others (the per-tensor scale's failure), so
  ``down_proj`` can be int8 too: with SmoothQuant 0.5, top-1 agreement with fp32 0.957 / 0.961 (GSM8K / HumanEval)
  and perplexity +1.3% / +1.9%, against the fbgemm recipe's 0.913 / 0.927 and +4.2% / +4.2%, and a flat cost
  from 1 to 5 rows (docs/cpu_speed.md "Per-token int8").

torchao's int8 configs in eager mode measured slower than fp32 here (118 ms dynamic activation + weight, 29 ms
weight-only, against 47 ms fp32 for SmolLM2's linears at one row); ``weight_only`` calls the aten kernel itself,
with no tensor subclass in between. ``torch._int_mm`` (int8 x int8 -> int32) is a reference kernel on CPU, ~5x
slower than fp32 here (measured), which is why ``per_token`` goes through fbgemm's static-scale linear instead.

The quantized weights are cached (``data/models/int8/<key>.pt``, keyed by the model's identity, its weight
files' size and mtime, and the recipe), since quantizing a model costs seconds (SmolLM2-135M: 3-6 s) and loading the cache well
under one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import warnings
from pathlib import Path

import torch
from filelock import FileLock
from torch.ao.nn.quantized.dynamic import Linear
from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

from pardec import DATA_DIR
from pardec.config import INT8_WEIGHTS
from pardec.models import host
from pardec.models.quant import smooth as sq
from pardec.models.quant.smooth import is_skipped

log = logging.getLogger(__name__)

#: the warnings torch raises for the deprecated eager-mode quantization API (one per call and per quantized tensor)
_DEPRECATION = ("ignore", ".*(deprecated|will be removed).*")


def _quantized_linear_type() -> type:
    return Linear


class WeightOnlyLinear(torch.nn.Module):
    """``nn.Linear`` with int8 weights (one bf16 scale per output row) and unquantized activations: the input is
    rounded to bf16 and multiplied by the int8 weights in ``torch.ops.aten._weight_int8pack_mm`` (weights converted
    in registers, bf16 products accumulated in fp32; the output is bf16, returned in the input's dtype). No
    activation is quantized, so outlier channels cost nothing and each row's result is independent of the other
    rows of the forward (batch-invariant: tested bitwise); the weights' trip from memory is a quarter of fp32's."""

    #: the dtype of the per-row weight scales (what the kernel takes)
    scale_dtype = torch.bfloat16

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("scales", torch.ones(out_features, dtype=self.scale_dtype))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    @classmethod
    @torch.no_grad()
    def of(cls, lin: torch.nn.Linear) -> WeightOnlyLinear:
        w = lin.weight.float()
        scales = (w.abs().amax(1) / 127).clamp(min=1e-12).to(cls.scale_dtype)
        new = cls(lin.in_features, lin.out_features, lin.bias is not None)
        new.weight.copy_((w / scales.float()[:, None]).round().clamp(-127, 127).to(torch.int8))
        new.scales.copy_(scales)
        if lin.bias is not None:
            new.bias.copy_(lin.bias.float())
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales)
        y = y.to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _vnni() -> bool:
    """Whether fbgemm's int8 kernels accumulate u8 x s8 products straight into int32 on this CPU (VNNI / AMX). Without
    it (plain AVX2) they add pairs of products in int16 with saturation, which is why fbgemm's dynamic linears
    quantize activations to 7 bits there (``reduce_range``)."""
    return bool({"avx512_vnni", "avx_vnni", "amx_int8"} & set(host.cpu_flags()))


class PerTokenLinear(WeightOnlyLinear):
    """``nn.Linear`` with int8 weights (one fp32 scale per output row) and int8 activations with **one scale per
    token** (row of the input): each row is divided by its own largest magnitude and quantized with one fixed scale
    (``1/levels``, zero point ``levels + 1``) by fbgemm's
    ``quantized::linear_with_input_q_dq_qweight_dq_output_fp32`` (integer GEMM, int32 accumulation, fp32 output),
    and the output row is multiplied back by that magnitude. The quantization of a row depends on that row only and
    integer sums are exact, so the linear is **batch-invariant** (a row alone gives bitwise the result it gets among
    other rows; tested), unlike fbgemm's dynamic linears, which take one activation scale for the whole input.
    ``levels`` is 127 (8-bit activations) on CPUs with VNNI/AMX and 63 (7-bit, fbgemm's ``reduce_range``) without,
    where fbgemm's AVX2 kernels saturate int16 pair sums. Activations massive on a few tokens (the per-tensor scale's
    problem) cost nothing here; outlier *channels* within a token still do (SmoothQuant applies, as for fbgemm's
    dynamic schemes). Inherits :class:`WeightOnlyLinear`'s buffers (int8 ``weight``, per-row ``scales``, ``bias``)
    and :meth:`~WeightOnlyLinear.of`, with fp32 scales; fbgemm's packed weights are derived from them on first use
    (not saved)."""

    scale_dtype = torch.float32

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__(in_features, out_features, bias)
        self.levels = 127 if _vnni() else 63
        self._packed = None

    def _load_from_state_dict(self, *args, **kwargs):
        self._packed = None  # new weights: pack again on first use
        super()._load_from_state_dict(*args, **kwargs)

    def packed(self):
        """fbgemm's prepacked weights (built once from the int8 ``weight`` and ``scales``; the bias stays out: it is
        added after the per-token rescale)."""
        if self._packed is None:
            with warnings.catch_warnings():  # quantized tensors are deprecated like quantize_dynamic (module doc)
                warnings.filterwarnings(*_DEPRECATION)
                q = torch._make_per_channel_quantized_tensor(self.weight, self.scales.double(),
                                                             torch.zeros_like(self.scales, dtype=torch.long), 0)
                self._packed = torch.ops.quantized.linear_prepack(q, None)
        return self._packed

    def gemm(self, unit: torch.Tensor) -> torch.Tensor:
        """fbgemm's integer GEMM of rows whose largest magnitude is 1 (quantized with the fixed scale
        ``1/levels``): the one part of the forward a compiled graph cannot trace (its weights are packed)."""
        return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
            unit, 1.0 / self.levels, self.levels + 1, self.packed())

    def forward(self, x: torch.Tensor, gemm=None) -> torch.Tensor:
        """``gemm``: what runs :meth:`gemm` (the compiled forward passes its opaque op)."""
        flat = x.reshape(-1, self.in_features).float()
        mag = flat.abs().amax(-1, keepdim=True).clamp(min=1e-12)
        y = (gemm or self.gemm)(flat / mag)
        y = (y * mag).to(x.dtype).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias.to(x.dtype)


@torch.no_grad()
def linear_rows(lin: torch.nn.Module, ids: torch.Tensor) -> torch.nn.Module:
    """A linear computing only output rows ``ids`` [K] of ``lin`` (a head restricted to a draft vocabulary): an
    ``nn.Linear`` of its rows (the same outputs up to the GEMM's summation order), or one of pardec's int8 linears
    keeping their int8 rows and per-row scales, whose kept outputs are bitwise ``lin``'s (integer sums, per-row
    weight scales, per-token activation scales or none). fbgemm's dynamic linears, whose activation scale is shared,
    give an ``nn.Linear`` of their dequantized rows."""
    ids = ids.to(torch.long)
    if isinstance(lin, WeightOnlyLinear):  # (PerTokenLinear included)
        new = type(lin)(lin.in_features, len(ids), lin.bias is not None)
        idx = ids.to(lin.weight.device)
        new.weight = lin.weight.index_select(0, idx).clone()
        new.scales = lin.scales.index_select(0, idx).clone()
        if lin.bias is not None:
            new.bias = lin.bias.index_select(0, idx).clone()
        return new
    if isinstance(lin, _quantized_linear_type()):
        weight, bias = lin.weight().dequantize(), lin.bias()
    elif isinstance(getattr(lin, "weight", None), torch.Tensor) and lin.weight.dim() == 2:
        weight, bias = lin.weight, getattr(lin, "bias", None)
    else:
        raise TypeError(f"linear_rows: {type(lin).__name__} is not a linear layer")
    idx = ids.to(weight.device)
    new = torch.nn.Linear(weight.shape[1], len(ids), bias=bias is not None, device=weight.device, dtype=weight.dtype)
    new.weight.copy_(weight.index_select(0, idx))
    if bias is not None:
        new.bias.copy_(bias.index_select(0, idx))
    return new


def is_int8(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs int8 linears (it was loaded with ``dtype=int8``)."""
    kinds = (_quantized_linear_type(), WeightOnlyLinear)  # PerTokenLinear is a WeightOnlyLinear
    return any(isinstance(m, kinds) for m in model.modules())


#: how the weights are scaled and the activations treated: ``weight_only`` (:class:`WeightOnlyLinear`: one scale per
#: output row, activations in bf16, not quantized), ``per_channel`` (fbgemm's dynamic int8: one weight scale per
#: output row, the activations quantized with one dynamic scale per forward), ``per_tensor`` (the same with one
#: weight scale per matrix: what ``quantize_dynamic(model, {nn.Linear})`` gives when no qconfig is named),
#: ``per_token`` (:class:`PerTokenLinear`: one weight scale per output row, one activation scale per token;
#: batch-invariant)
#: the schemes whose activations are quantized (smoothing applies to them only)
DYNAMIC_SCHEMES = ("per_channel", "per_tensor", "per_token")
#: the schemes whose linears are pardec's own modules (the others are fbgemm's dynamic linears)
OWN_LINEARS = {"weight_only": WeightOnlyLinear, "per_token": PerTokenLinear}


def quantize(model: torch.nn.Module, scheme: str = "per_channel", skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """Every ``nn.Linear`` of ``model`` -> int8 weights (``scheme``: :data:`INT8_WEIGHTS`), in place, except those
    whose name ends with one of ``skip`` (e.g. ``down_proj``: they stay fp32). CPU only."""
    if scheme not in INT8_WEIGHTS:
        raise ValueError(f"int8 weight scheme {scheme!r} is not one of {', '.join(INT8_WEIGHTS)}")
    if scheme in OWN_LINEARS:
        if scheme == "weight_only":
            _warn_without_bf16()
        replace_linears(model, skip, OWN_LINEARS[scheme].of)
        return model
    qconfig = per_channel_dynamic_qconfig if scheme == "per_channel" else default_dynamic_qconfig
    spec = {name: qconfig for name, mod in model.named_modules()
            if type(mod) is torch.nn.Linear and not is_skipped(name, skip)}
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)


def parse_recipe(text: str) -> dict:
    """An int8 recipe on a command line (``scripts/int8_quality.py``, ``python -m pardec.bench cost``):
    ``per_channel:smooth=0.8:skip=down_proj+o_proj`` -> ModelConfig's int8 fields (an option left out is off);
    errors name the bad part."""
    scheme, *opts = text.split(":")
    if scheme not in INT8_WEIGHTS:
        raise ValueError(f"recipe {text!r}: scheme {scheme!r} not valid; choose from: {', '.join(INT8_WEIGHTS)}")
    out = {"int8_weights": scheme, "int8_smooth": None, "int8_skip": []}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "smooth":
            out["int8_smooth"] = float(value)
        elif key == "skip":
            out["int8_skip"] = value.split("+")
        else:
            raise ValueError(f"recipe {text!r}: option {key!r} not valid; choose from: smooth, skip")
    return out


def prepare(model: torch.nn.Module, scheme: str = "per_channel", smooth_alpha: float | None = None,
            skip: tuple[str, ...] = (), calib: list[list[int]] | None = None) -> torch.nn.Module:
    """:func:`~pardec.models.quant.smooth.smooth` (when ``smooth_alpha`` is set; needs ``calib``) then :func:`quantize`."""
    if smooth_alpha is not None and scheme not in DYNAMIC_SCHEMES:
        raise ValueError(f"int8 smoothing (alpha {smooth_alpha}) applies to the schemes that quantize activations "
                         f"({', '.join(DYNAMIC_SCHEMES)}), not to {scheme!r}")
    if smooth_alpha is not None:
        if not calib:
            raise ValueError("int8 smoothing needs calibration token ids")
        sq.smooth(model, smooth_alpha, calib, skip)
    return quantize(model, scheme, skip)


def weight_scheme(model: torch.nn.Module) -> str | None:
    """``weight_only``, ``per_channel``, ``per_tensor`` or ``per_token``: the scheme of ``model``'s int8 linears (None: no int8)."""
    qlin = _quantized_linear_type()
    for m in model.modules():
        if isinstance(m, PerTokenLinear):
            return "per_token"
        if isinstance(m, WeightOnlyLinear):
            return "weight_only"
        if isinstance(m, qlin):
            return "per_channel" if m.weight().qscheme() == torch.per_channel_affine else "per_tensor"
    return None


def _warn_without_bf16() -> None:
    if not {"avx512_bf16", "amx_bf16"} & set(host.cpu_flags()):
        log.warning("int8 weight_only on a CPU without avx512_bf16/amx_bf16: its bf16 GEMM was measured fast only with "
                    "them (an AVX2 host ran SmolLM2's linears at 64 ms per row against fbgemm's 13); if it is slow here "
                    "use int8_weights=per_channel (model. or draft.)")


def replace_linears(model: torch.nn.Module, skip: tuple[str, ...], make) -> None:
    """Each ``nn.Linear`` of ``model`` not in ``skip`` -> ``make(linear)``, in place (also :mod:`pardec.models.quant.packed`)."""
    for mod_name, mod in list(model.named_modules()):
        for child_name, child in list(mod.named_children()):
            full = f"{mod_name}.{child_name}" if mod_name else child_name
            if type(child) is torch.nn.Linear and not is_skipped(full, skip):
                setattr(mod, child_name, make(child))


def _skeleton(model: torch.nn.Module, skip: tuple[str, ...] = (), scheme: str = "per_channel") -> torch.nn.Module:
    """``model`` with each ``nn.Linear`` not in ``skip`` replaced by an empty int8 linear of the same shape (of
    ``scheme``), ready for a cached state dict (no weight is quantized: building it costs milliseconds)."""
    if scheme in OWN_LINEARS:
        if scheme == "weight_only":
            _warn_without_bf16()
        cls = OWN_LINEARS[scheme]
        replace_linears(model, skip, lambda c: cls(c.in_features, c.out_features, c.bias is not None))
        return model
    qlin = _quantized_linear_type()
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        replace_linears(model, skip, lambda c: qlin(c.in_features, c.out_features, bias_=c.bias is not None,
                                                    dtype=torch.qint8))
    return model


def cache_key(identity: dict, weight_files: list[Path], recipe: dict | None = None) -> str:
    """A key that changes when the model's identity, any of its weight files (size, mtime) or the int8 ``recipe``
    (scheme, smoothing, skipped linears, calibration) changes."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(weight_files) if f.is_file()]
    blob = json.dumps({"identity": identity, "files": stats, "torch": torch.__version__, "recipe": recipe or {},
                       "calibration": sq.CALIBRATION, "calibration_attention": sq.CALIBRATION_ATTENTION},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def quantize_cached(model: torch.nn.Module, key: str | None, cache_dir: Path | None = None,
                    scheme: str = "per_channel", smooth_alpha: float | None = None, skip: tuple[str, ...] = (),
                    calib: list[list[int]] | None = None) -> torch.nn.Module:
    """``prepare(model, ...)`` (smoothing, then int8 linears), reading the int8 weights from ``<cache_dir>/<key>.pt`` when written before and writing
    them there otherwise (``key=None``: no cache, e.g. an in-memory tiny model). A cache file that does not read
    (a truncated copy, another torch) is rebuilt, not trusted."""
    if key is None:
        return prepare(model, scheme, smooth_alpha, skip, calib)
    cache_dir = cache_dir or DATA_DIR / "models" / "int8"
    cache_dir.mkdir(parents=True, exist_ok=True)
    # processes asking at once (ranks, test workers) quantize once: the others wait, then read the first one's file
    with FileLock(str(cache_dir / f"{key}.lock")):
        return _quantize_cached(model, cache_dir / f"{key}.pt", scheme, smooth_alpha, skip, calib)


def _quantize_cached(model: torch.nn.Module, f: Path, scheme: str, smooth_alpha: float | None,
                     skip: tuple[str, ...], calib: list[list[int]] | None) -> torch.nn.Module:
    state = None
    if f.is_file():
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(*_DEPRECATION)
                state = torch.load(f, weights_only=False)
        except Exception as e:  # noqa: BLE001 - rebuilt below
            log.warning("int8 cache %s unreadable (%s); quantizing again", f, e)
    if state is not None:
        skel = _skeleton(model, skip, scheme)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(*_DEPRECATION)
                skel.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise RuntimeError(f"the int8 cache {f} does not fit this model ({str(e)[:200]}); delete it") from e
        return skel
    model = prepare(model, scheme, smooth_alpha, skip, calib)
    tmp = f.with_suffix(f".tmp-{os.getpid()}")
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        torch.save(model.state_dict(), tmp)
    tmp.replace(f)  # atomic: a killed write leaves no half file under the final name
    log.info("int8 weights cached in %s", f)
    return model
