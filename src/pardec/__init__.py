"""pardec: parallel and speculative decoding for LLMs."""

from pathlib import Path

__version__ = "0.1.0"

#: repository root (``conf/``, ``data/``, ``outputs/`` live here in an editable install)
REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"
DATA_DIR = REPO_ROOT / "data"


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("pardec_root"):
        OmegaConf.register_new_resolver("pardec_root", lambda: str(REPO_ROOT))


_register_resolvers()
