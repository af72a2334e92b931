"""Decoders. Importing this package registers every built-in method in :data:`METHODS`."""

from pardec.decoding import (  # noqa: F401
    ar,
    bild,
    dflash,
    eagle,
    heads,
    hf_generate,
    jacobi,
    lookahead,
    mjsd,
    ouroboros,
    pld,
    sdsat,
    spectr,
    sps,
)
from pardec.decoding.base import (  # noqa: F401
    METHODS,
    Decoder,
    GenerationResult,
    Stopper,
    build_decoder,
    register_method,
)
