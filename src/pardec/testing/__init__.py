"""Testing utilities shipped with pardec but used by no library module: :class:`VirtualCUDA` (device handling on a
CPU: tensors that say they live on CUDA, host reads counted with their call sites) and untrained drafters for every
method that needs one. Tests, ``python -m pardec.bench gpu-smoke`` and ``scripts/`` use them."""

from pardec.testing.devices import VirtualCUDA, count_cuda_syncs
from pardec.testing.drafters import untrained_drafters

__all__ = ["VirtualCUDA", "count_cuda_syncs", "untrained_drafters"]
