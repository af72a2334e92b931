"""pardec.evaluation.ranks and the part files: ranks from the launcher's environment, the shared run dir, the merge,
a resume with another number of processes refused; then `torchrun --nproc_per_node 2 -m evaluate` on CPU: the
records of one process, and one rank killed and resumed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pardec import REPO_ROOT
from pardec.config import ConfigError
from pardec.evaluation import Ranks, check_resume, merge_parts, part_path, run
from pardec.evaluation.ranks import check_launch, combined_energy, launch_name
from tests.evaluation.helpers import TINY, cfg_of, lines

#: what differs between two runs of the same records: the clock, the energy counters and where a record was made
PLACE_AND_TIME = ("wall_s", "prefill_s", "draft_s", "energy_j", "energy_by_device", "rank", "host", "device",
                  "others_cores", "steal_cores", "busy")  # the busy-host reading is of the host, as the timing
#: a greedy fp32 run with three roles (baseline ar, method pld, also jacobi), 3 prompts: 2 on rank 0, 1 on rank 1
ARGS = ("+method=pld", *TINY, "threads=1", "bench.warmup=1", "bench.warmup_tokens=4",
        'bench.also=["jacobi:block_size=4"]')


def _without(recs: list[dict], keys=PLACE_AND_TIME) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in keys} for r in recs]


# ------------------------------------------------------------------------------------------ in process
def test_ranks_come_from_the_launchers_environment():
    assert Ranks.from_env({}) == Ranks(0, 1, 0) and not Ranks.from_env({}).multi
    r = Ranks.from_env({"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1"})
    assert r.multi and [i for i, _ in r.share([{"id": str(k)} for k in range(8)])] == [1, 4, 7]
    with pytest.raises(ConfigError, match="RANK=3 and WORLD_SIZE=2"):
        Ranks.from_env({"RANK": "3", "WORLD_SIZE": "2"})
    # one run dir for every rank of a launch; a timestamp for one process
    assert launch_name("2026-01-01_00-00-00", {}) == "2026-01-01_00-00-00"
    two = {"RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "0123456789abcdef"}
    assert launch_name("2026-01-01_00-00-00", two) == "torchrun-01234567"
    no_id = {**two, "TORCHELASTIC_RUN_ID": "none"}
    with pytest.raises(ConfigError, match="2 processes need one shared run dir: pass hydra.run.dir"):
        check_launch(["+method=ar"], no_id)
    check_launch(["+method=ar", "hydra.run.dir=/x"], no_id)
    check_launch(["+method=ar"], two)


def test_merge_orders_by_document_then_repeat_then_role_and_is_idempotent(tmp_path):
    from pardec.jsonl import append_jsonl

    def rec(doc, role, rank, rep=0):
        return {"id": doc, "role": role, "repeat": rep, "rank": rank}

    # rank 0 has documents a, c; rank 1 has b (and wrote its baseline twice: the first one counts)
    append_jsonl(part_path(tmp_path, 0, 2), [rec("c", "method", 0), rec("a", "baseline", 0), rec("a", "method", 0),
                                             rec("c", "baseline", 0)])
    append_jsonl(part_path(tmp_path, 1, 2), [rec("b", "baseline", 1), rec("b", "method", 1),
                                             {**rec("b", "baseline", 1), "dup": True}])
    order = {"a": 0, "b": 1, "c": 2}
    roles = {"baseline": 0, "method": 1}

    def key(x):
        return order[x["id"]], x["repeat"], roles[x["role"]]

    merged = merge_parts(tmp_path, 2, key)
    assert [(x["id"], x["role"]) for x in merged] == [("a", "baseline"), ("a", "method"), ("b", "baseline"),
                                                      ("b", "method"), ("c", "baseline"), ("c", "method")]
    assert not any("dup" in x for x in merged)
    first = (tmp_path / "results.jsonl").read_bytes()
    assert merge_parts(tmp_path, 2, key) == merged and (tmp_path / "results.jsonl").read_bytes() == first
    assert part_path(tmp_path, 0, 1) == tmp_path / "results.jsonl"  # one process: the log is the results file
    part_path(tmp_path, 1, 2).unlink()  # a rank without documents never made its part file
    assert [x["id"] for x in merge_parts(tmp_path, 2, key)] == ["a", "a", "c", "c"]


def test_resume_with_another_number_of_processes_is_refused(tmp_path):
    from pardec.evaluation import run_identity, validate
    from pardec.jsonl import append_jsonl

    spec = validate(cfg_of("+method=pld", *TINY))
    (tmp_path / "run.json").write_text(json.dumps(run_identity(spec, 2)))
    append_jsonl(part_path(tmp_path, 1, 2), [{"id": "x", "role": "baseline", "repeat": 0}])
    check_resume(tmp_path, json.loads(json.dumps(run_identity(spec, 2))))  # same world: accepted
    with pytest.raises(ConfigError) as e:
        check_resume(tmp_path, run_identity(spec, 1))
    msg = str(e.value)
    assert "world_size was 2, now 1" in msg and "torchrun --nproc_per_node 2" in msg and "\n" not in msg
    # a run.json written before world_size was recorded came from one process
    old = {k: v for k, v in run_identity(spec, 1).items() if k != "world_size"}
    (tmp_path / "run.json").write_text(json.dumps(old))
    check_resume(tmp_path, run_identity(spec, 1))
    with pytest.raises(ConfigError, match="world_size was 1, now 4"):
        check_resume(tmp_path, run_identity(spec, 4))


def test_energy_of_several_ranks_is_one_status():
    off = {"measured": False, "reason": "no counter", "devices": ""}
    assert combined_energy([off, off], ["a", "b"]) == off
    on = [{"measured": True, "reason": None, "devices": "gpu0 (NVML), cpu0 (RAPL package)"},
          {"measured": True, "reason": None, "devices": "gpu1 (NVML), cpu0 (RAPL package)"}]
    e = combined_energy(on, ["h", "h"])
    assert e["measured"] and e["devices"] == "rank 0: gpu0 (NVML), cpu0 (RAPL package); rank 1: gpu1 (NVML), cpu0 " \
                                            "(RAPL package)"
    assert "RAPL" in e["reason"] and "h" in e["reason"]  # both ranks' windows read the one package's counters
    assert combined_energy(on, ["h", "g"])["reason"] is None
    assert not combined_energy([on[0], off], ["h", "g"])["measured"]


# ------------------------------------------------------------------------------------------ torchrun, 2 CPU ranks
def _torchrun(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):  # this pytest is no rank of anything
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "evaluate",
           *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[Path, str]:
    """One 2-rank run (shared by the tests below, which copy it before changing anything)."""
    out = tmp_path_factory.mktemp("torchrun") / "run"
    proc = _torchrun(out.parent, *ARGS, f"hydra.run.dir={out}")
    return out, proc.stdout


@pytest.mark.slow
def test_two_ranks_give_the_records_of_one_process(two_ranks, tmp_path):
    out, stdout = two_ranks
    run(cfg_of(*ARGS), tmp_path / "one")
    one, two = lines(tmp_path / "one"), lines(out)
    assert len(two) == 9 and _without(two) == _without(one)  # same records, same order, timing aside
    ids = [r["id"] for r in two[::3]]  # document order (three roles each)
    assert all(r["rank"] == ids.index(r["id"]) % 2 for r in two)  # rank r ran the documents with index % 2 == r
    assert all(r["device"] == "cpu" and r["host"] for r in two) and not any("rank" in r for r in one)
    parts = [json.loads(x) for p in (0, 1) for x in part_path(out, p, 2).read_text().splitlines()]
    assert len(parts) == 9 and sorted(json.dumps(x, sort_keys=True) for x in parts) == sorted(
        json.dumps(x, sort_keys=True) for x in two)
    s = json.loads((out / "summary.json").read_text())
    assert s["world_size"] == 2 and [(x["rank"], x["device"], x["records"]) for x in s["ranks"]] == [
        (0, "cpu", 6), (1, "cpu", 3)]
    assert all(x["host"] and x["peak_rss_mb"] > 0 for x in s["ranks"])
    s1 = json.loads((tmp_path / "one" / "summary.json").read_text())
    assert "ranks" not in s1 and s["n_samples"] == s1["n_samples"] == 3
    assert s["exact_match_rate"] == s1["exact_match_rate"] == 1.0
    assert s["peers"]["also:jacobi:block_size=4"]["tokens_per_forward"] == s1["peers"]["also:jacobi:block_size=4"][
        "tokens_per_forward"]
    assert json.loads((out / "run.json").read_text())["world_size"] == 2
    assert (out / ".hydra").is_dir() and (out / "evaluate-rank1.log").is_file()
    assert stdout.count("speedup (total time)") == 1  # rank 0 alone prints the table


@pytest.mark.slow
def test_a_killed_rank_resumes_its_own_part(two_ranks, tmp_path):
    src, _ = two_ranks
    out = tmp_path / "run"
    shutil.copytree(src, out)
    full = lines(out)
    part0, part1 = part_path(out, 0, 2), part_path(out, 1, 2)
    keep0 = part0.read_bytes()
    raw = part1.read_text().splitlines(keepends=True)
    assert len(raw) == 3
    part1.write_text(raw[0] + raw[1][: len(raw[1]) // 2])  # rank 1 killed while writing its second record
    (out / "results.jsonl").unlink()  # ... before rank 0 merged
    (out / "summary.json").unlink()
    _torchrun(tmp_path, *ARGS, f"hydra.run.dir={out}", "resume=true")
    assert part0.read_bytes() == keep0  # rank 0 had finished: nothing redone
    again = part1.read_text().splitlines(keepends=True)
    assert len(again) == 3 and again[0] == raw[0]  # rank 1 redid only what the kill lost
    merged = lines(out)
    assert len({(r["id"], r["role"], r["repeat"]) for r in merged}) == len(merged) == 9
    assert _without(merged) == _without(full)
    assert json.loads((out / "summary.json").read_text())["n_samples"] == 3
