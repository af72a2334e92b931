"""Decoders. Importing this package registers every built-in method in :data:`METHODS`."""

from pardec.decoding import ar, hf_generate, jacobi, lookahead, ouroboros, pld, sps  # noqa: F401
from pardec.decoding.base import (  # noqa: F401
    METHODS,
    Decoder,
    GenerationResult,
    Stopper,
    build_decoder,
    register_method,
)
