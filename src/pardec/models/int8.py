"""The ``dtype=int8`` CPU mode: the ``nn.Linear`` layers of a loaded model (attention, MLP, LM head) hold int8
weights with one scale per output row (``quantize_dynamic``'s default qconfig is one scale per *matrix*) and run
fbgemm's dynamic-quantized GEMM; embeddings, norms and activations stay fp32.

Quality (``scripts/int8_quality.py``, README "int8 that keeps the model's quality"): fbgemm quantizes a linear's
whole input with one dynamic scale, and SmolLM2's MLP activations have outlier channels (``down_proj`` inputs up
to 500x their median), so plain int8 agreed with fp32's top-1 token on only 0.60 of positions (perplexity of
fp32's own greedy text 4.8 against 1.48). The default recipe therefore (1) applies SmoothQuant (:func:`smooth`,
``model.int8_smooth=0.8``), calibrated once on built-in text, and (2) keeps ``down_proj`` in fp32
(``model.int8_skip=[down_proj]``): top-1 agreement 0.91-0.93, perplexity 1.56 / 1.43 against fp32's 1.48 / 1.35,
at ~2.3x fp32's decoding speed (plain int8: ~3x). ``model.int8_smooth=null 'model.int8_skip=[]'`` (with ``+``
on the command line) is the fast, lossy mode. Nearly flat cost from 1 to 5 rows either way
(``scripts/forward_cost.py --dtype int8``): the memory-bound regime in which drafting pays.

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

The quantized weights are cached (``data/models/int8/<key>.pt``, keyed by the model's identity, its weight
files' size and mtime, and the recipe), since quantizing a model costs seconds (SmolLM2-135M: 3-6 s) and loading the cache well
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


def quantize(model: torch.nn.Module, scheme: str = "per_channel", skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """Every ``nn.Linear`` of ``model`` -> int8 weights (``scheme``: :data:`SCHEMES`) + fbgemm dynamic GEMM, in
    place, except those whose name ends with one of ``skip`` (e.g. ``down_proj``: they stay fp32). CPU only."""
    from torch.ao.quantization import default_dynamic_qconfig, per_channel_dynamic_qconfig

    if scheme not in SCHEMES:
        raise ValueError(f"int8 weight scheme {scheme!r} is not one of {', '.join(SCHEMES)}")
    qconfig = per_channel_dynamic_qconfig if scheme == "per_channel" else default_dynamic_qconfig
    spec = {name: qconfig for name, mod in model.named_modules()
            if type(mod) is torch.nn.Linear and not _skipped(name, skip)}
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        return torch.ao.quantization.quantize_dynamic(model, spec, dtype=torch.qint8, inplace=True)


def _skipped(name: str, skip: tuple[str, ...]) -> bool:
    return any(name == s or name.endswith("." + s) for s in skip)


#: calibration text for :func:`smooth` (what the models pardec ships are run on: math word problems, code, prose)
CALIBRATION = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May? Natalia sold 48 / 2 = 24 clips in May. Natalia sold 48 + 24 = 72 "
    "clips altogether in April and May. The answer is 72.",
    "def fibonacci(n: int) -> list[int]:\n    \"\"\"Return the first n Fibonacci numbers.\"\"\"\n    out = [0, 1]\n"
    "    while len(out) < n:\n        out.append(out[-1] + out[-2])\n    return out[:n]\n\n\nclass Stack:\n"
    "    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a screw press. Within fifty years presses were working in more than two hundred "
    "cities across Europe, and the price of books fell sharply. Summarise the main points in two sentences.",
)


def calibration_ids(tokenizer) -> list[list[int]]:
    """:data:`CALIBRATION` as token ids: as plain text and, when the tokenizer has one, in its chat template (the
    special tokens of a chat turn carry activations of their own)."""
    out = [tokenizer(t)["input_ids"] for t in CALIBRATION]
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": CALIBRATION[2]}, {"role": "assistant", "content": CALIBRATION[0]}]
        out.append(list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]))
    return out


@torch.no_grad()
def smooth(model: torch.nn.Module, alpha: float, calib: list[list[int]], skip: tuple[str, ...] = ()) -> int:
    """SmoothQuant (Xiao et al., ICML 2023, Eq. 4), in place and exact in real arithmetic: for the linears that
    read a normalised hidden state (q/k/v after ``input_layernorm``, gate/up after ``post_attention_layernorm``)
    and for ``down_proj`` (whose input is ``act(gate) * up``), each input channel j is divided by
    ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` upstream (the norm's weight, ``up_proj``'s row j) and
    multiplied into the weights' column j. ``max|X_j|`` comes from fp32 forwards of ``calib`` (token id lists).
    fbgemm's dynamic int8 quantizes a linear's whole input with one scale, so a few outlier channels (SmolLM2's
    ``down_proj`` inputs reach 500x their median) leave the others a handful of levels; moving them into the
    weights, which have a scale per output row, is what this buys. Linears named in ``skip`` (left fp32) are left
    as they are. Llama-style decoder layers only (``model.model.layers[i].self_attn/mlp``); returns how many
    groups of linears it smoothed (0: not a Llama-style model, nothing done)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or not all(hasattr(ly, "mlp") and hasattr(ly, "self_attn") for ly in layers):
        log.warning("int8_smooth: %s has no Llama-style decoder layers; quantizing without smoothing",
                    type(model).__name__)
        return 0
    amax: dict[int, torch.Tensor] = {}
    hooks = []
    for mod in model.modules():
        if type(mod) is torch.nn.Linear:
            def record(m, inp, out):
                x = inp[0].detach().abs().flatten(0, -2).amax(0).float()
                amax[id(m)] = torch.maximum(amax[id(m)], x) if id(m) in amax else x
            hooks.append(mod.register_forward_hook(record))
    try:
        dev = next(model.parameters()).device
        for ids in calib:
            model(input_ids=torch.tensor([ids], device=dev))
    finally:
        for h in hooks:
            h.remove()

    def scale(x_max: torch.Tensor, linears: list[torch.nn.Linear]) -> torch.Tensor:
        w_max = torch.stack([lin.weight.abs().amax(0).float() for lin in linears]).amax(0)
        return (x_max.clamp(min=1e-5) ** alpha / w_max.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)

    done = 0
    for i, layer in enumerate(layers):
        att, mlp = layer.self_attn, layer.mlp
        groups = [(f"model.layers.{i}.self_attn.", [att.q_proj, att.k_proj, att.v_proj], ("q_proj", "k_proj", "v_proj"),
                   layer.input_layernorm.weight, None),
                  (f"model.layers.{i}.mlp.", [mlp.gate_proj, mlp.up_proj], ("gate_proj", "up_proj"),
                   layer.post_attention_layernorm.weight, None),
                  (f"model.layers.{i}.mlp.", [mlp.down_proj], ("down_proj",), None, mlp.up_proj.weight)]
        for prefix, linears, names, norm_w, up_w in groups:
            if any(_skipped(prefix + n, skip) for n in names) or id(linears[0]) not in amax:
                continue
            s = scale(amax[id(linears[0])], linears)
            for lin in linears:
                lin.weight.mul_(s.to(lin.weight.dtype))
            if norm_w is not None:
                norm_w.div_(s.to(norm_w.dtype))
            else:
                up_w.div_(s.to(up_w.dtype)[:, None])
            done += 1
    return done


def prepare(model: torch.nn.Module, scheme: str = "per_channel", smooth_alpha: float | None = None,
            skip: tuple[str, ...] = (), calib: list[list[int]] | None = None) -> torch.nn.Module:
    """:func:`smooth` (when ``smooth_alpha`` is set; needs ``calib``) then :func:`quantize`."""
    if smooth_alpha is not None:
        if not calib:
            raise ValueError("int8 smoothing needs calibration token ids")
        smooth(model, smooth_alpha, calib, skip)
    return quantize(model, scheme, skip)


def weight_scheme(model: torch.nn.Module) -> str | None:
    """``per_channel`` or ``per_tensor``: how the int8 linears of ``model`` scale their weights (None: no int8)."""
    qlin = _quantized_linear_type()
    for m in model.modules():
        if isinstance(m, qlin):
            return "per_channel" if m.weight().qscheme() == torch.per_channel_affine else "per_tensor"
    return None


def _skeleton(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> torch.nn.Module:
    """``model`` with each ``nn.Linear`` not in ``skip`` replaced by an empty int8 linear of the same shape, ready
    for a cached state dict (no weight is quantized: building it costs milliseconds)."""
    qlin = _quantized_linear_type()
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        for mod_name, mod in list(model.named_modules()):
            for child_name, child in list(mod.named_children()):
                full = f"{mod_name}.{child_name}" if mod_name else child_name
                if type(child) is torch.nn.Linear and not _skipped(full, skip):
                    new = qlin(child.in_features, child.out_features, bias_=child.bias is not None, dtype=torch.qint8)
                    setattr(mod, child_name, new)
    return model


def cache_key(identity: dict, weight_files: list[Path], recipe: dict | None = None) -> str:
    """A key that changes when the model's identity, any of its weight files (size, mtime) or the int8 ``recipe``
    (scheme, smoothing, skipped linears, calibration) changes."""
    stats = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(weight_files) if f.is_file()]
    blob = json.dumps({"identity": identity, "files": stats, "torch": torch.__version__, "recipe": recipe or {},
                       "calibration": CALIBRATION}, sort_keys=True, default=str)
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
        skel = _skeleton(model, skip)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings(*_DEPRECATION)
                skel.load_state_dict(state, strict=True)
        except RuntimeError as e:
            raise RuntimeError(f"the int8 cache {f} does not fit this model ({str(e)[:200]}); delete it") from e
        return skel
    model = prepare(model, scheme, smooth_alpha, skip, calib)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = f.with_suffix(".tmp")
    with warnings.catch_warnings():
        warnings.filterwarnings(*_DEPRECATION)
        torch.save(model.state_dict(), tmp)
    tmp.replace(f)  # atomic: a killed write leaves no half file under the final name
    log.info("int8 weights cached in %s", f)
    return model
