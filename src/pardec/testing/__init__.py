"""Testing utilities shipped with pardec but used by no library module: :class:`VirtualCUDA` (device handling on a
CPU: tensors that say they live on CUDA, host reads counted with their call sites), CUDA graphs replayed by an eager
stand-in (:mod:`pardec.testing.graphs`), a whole run as on a GPU node (``python -m pardec.testing.virtual_gpus``,
which the rehearsal launches) and untrained drafters for every method that needs one. Tests, ``python -m pardec.bench
gpu-smoke``, the rehearsal and ``scripts/`` use them."""

from pardec.testing.devices import VirtualCUDA, count_cuda_syncs
from pardec.testing.drafters import untrained_drafters

__all__ = ["VirtualCUDA", "count_cuda_syncs", "untrained_drafters"]
