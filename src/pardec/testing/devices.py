"""Catch device bugs without a GPU: run real CPU tensors as if some of them lived on a CUDA device.

CI has no GPU, and `FakeTensorMode` cannot stand in for one on a CPU-only build of PyTorch: indexing, ``.to("cuda")``
and CUDA generators reach the missing CUDA runtime, and fake tensors have no values, so no decoder gets past its
first data-dependent step. :class:`VirtualCUDA` keeps the values real and the device virtual:

* every tensor carries a *virtual* device (CPU unless placed on ``cuda:N``); ``t.device``, ``t.is_cuda`` and
  ``t.get_device()`` report it, and ``module.to("cuda")``, ``t.to(other)``, ``torch.zeros(..., device=d)``,
  ``torch.Generator(device=d)``, ``t.cpu()`` move or create on it, as on a GPU machine;
* every torch call checks its tensors as PyTorch's CUDA kernels would, and raises :class:`DeviceMismatchError`
  (naming the call and the devices) where a real GPU run would crash: a CPU tensor with more than one element met
  by a CUDA one (0-dim CPU tensors are scalars and allowed, as in PyTorch; CPU indices into a CUDA tensor too),
  or a generator on another device than the tensors it samples for;
* host syncs are counted (``syncs``): ``item``/``tolist``/``bool``/``int``/``float``/``numpy`` of a CUDA tensor,
  blocking copies to the CPU (``non_blocking=True`` ones go to ``async_copies``), ``nonzero`` and boolean-mask
  indexing (whose output size the host must read),
  ``torch.cuda.synchronize``, ``torch.cuda.Event.synchronize``. A test can assert a decoding step's budget.
  ``torch.cuda.Event`` records the host clock, so event-based timing runs too.

Data-dependent steps run, since the values are real: whole training steps and whole generations run under it.
What it cannot see: a kernel that exists on CPU but not on CUDA (or the reverse), numerics, memory, and code
that branches on ``torch.version.cuda`` or on CUDA-only libraries (flash-attention, NCCL).

Usage::

    with VirtualCUDA() as vc:
        model = vc.place(model)           # parameters and buffers now report cuda:0
        ids = torch.tensor([[1, 2]], device="cuda")
        out = model(ids)                   # a CPU tensor meeting the CUDA weights raises here
    vc.syncs                               # Counter of host syncs by call name
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from pardec.testing.cuda_api import DeviceMismatchError, as_device, stand_ins

CPU = torch.device("cpu")
_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # sync sites are named relative to pardec's source


def _is_device_arg(a: Any) -> bool:
    if isinstance(a, torch.device):
        return True
    if isinstance(a, str):
        try:
            torch.device(a)
        except RuntimeError:
            return False
        return True
    return isinstance(a, int) and not isinstance(a, bool)  # .to(0) means cuda:0


# calls whose result the host must read from a CUDA device (one sync each)
_HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "nonzero",
               "equal", "allclose", "masked_select", "unique", "unique_consecutive", "argwhere"}
# calls that may cross devices by design: copies
_COPIES = {"copy_"}
_INDEXING = {"__getitem__", "__setitem__", "index_select", "index", "gather", "take_along_dim"}
# metadata reads: no device check, no tagging
_QUIET = {"__repr__", "__format__", "__str__", "dim", "size", "numel", "stride", "storage_offset", "is_contiguous",
          "data_ptr", "element_size", "__hash__", "requires_grad_", "register_hook", "retain_grad", "untyped_storage",
          "_has_compatible_shallow_copy_type", "is_floating_point", "is_complex", "is_signed"}
# calls that refuse even 0-dim CPU tensors next to CUDA ones (not elementwise: no scalar promotion)
_NO_SCALARS = {"cat", "concat", "concatenate", "stack", "hstack", "vstack", "matmul", "mm", "bmm", "linear",
               "embedding", "conv1d", "conv2d", "scaled_dot_product_attention"}
# factories that return their input unchanged when it is already where (they think) it should go
_CONVERTS = {"as_tensor", "asarray", "tensor"}


class VirtualCUDA(TorchFunctionMode):
    """See the module's docstring. ``patch_cuda`` also makes ``torch.cuda.is_available()`` true (one device per
    ``devices``), ``torch.cuda.synchronize`` a counted no-op and ``torch.Generator`` accept virtual devices."""

    def __init__(self, devices: int = 1, patch_cuda: bool = True, trace: bool = False, memory: int = 80 << 30) -> None:
        super().__init__()
        self.devices = devices
        #: bytes each virtual device says it has free (``torch.cuda.mem_get_info``, what accelerate's
        #: ``device_map=auto`` plans with; its total is at least 80 GiB); nothing is allocated on it, so allocation
        #: counters read 0
        self.memory = memory
        self.current = 0  # torch.cuda.current_device(), as torch.cuda.set_device left it
        self.patch_cuda = patch_cuda
        self.syncs: Counter[str] = Counter()
        #: with ``trace=True``: host syncs by (call name, ``file:line`` of the innermost pardec frame that made it),
        #: to find where a step's reads come from
        self.sync_sites: Counter[tuple[str, str]] = Counter()
        self.trace = trace
        #: copies to the host with ``non_blocking=True`` (into pinned memory): no host sync, so not in ``syncs``
        self.async_copies: Counter[str] = Counter()
        #: blocking copies host -> device (``torch.tensor(data, device="cuda")``, ``.to("cuda")`` of a CPU tensor):
        #: from pageable memory CUDA waits for the stream there, which ``torch.cuda.set_sync_debug_mode`` reports as
        #: a sync; kept apart from ``syncs`` (reads) so tests can budget each
        self.uploads: Counter[str] = Counter()
        self._tags = WeakTensorKeyDictionary()
        self._by_storage: dict[int, torch.device] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    # ------------------------------------------------------------------------------------------ placement
    def device_of(self, t: torch.Tensor) -> torch.device:
        d = self._tags.get(t)
        if d is not None:
            return d
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return CPU
        return self._by_storage.get(ptr, CPU) if ptr else CPU

    def _tag(self, t: torch.Tensor, d: torch.device) -> None:
        self._tags[t] = d
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return
        if ptr:
            if d == CPU:
                self._by_storage.pop(ptr, None)
            else:
                self._by_storage[ptr] = d

    def place(self, obj: Any, device: Any = "cuda") -> Any:
        """Put a module's parameters and buffers, a tensor, or the tensors of a nested structure on ``device``
        (in place: no copy); returns ``obj``."""
        d = as_device(device)
        if isinstance(obj, torch.nn.Module):
            for t in [*obj.parameters(), *obj.buffers()]:
                self._tag(t, d)
            return obj
        for t in tree_flatten(obj)[0]:
            if isinstance(t, torch.Tensor):
                self._tag(t, d)
        return obj

    # ------------------------------------------------------------------------------------------ the mode
    def __enter__(self):
        if self.patch_cuda:
            for owner, name, value in stand_ins(self):
                self._saved.append((owner, name, getattr(owner, name)))
                setattr(owner, name, value)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            while self._saved:
                owner, name, value = self._saved.pop()
                setattr(owner, name, value)

    def _generator_device(self, g: Any) -> torch.device:
        return getattr(g, "virtual_device", None) or as_device(g.device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        owner = getattr(func, "__self__", None)
        if name == "__get__" and owner is torch.Tensor.device:
            return self.device_of(args[0])
        if name == "__get__" and owner is torch.Tensor.is_cuda:
            return self.device_of(args[0]).type == "cuda"
        if name == "__set__" and owner is torch.Tensor.data:
            func(*args, **kwargs)
            self._tag(args[0], self.device_of(args[1]))
            return None
        if name == "__get__" and owner is torch.Tensor.data:
            out = func(*args, **kwargs)
            self._tag(out, self.device_of(args[0]))
            return out
        if name == "pin_memory":  # page-locked host memory: a host tensor still (no CUDA runtime to lock it with)
            out = args[0].clone()
            self._tag(out, CPU)
            return out
        if name == "get_device":
            d = self.device_of(args[0])
            return d.index if d.type == "cuda" else -1
        if name == "__get__":  # t.grad, t.T, t.mT, ...: tensors read off a tensor live where it does
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and out not in self._tags:
                self._tag(out, self.device_of(args[0]))
            return out
        if func is torch.device and args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return as_device(args[0])  # torch.device(1): the accelerator's device 1, which a CPU build has not
        if name == "_parse_to":  # Module.to's argument parser: it reads the device, it creates nothing there
            return func(*args, **kwargs)
        if name in _QUIET or name.startswith("__") and name.endswith("__") and name[2:-2] in ("set", "delete"):
            return func(*args, **kwargs)
        if name in ("to", "cuda", "cpu", "type_as") and args and isinstance(args[0], torch.Tensor):
            return self._move(func, name, args, kwargs)

        # devices of the tensors this call meets
        flat = tree_flatten((args, kwargs))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        devs = [(t, self.device_of(t)) for t in tensors]
        target = None
        if "device" in kwargs and kwargs["device"] is not None:
            target = as_device(kwargs["device"])
            kwargs["device"] = "cpu"
            if target.type == "cuda" and name in ("tensor", "as_tensor"):
                self.uploads[name] += 1
        self._check(name, devs, args)
        common = next((d for t, d in devs if d.type != "cpu"), CPU)
        out_dev = target or common
        gen = kwargs.get("generator")
        if gen is not None and self._generator_device(gen).type != out_dev.type:
            raise DeviceMismatchError(f"{name}: a generator on {self._generator_device(gen)} samples for tensors on "
                                      f"{out_dev}; make the generator with torch.Generator(device=<their device>)")
        if name == "numpy" and common.type == "cuda":
            raise DeviceMismatchError("numpy: a CUDA tensor has no numpy view; move it with .cpu() first")
        if name in _HOST_READS and common.type == "cuda":
            self._sync(name)
        if name == "__getitem__" and common.type == "cuda" and any(
                isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in tree_flatten(args[1:])[0]):
            self._sync("boolean mask index")
        if name == "__setitem__" and common.type == "cuda" and _uploads_index(args):
            self.uploads["__setitem__ host scalar"] += 1
        out = func(*args, **kwargs)
        if name.endswith("_") and not name.startswith("__") or name == "__setitem__":
            return out  # in place: the tensor keeps its device
        inputs = {id(t) for t in tensors}
        if name in _CONVERTS and isinstance(out, torch.Tensor) and id(out) in inputs and \
                self.device_of(out) != out_dev:
            out = out.clone()  # on a GPU this would have been a copy to out_dev
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in inputs:
                self._tag(t, out_dev)
        return out

    def _sync(self, name: str) -> None:
        self.syncs[name] += 1
        if self.trace:
            frames = [f for f in traceback.extract_stack()[:-2] if f.filename.startswith(_PACKAGE) and
                      not f.filename.endswith("testing/devices.py")]
            where = f"{frames[-1].filename[len(_PACKAGE):]}:{frames[-1].lineno}" if frames else "?"
            self.sync_sites[(name, where)] += 1

    def _check(self, name: str, devs: list, args: tuple) -> None:
        cuda = {d for t, d in devs if d.type == "cuda"}
        if len(cuda) > 1:
            raise DeviceMismatchError(f"{name}: tensors on {', '.join(sorted(map(str, cuda)))} meet in one call")
        if not cuda or name in _COPIES:
            return
        if name in _INDEXING:  # CPU indices into a CUDA tensor are allowed; a CUDA index into a CPU tensor is not
            self_dev = devs[0][1] if devs and devs[0][0] is args[0] else None
            if self_dev is not None and self_dev.type == "cpu" and args[0].dim() > 0:
                raise DeviceMismatchError(f"{name}: a CPU tensor of shape {tuple(args[0].shape)} indexed by a CUDA "
                                          f"tensor")
            advanced = any(isinstance(t, torch.Tensor) for t in tree_flatten(args[1:2])[0])
            if name == "__setitem__" and advanced and isinstance(args[2], torch.Tensor) and \
                    self.device_of(args[2]).type == "cpu" and args[2].dim() > 0:  # basic slices are copy_: allowed
                raise DeviceMismatchError(f"__setitem__: a CPU value of shape {tuple(args[2].shape)} written into "
                                          f"a tensor on {next(iter(cuda))}")
            return
        if name.endswith("_") and not name.startswith("__") and devs and devs[0][0] is args[0] and \
                devs[0][1].type == "cpu" and name not in _COPIES:
            raise DeviceMismatchError(f"{name}: an in-place op writes CUDA values into a CPU tensor of shape "
                                      f"{tuple(args[0].shape)}")
        scalars_ok = name not in _NO_SCALARS  # TensorIterator ops take 0-dim CPU tensors as scalars; these do not
        for t, d in devs:
            if d.type == "cpu" and (t.dim() > 0 or not scalars_ok):
                raise DeviceMismatchError(
                    f"{name}: a CPU tensor of shape {tuple(t.shape)} meets tensors on {next(iter(cuda))} "
                    f"(create it with device=<their device>)")

    def _move(self, func, name: str, args: tuple, kwargs: dict):
        src = args[0]
        here = self.device_of(src)
        rest = list(args[1:])
        if name == "cpu":
            target = CPU
        elif name == "cuda":
            target = as_device(rest[0] if rest else kwargs.pop("device", None) or "cuda")
            rest, kwargs = [], {k: v for k, v in kwargs.items() if k != "device"}
            func = torch.Tensor.to
        elif name == "type_as":
            target = self.device_of(rest[0])
        else:  # to(device?, dtype?, ...) | to(tensor) | to(dtype) | to(device=, dtype=)
            target = here
            if rest and isinstance(rest[0], torch.Tensor):
                target = self.device_of(rest[0])
                rest[0] = rest[0].dtype
            elif rest and _is_device_arg(rest[0]):
                target = as_device(rest[0])
                rest[0] = "cpu"
            if kwargs.get("device") is not None:
                target = as_device(kwargs["device"])
                kwargs["device"] = "cpu"
        if target.type == "cuda" and target.index is not None and target.index >= self.devices:
            raise DeviceMismatchError(f"{name}: {target} does not exist ({self.devices} virtual CUDA devices)")
        if here.type == "cpu" and target.type == "cuda" and not kwargs.get("non_blocking"):
            self.uploads["to cuda"] += 1
        if here.type == "cuda" and target == CPU:
            if kwargs.get("non_blocking"):  # PyTorch pins the destination: the host does not wait (it must not
                self.async_copies["to cpu"] += 1  # read the values before an event says they arrived)
            else:
                self._sync("to cpu")
        out = func(src, *rest, **kwargs) if name != "cpu" else src
        if target != here:
            out = out.clone() if out.untyped_storage().data_ptr() == src.untyped_storage().data_ptr() else out
            self._tag(out, target)
        elif out is not src:
            self._tag(out, target)
        return out



def _uploads_index(args: tuple) -> bool:
    """Whether writing into a CUDA tensor, ``t[args[1]] = args[2]``, copies a host value to the device on the way,
    blocking: a Python scalar written through an integer, list or tensor index (``ok[0] = True``,
    ``rows[:, ids] = -inf``: each counted as a sync by the H200 smoke). A scalar written into basic slices
    (``t[:, :3] = True``) is a fill kernel, and was not counted there."""
    if isinstance(args[2], torch.Tensor):
        return False
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    return any(isinstance(i, (int, list, torch.Tensor)) and not isinstance(i, bool) for i in index)


def count_cuda_syncs(fn: Callable[[], Any], device: torch.device | str, sites: Counter | None = None
                     ) -> tuple[Any, int | None]:
    """(``fn()``, the host syncs it made on a real CUDA device): the ops that ``torch.cuda.set_sync_debug_mode``
    flags (``item``, copies to the CPU, ``nonzero``, ...), counted from its warnings; None on any other device (where
    :class:`VirtualCUDA` counts them instead). ``sites``, if given, counts them by the Python line that made them
    (``file.py:line``). Slows ``fn``: never call it inside a timed region."""
    if torch.device(device).type != "cuda":
        return fn(), None

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = fn()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    if sites is not None:
        sites.update(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    return result, len(syncs)
