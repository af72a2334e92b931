"""A process's place in a multi-process launch (torchrun, deepspeed, accelerate), from the launcher's environment:
:class:`Ranks` (rank, world size, local rank, and the barrier the training stages wait at), :func:`shared_launch_id`
(the run dir every rank of one launch shares), :func:`launcher_argv` (the deepspeed launcher's ``--local_rank``)."""

from __future__ import annotations

import datetime
import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pardec.config.checks import ConfigError

#: how long a rank waits for the others at a wait that lasts as long as the slowest rank's share of some work (the
#: end of an evaluation, a data stage's merge): ranks finish their shares hours apart; a rank that dies is the
#: launcher's business (torchrun stops the others), not this timeout's
SYNC_TIMEOUT = datetime.timedelta(hours=48)

#: the gloo group :meth:`Ranks.barrier` waits in (created once per process, by every rank in the same order)
_WAIT_GROUP: list = []


@dataclass(frozen=True)
class Ranks:
    """This process's place in a launch (torchrun, deepspeed, accelerate) from its environment: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``; none set = one process. ``timeout_s``: the timeout of the process group
    :meth:`barrier` creates, which also carries training (the trainer's ``ddp_timeout``:
    :func:`pardec.training.base.ranks_for`); None: torch's default."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    timeout_s: float | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, timeout_s: float | None = None) -> Ranks:
        env = os.environ if env is None else env
        try:
            rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
            local = int(env.get("LOCAL_RANK", 0))
        except ValueError:
            raise ConfigError(f"RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}, LOCAL_RANK="
                              f"{env.get('LOCAL_RANK')!r} from the launcher are not all integers") from None
        if world < 1 or not 0 <= rank < world:
            raise ConfigError(f"RANK={rank} and WORLD_SIZE={world} from the launcher do not fit (0 <= RANK < WORLD_SIZE)")
        return cls(rank, world, local, timeout_s)

    @property
    def multi(self) -> bool:
        return self.world > 1

    def share(self, docs: list) -> list[tuple[int, Any]]:
        """(index, document) of this rank's documents: index % world == rank (index: position in the run's list)."""
        return [(i, d) for i, d in enumerate(docs) if i % self.world == self.rank]

    def barrier(self) -> Callable[[], None] | None:
        """A barrier over all ranks (the training stages'), or None for one process. The first call creates the
        process group (NCCL on CUDA, after picking the rank's GPU; else gloo) with ``timeout_s``, and a gloo group
        that only waits, with the long :data:`SYNC_TIMEOUT`: a data stage's ranks finish their shares hours apart,
        and rank 0 then merges the whole corpus, while the others wait."""
        if self.world == 1:
            return None
        import torch  # heavy: torch
        import torch.distributed as dist  # heavy: torch

        if not dist.is_initialized():
            cuda = torch.cuda.is_available()
            if cuda:
                torch.cuda.set_device(self.local_rank)
            timeout = None if self.timeout_s is None else datetime.timedelta(seconds=self.timeout_s)
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout)
        if not _WAIT_GROUP:
            _WAIT_GROUP.append(dist.new_group(backend="gloo", timeout=SYNC_TIMEOUT))
        return functools.partial(dist.barrier, group=_WAIT_GROUP[0])


def shared_launch_id(env=None) -> str | None:
    """A name every process of one multi-process launch computes alike, for their shared run dir: torchrun's
    ``torchrun-<run id>`` (``--standalone`` makes it unique), or under the ``deepspeed`` launcher on one node
    ``deepspeed-<launcher pid>-<port>`` (every rank is a child of the same launch process); None where the launch
    gives no such id (several nodes under ``deepspeed``: pass the run dir)."""
    env = os.environ if env is None else env
    run_id = env.get("TORCHELASTIC_RUN_ID", "none")
    if run_id not in ("", "none"):
        return f"torchrun-{run_id[:8]}"
    if env.get("CROSS_SIZE") == "1" and env.get("MASTER_PORT"):  # the deepspeed launcher, one node
        return f"deepspeed-{os.getppid()}-{env['MASTER_PORT']}"
    return None


def launcher_argv(argv: list[str]) -> list[str]:
    """``argv`` without the ``--local_rank=N`` (or ``--local_rank N``) that the ``deepspeed`` launcher appends to the
    program's arguments (Hydra would refuse it); the rank goes to ``LOCAL_RANK`` when the launcher did not set it."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--local_rank" and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 2
            continue
        if arg.startswith("--local_rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        else:
            out.append(arg)
        i += 1
    return out


