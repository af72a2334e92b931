"""The shared data stage under several ranks (threads stand in for processes, a threading barrier for the process
group's): every rank returns from :func:`run_stage` only once rank 0's merge is complete, so the draft and drafter
kinds, which load the corpus right after, never read it half written or missing."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from pardec.training import stages


def _stage(out_dir: Path, world: int, merge_delay: float, fail_merge: bool = False):
    items = [stages.Prompt(i, f"p{i}", [i]) for i in range(6)]
    gate = threading.Barrier(world, timeout=30)
    seen: dict[int, object] = {}

    def prepare(rank: int) -> Path:
        out_dir.mkdir(parents=True, exist_ok=True)
        return out_dir

    def merge(out: Path, n: int) -> dict:
        time.sleep(merge_delay)  # a large corpus: the merge outlasts the other ranks' next step
        if fail_merge:
            raise OSError("disk full")
        return stages.merge(out, "merged.jsonl", n, lambda records, kept, expected: {"records": len(records)})

    def rank_main(rank: int) -> None:
        try:
            stages.run_stage(items, out_dir, prepare, rank, world, gate.wait, 2,
                             lambda batch: [{"id": p.id, "index": p.index} for p in batch], f"r{rank}", None, merge)
            merged = out_dir / "merged.jsonl"  # what a kind reads right after the stage
            seen[rank] = [json.loads(line)["id"] for line in merged.read_text().splitlines()] if merged.is_file() \
                else "missing"
        except Exception as e:  # noqa: BLE001  (reported per rank)
            seen[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return seen


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_returns_after_rank0_merged(tmp_path, world):
    seen = _stage(tmp_path / "stage", world, merge_delay=0.5)
    assert all(seen[r] == [f"p{i}" for i in range(6)] for r in range(world)), seen


def test_a_failed_merge_releases_the_other_ranks(tmp_path):
    """Rank 0's merge fails: it raises there, and the other ranks are not left waiting; they find no merged file."""
    seen = _stage(tmp_path / "stage", 2, merge_delay=0.0, fail_merge=True)
    assert isinstance(seen[0], OSError) and seen[1] == "missing"


def test_the_data_stage_group_waits_long_and_training_gets_ddp_timeout(monkeypatch):
    """The process group a data stage creates carries training too: it gets the trainer's ``ddp_timeout`` (not
    torch's 10-minute NCCL default), and the stage's barriers wait in a gloo group with pardec's long timeout."""
    import datetime

    import torch.distributed as dist

    from pardec.config import SYNC_TIMEOUT, ConfigError, launch
    from pardec.training import base

    calls: list = []
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(calls))
    monkeypatch.setattr(dist, "init_process_group", lambda backend, timeout: calls.append(("init", backend, timeout)))
    monkeypatch.setattr(dist, "new_group", lambda backend, timeout: calls.append(("group", backend, timeout)) or "g")
    monkeypatch.setattr(dist, "barrier", lambda group=None: calls.append(("barrier", group)))
    monkeypatch.setattr(launch, "_WAIT_GROUP", [])
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    d = base.ranks_for({"ddp_timeout": 7200})
    assert (d.rank, d.world, d.timeout_s) == (1, 2, 7200.0)
    d.barrier()()
    d.barrier()()  # the wait group is made once
    assert calls == [("init", "gloo", datetime.timedelta(seconds=7200)), ("group", "gloo", SYNC_TIMEOUT),
                     ("barrier", "g"), ("barrier", "g")]
    assert base.ranks_for({}).timeout_s == base.DDP_TIMEOUT == 1800
    with pytest.raises(ConfigError, match="ddp_timeout=0"):
        base.ranks_for({"ddp_timeout": 0})
