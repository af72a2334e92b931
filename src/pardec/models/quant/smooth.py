"""SmoothQuant for pardec's int8 models (:mod:`pardec.models.quant.int8`): the calibration text and its token ids,
and :func:`smooth`, which moves outlier activation channels into the weights before quantizing."""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("pardec.models.quant.int8")  # (its messages have always carried the int8 module's name)


def is_skipped(name: str, skip: tuple[str, ...]) -> bool:
    """Whether linear ``name`` is one of ``skip`` (a name or a dotted suffix: left fp32)."""
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


#: the attention the calibration forwards of :func:`smooth` run through, whatever the model's (part of the cache key)
CALIBRATION_ATTENTION = "sdpa"


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
    # the calibration runs through SDPA whatever attention the run asked for: the int8 weights are cached by a key
    # that leaves the attention out, and pardec's invariant attention (or eager) differs from SDPA in the last bits,
    # which moved some smoothing scales and int8 weights by one step (seen 2026-11-27: a cache calibrated under
    # attn_implementation=invariant gave other int8 `ar` text than the one calibrated under SDPA)
    config = getattr(model, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    try:
        if attn is not None:
            config._attn_implementation = CALIBRATION_ATTENTION
        dev = next(model.parameters()).device
        for ids in calib:
            model(input_ids=torch.tensor([ids], device=dev))
    finally:
        for h in hooks:
            h.remove()
        if attn is not None:
            config._attn_implementation = attn

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
            if any(is_skipped(prefix + n, skip) for n in names) or id(linears[0]) not in amax:
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
