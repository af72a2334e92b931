"""bf16 linears with their weights prepacked once into oneDNN's blocked layout (``model.cpu_prepack``, on by default
for ``dtype=bf16`` on a CPU with AMX-bf16).

Why: ``F.linear`` on a bf16 CPU tensor calls oneDNN, which reorders the plain ``[out, in]`` weight into the blocked
layout its AMX / AVX-512-bf16 kernel reads *on every call*. For SmolLM2's 210 decoder linears that reorder costs
more than the product: on an Intel Xeon with AMX (``scripts/linear_cost.py``, 2 threads) the linears took 20.8 ms
per pass at one row and the same at 16 rows (flat: AMX tiles are 16 rows), packed 13.7 ms at every row count from
1 to 16; the 49k-row LM head 2.5 ms -> 1.1 ms. fp32 packed through MKL (``torch.ops.mkl._mkl_linear``) gained
nothing on that CPU, so only bf16 is packed. Inductor does the same packing inside a frozen graph
(``torch._inductor.config.freezing``); doing it at load time gives it to every forward (hf, lean and the compiled
step).

Results: bitwise the same as ``F.linear`` on the same bf16 weights (tested on the AMX host), and each row's result
is independent of the other rows of the call (tested): the packing changes where the weights lie, not the
arithmetic. Only CPUs with AMX-bf16 pack (:func:`supported`): on AVX-512-bf16 without AMX (e.g. AMD Zen 4) neither
the gain nor the bitwise equality was measured, and without native bf16 (AVX2 only) ``F.linear`` takes another
kernel altogether; there nothing is packed.

Inference only: a packed weight is an opaque ``torch._mkldnn`` tensor, with no autograd and no ``.to(device)``;
the plain weight stays the module's parameter (tied weights stay tied; ``.weight`` reads work), so the packed copy
costs one more copy of the linears' weights in memory. Training loads models unpacked (:func:`pardec.models.loading.trainable`).
"""

from __future__ import annotations

import torch
from torch import nn

from pardec.models import host
from pardec.models.quant.int8 import replace_linears


def supported() -> bool:
    """Whether loading packs bf16 linears here: a CPU with AMX-bf16 (the only kind on which packing was measured, to
    pay and to give bitwise ``F.linear``'s results) whose oneDNN runs bf16."""
    return ("amx_bf16" in host.cpu_flags() and torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


class PackedLinear(nn.Module):
    """A bf16 ``nn.Linear`` whose weight is also held prepacked for oneDNN; ``forward`` reads only the packed copy."""

    def __init__(self, lin: nn.Linear):
        super().__init__()
        if lin.weight.dtype != torch.bfloat16 or lin.weight.device.type != "cpu":
            raise ValueError(f"PackedLinear packs bf16 CPU linears; got {lin.weight.dtype} on {lin.weight.device}")
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight = lin.weight  # the same Parameter (a tied weight stays tied)
        self.bias = lin.bias
        # (the batch-size hint picks a layout; measured flat from 1 to 16 rows with the hint 1)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach(), 1)
        self._bias = None if lin.bias is None else lin.bias.detach()  # (what the op reads: no autograd here)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self._bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def prepack(model: nn.Module) -> int:
    """Replace every bf16 CPU ``nn.Linear`` of ``model`` by a :class:`PackedLinear`, in place; the number of packed
    linears ``model`` then has (0 where :func:`supported` is false)."""
    if not supported():
        return 0
    replace_linears(model, (), lambda c: PackedLinear(c) if c.weight.dtype == torch.bfloat16
                    and c.weight.device.type == "cpu" else c)
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
