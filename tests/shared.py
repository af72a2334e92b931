"""Expensive test artefacts made once per test run and shared by the pytest-xdist workers: fitted drafters, exact
joint distributions. ``tests/conftest.py`` gives the run one directory (``PARDEC_TEST_SHARED``, made by the
controlling process, removed when the run ends); :func:`once` makes an entry there the first time any worker asks,
under a file lock, and every later ask (in any worker) reads it."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from filelock import FileLock

ENV = "PARDEC_TEST_SHARED"
_LOCAL: Path | None = None  # a process's own directory when no run directory was given (a test module run by hand)


def shared_dir() -> Path:
    global _LOCAL
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    if _LOCAL is None:
        _LOCAL = Path(tempfile.mkdtemp(prefix="pardec-tests-"))
    return _LOCAL


def once(key: str, make: Callable[[Path], None]) -> Path:
    """``<shared dir>/<key>``, made by ``make(directory)`` the first time any worker of the run asks for it; it appears
    whole (made under a temporary name, then renamed), so a reader never sees a half-written entry."""
    root = shared_dir()
    out = root / key
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{key}.lock")):
        if not out.exists():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key}-"))
            try:
                make(tmp)
                tmp.rename(out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out


def fingerprint(model: torch.nn.Module) -> str | None:
    """A digest of a model's config, module types, parameter and buffer names, shapes and values: equal for two loads
    of the same tiny model in different workers (pardec's int8 linears keep their weights in buffers). None for a
    model with torch.ao modules, whose packed weights are neither: those are not shared."""
    if any(type(m).__module__.startswith("torch.ao") for m in model.modules()):
        return None
    h = hashlib.sha256(model.config.to_json_string(use_diff=False).encode())
    h.update(" ".join(f"{n}:{type(m).__module__}.{type(m).__qualname__}" for n, m in model.named_modules()).encode())
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
