"""pardec: parallel and speculative decoding for LLMs."""

from pathlib import Path

from omegaconf import OmegaConf

__version__ = "0.1.0"

#: repository root (``conf/``, ``data/``, ``outputs/`` live here in an editable install)
REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
DATA_DIR = REPO_ROOT / "data"


def on_cuda() -> bool:
    """Whether this process will run on a CUDA GPU (the GPU defaults below follow it)."""
    import torch  # heavy: torch

    return torch.cuda.is_available()


def default_dtype() -> str:
    """The run dtype when none is given: bf16 on a CUDA GPU (what the papers ran), fp32 on the CPU (where bf16
    matmuls are emulated or slow, and exactness tests need fp32)."""
    return "bf16" if on_cuda() else "fp32"


def _register_resolvers() -> None:
    for name, fn in {"pardec_root": lambda: str(REPO_ROOT), "pardec_default_dtype": default_dtype,
                     "pardec_on_cuda": on_cuda}.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


_register_resolvers()
