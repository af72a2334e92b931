"""``python -m pardec.testing.virtual_gpus [--devices N] <evaluate|train> [overrides ...]``: a pardec app run as on a
machine with ``N`` CUDA devices, on the CPU: the whole run under :class:`~pardec.testing.VirtualCUDA` (tensors that
say they live on ``cuda:<i>``; a CPU tensor meeting a CUDA one fails as on a GPU) with the CUDA graphs of
``forward_impl=cudagraph`` captured by the eager stand-in (:func:`~pardec.testing.graphs.eager_cuda_graphs`). So
``model.device=cuda`` and ``forward_impl=auto`` take the path a GPU user's run takes: the model placed on its rank's
device, the forward ``auto`` picks there (``cudagraph``; ``hf`` for a target split with ``model.device_map``).
Under ``torchrun --nproc_per_node R`` every rank sees the same ``N`` virtual devices and takes its own, as it would
on the node. The rehearsal (:mod:`pardec.rehearse`) runs the evaluation recipes this way. Host reads of virtual CUDA
tensors and the graphs captured are counted and printed at the end (``virtual-gpus: ... host reads, ...``) on
stderr."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from pardec.testing.devices import VirtualCUDA

APPS = ("evaluate", "train")


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pardec.testing.virtual_gpus", description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1, help="virtual CUDA devices this node has (default 1)")
    ap.add_argument("--memory", type=int, default=80 << 30,
                    help="bytes each device says it has free, what model.device_map=auto plans with (default 80 GiB)")
    ap.add_argument("app", choices=APPS, help="the pardec app to run: " + ", ".join(APPS))
    ap.add_argument("overrides", nargs=argparse.REMAINDER, help="the app's overrides")
    a = ap.parse_args(argv)
    if a.devices < 1:
        ap.error(f"--devices={a.devices}: a node has at least one device")
    if a.memory < 1:
        ap.error(f"--memory={a.memory}: a device has some memory (bytes)")

    # transformers loads weights in worker threads, which a torch function mode (thread-local) would not see
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"

    from pardec.testing.graphs import EagerGraph, eager_cuda_graphs  # heavy: transformers

    app = importlib.import_module(f"pardec.{a.app}")
    sys.argv = [a.app, *a.overrides]
    vc = VirtualCUDA(devices=a.devices, memory=a.memory)
    EagerGraph.captures = 0
    try:
        with vc, eager_cuda_graphs():
            app.main()
    finally:
        print(f"virtual-gpus: {a.devices} device(s), {sum(vc.syncs.values())} host reads, "
              f"{sum(vc.uploads.values())} uploads, {EagerGraph.captures} CUDA graphs captured", file=sys.stderr)


if __name__ == "__main__":
    main()
