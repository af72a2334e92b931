"""The Hugging Face hub, before anything is downloaded: is it switched off (which env var), can it be reached.

Models (:func:`pardec.models.preflight.check_available`) and datasets (:func:`pardec.tasks.base.load_hub`) ask
here first, so that a run without the hub fails in seconds with one line instead of retrying for half a minute.
"""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

from huggingface_hub import constants

#: env vars that switch the hub off for models (transformers, huggingface_hub)
MODEL_OFFLINE_VARS = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
#: ... and for datasets (``datasets`` reads HF_DATASETS_OFFLINE, else HF_HUB_OFFLINE)
DATASET_OFFLINE_VARS = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")


def _is_set(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def offline_var(names: tuple[str, ...] = MODEL_OFFLINE_VARS) -> str | None:
    """The first of ``names`` set to a true value in the environment (read now, not at import), or None."""
    return next((k for k in names if _is_set(os.environ.get(k))), None)


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the hub endpoint (or the HTTPS proxy in front of it) accepts a TCP connection within ``timeout``
    seconds, name lookup included (run in a thread, so a hanging resolver cannot block longer)."""
    proxy = os.environ.get("HTTPS_PROXY") or os.environ.get("https_proxy")
    url = urlparse(proxy or constants.ENDPOINT)
    host, port = url.hostname, url.port or (443 if url.scheme == "https" else 80)
    ok: list[bool] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout).close()
            ok.append(True)
        except OSError:  # refused, unreachable, unknown host: all mean "not reachable"
            ok.append(False)

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout + 0.5)
    return bool(ok and ok[0])
