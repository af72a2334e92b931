"""Evaluation over several processes: ``torchrun --nproc_per_node N -m evaluate ...`` (or ``accelerate launch``).

* :class:`Ranks`: this process's rank, world size and local rank, from the launcher's environment (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``); none set = one process, which runs exactly as without a launcher;
* rank r takes the documents with index % world == r (:meth:`Ranks.share`, the rule of the training stages) and
  appends its records to its own part file ``results.rank{r}-of-{w}.jsonl`` (:func:`~pardec.evaluation.results
  .part_path`), resumed on its own; its model sits on its own device (``model.device=auto`` ->
  ``cuda:LOCAL_RANK``; with ``model.device_map`` the rank's own group of GPUs, its draft on the group's first:
  :func:`pardec.models.placement.rank_devices`);
* :func:`start` / :func:`gather` / :func:`finish`: the process group (only when ``WORLD_SIZE`` > 1). It carries no
  tensors, only the final wait: every rank hands rank 0 what it ran on (:func:`rank_info`), which returns when all
  ranks are done; rank 0 then merges the part files and writes the summary;
* :func:`launch_name`: the run dir's last component, identical on every rank of one launch.

The group uses the gloo backend on CPUs and GPUs alike: it only waits and passes a few small Python objects, so it
needs no GPU memory (NCCL's communicators take some of what the timed runs measure), no GPU of its own per rank (two
ranks may share one GPU, a rank may spread one model over several with ``model.device_map``, a CPU model may run on
a GPU machine) and no NCCL watchdog over a wait that lasts as long as the slowest rank's share.
"""

from __future__ import annotations

import os
import resource
import socket
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from pardec.config import SYNC_TIMEOUT, ConfigError, Ranks, shared_launch_id
from pardec.models.placement import resolve_device


def launch_name(stamp: str, env: Mapping[str, str] | None = None) -> str:
    """The run dir's last component: ``stamp`` (Hydra's timestamp) for one process; under several,
    ``torchrun-<first 8 characters of TORCHELASTIC_RUN_ID>``, which torchrun gives every worker of one launch
    (``--standalone`` makes it unique), so that all ranks write into one directory (their timestamps differ by the
    second each rank started at)."""
    env = os.environ if env is None else env
    if Ranks.from_env(env).world == 1:
        return stamp
    name = shared_launch_id(env)
    if name is None:
        raise ConfigError(launch_error(Ranks.from_env(env).world))
    return name


def launch_error(world: int) -> str:
    return (f"{world} processes need one shared run dir: pass hydra.run.dir=<dir> (or launch with `torchrun "
            f"--standalone` or `deepspeed` on one node, which give every rank the same launch id)")


def check_launch(argv: list[str], env: Mapping[str, str] | None = None) -> None:
    """Before Hydra starts: several processes without a shared run id must name their run dir on the command line
    (else each would make its own), one line instead of an error inside Hydra's config resolution."""
    env = os.environ if env is None else env
    ranks = Ranks.from_env(env)
    if ranks.multi and shared_launch_id(env) is None and not any(
            a.lstrip("+").startswith(("hydra.run.dir=", "hydra.sweep.dir=")) for a in argv):
        raise ConfigError(launch_error(ranks.world))


def start(ranks: Ranks, device="auto") -> bool:
    """Join the process group (gloo, see the module's docstring) when there are several ranks and none exists yet;
    returns whether this call created it (then :func:`finish` ends it). Before anything touches CUDA, the rank's GPU
    (``model.device`` resolved, :func:`pardec.models.placement.resolve_device`) becomes its current device, so that
    its CUDA context and any tensor made on "cuda" land there, not on GPU 0."""
    if not ranks.multi:
        return False

    gpu = resolve_device(str(device))  # (the spec's resolved device: pardec.models.placement.rank_devices)
    if gpu.type == "cuda" and gpu.index is not None:
        torch.cuda.set_device(gpu)

    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", timeout=SYNC_TIMEOUT)
    return True


def gather(ranks: Ranks, obj: Any) -> list[Any]:
    """``obj`` of every rank, by rank; returns only when every rank has called it (the end-of-run wait)."""
    if not ranks.multi:
        return [obj]

    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def finish(created: bool) -> None:
    if created:
        dist.destroy_process_group()


def model_devices(model) -> str:
    """The devices a model's weights are on, e.g. ``cuda:3``, ``cpu``, or ``cuda:0,cuda:1`` (``model.device_map``)."""
    devices = {str(p.device) for p in model.parameters()}
    return ",".join(sorted(devices)) or "cpu"


def record_place(ranks: Ranks, device: str) -> dict[str, Any]:
    """What each record of several ranks carries about where it was made (``rank``, ``host``, ``device``); nothing
    for one process (its records are as they always were)."""
    return {"rank": ranks.rank, "host": socket.gethostname(), "device": device} if ranks.multi else {}


def rank_info(ranks: Ranks, device: str) -> dict[str, Any]:
    """What the summary's ``ranks`` lists for this process (peak memory is read at the end of the run)."""
    info: dict[str, Any] = {"rank": ranks.rank, "local_rank": ranks.local_rank, "host": socket.gethostname(),
                            "device": device,
                            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available() and "cuda" in device:
        info["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return info


def combined_energy(statuses: list[dict], hosts: list[str]) -> dict[str, Any]:
    """Every rank's energy meter ``status()`` as one: measured where every rank measured; reasons and counters per
    rank (one line when all say the same); a note when ranks share a host, whose CPU package counters (RAPL) every
    rank's windows read in full."""
    def joined(key: str) -> str | None:
        vals = [s.get(key) for s in statuses]
        if len(set(vals)) == 1:
            return vals[0]
        return "; ".join(f"rank {r}: {v}" for r, v in enumerate(vals) if v) or None

    measured = all(s.get("measured") for s in statuses)
    reason = joined("reason")
    shared = sorted({h for h in hosts if hosts.count(h) > 1})
    if measured and shared and any("RAPL" in (s.get("devices") or "") for s in statuses):
        note = (f"{len(hosts)} ranks on {', '.join(shared)}: each window reads the whole CPU package counters "
                f"(RAPL), which count every rank's work")
        reason = f"{reason}; {note}" if reason else note
    return {"measured": measured, "reason": reason, "devices": joined("devices") or ""}
