"""Decoding a batch of prompts together (``batch_size > 1``): continuous batching over a ragged KV cache.

* :mod:`~pardec.decoding.batch.engine`: the loop (:func:`run_batch`), the per-request state (:class:`Row`), the
  method seam (:class:`BatchedMethod`) and its registry (:data:`BATCHED`, a plug-in point as ``METHODS`` is);
* :mod:`~pardec.decoding.batch.verify`: chain verification of every row's draft in one forward and one host read;
* :mod:`~pardec.decoding.batch.methods`: ``ar``, ``pld``, ``sps`` and ``jacobi`` over a batch;
  :mod:`~pardec.decoding.batch.eagle`: ``eagle3``'s chain; :mod:`~pardec.decoding.batch.dflash`: ``dflash``;
  :mod:`~pardec.decoding.batch.medusa`: ``medusa`` (a tree per row), :mod:`~pardec.decoding.batch.firp`: ``firp``
  (its loop, pseudo states per row); :mod:`~pardec.decoding.batch.lookahead`: ``lookahead`` (a window, a pool
  and a trie of its own shape per row); :mod:`~pardec.decoding.batch.bild`: ``bild``;
  :mod:`~pardec.decoding.batch.sdsat`: ``sdsat`` (chains, sampled nucleus trees);
  :mod:`~pardec.decoding.batch.spectr`: ``spectr`` (``k`` draft rows per request); :mod:`~pardec.decoding.batch.mjsd`: ``mjsd`` and ``mjgd`` (every
  request's beams searched together); :mod:`~pardec.decoding.batch.ouroboros`: ``ouroboros`` (the draft's own
  lookahead per row, a tree of draft and phrases per row).

The cache is :class:`pardec.models.ragged.RaggedModel`: each row its own length, so rows accept different numbers
of draft tokens per round without re-padding the batch, finished rows leave and waiting prompts take their place.
"""

from pardec.decoding.batch import (  # noqa: F401
    bild,
    dflash,
    eagle,
    firp,
    lookahead,
    medusa,
    methods,
    mjsd,
    ouroboros,
    sdsat,
    spectr,
)
from pardec.decoding.batch.engine import BATCHED, BatchedMethod, BatchRun, Row, build_batched, run_batch  # noqa: F401
