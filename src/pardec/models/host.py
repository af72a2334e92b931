"""The host fingerprint: what a figure was measured on (CPU model, vector flags, cores, threads, torch, GPU) and the
key that files measured on one machine are stored under. Imports no model code: every layer may use it."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch

#: the CPU flags that change which GEMM kernels run (recorded with every figure)
VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16",
                "amx_int8")


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the platform's processor string."""
    info = Path("/proc/cpuinfo")
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags() -> list[str]:
    """Which of :data:`VECTOR_FLAGS` this CPU has."""
    info = Path("/proc/cpuinfo")
    have: set[str] = set()
    if info.is_file():
        for line in info.read_text().splitlines():
            if line.startswith("flags"):
                have = set(line.split(":", 1)[1].split())
                break
    return [f for f in VECTOR_FLAGS if f in have]


def machine(device: torch.device | str = "cpu") -> dict:
    """What a figure was measured on: CPU model, vector flags, cores, threads, torch; the GPU's name on CUDA."""
    out = {"cpu": cpu_model(), "flags": cpu_flags(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
           "torch": torch.__version__}
    if torch.device(device).type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def describe(m: dict) -> str:
    """One line for a table caption: ``AMD EPYC (avx2 fma), 2 cores, 2 threads, torch 2.13.0``."""
    gpu = f"{m['gpu']}; " if m.get("gpu") else ""
    return (f"{gpu}{m['cpu']} ({' '.join(m['flags']) or 'no AVX2'}), {m['cores']} cores, {m['threads']} threads, "
            f"torch {m['torch']}")


def machine_key(m: dict | None = None) -> str:
    m = m or machine()
    blob = json.dumps({k: m.get(k) for k in ("cpu", "flags", "threads", "torch", "gpu")}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]
