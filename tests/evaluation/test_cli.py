"""pardec.evaluate, the `python -m evaluate` entry: runs from another directory, one-line errors with exit status 2,
multirun, a refused resume that leaves the run dir byte for byte.

A run from another directory and a multirun start real `python -m evaluate` processes; the error paths (but a
broken sandbox: the canary's verdict is kept per process) run their command lines through the same entry (:func:`pardec.evaluate.main`, Hydra and all) one after another in one child
process (:func:`tests.evaluation.helpers.run_cli_in_one_process`), each with its own working directory and
environment, and check the exit status the command would have."""

from __future__ import annotations

import json

import pytest

from tests.evaluation.helpers import TINY, run_cli, run_cli_in_one_process

pytestmark = pytest.mark.slow  # each test starts `python -m evaluate` processes


def test_cli_from_another_directory(tmp_path):
    out = tmp_path / "run"
    p = run_cli("+method=jacobi", *TINY, f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "speedup (total time)" in p.stdout and (out / "summary.json").is_file()


def test_multirun_gives_one_dir_per_job_and_wandb_offline(tmp_path):
    sweep = tmp_path / "sweep"
    p = run_cli("-m", "+method=ar,pld", "dataset=humaneval", *TINY, "n_samples=1", "logger=wandb",
             f"hydra.sweep.dir={sweep}", cwd=tmp_path,
             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    jobs = sorted(d for d in sweep.iterdir() if (d / "summary.json").is_file())
    assert [json.loads((d / "summary.json").read_text())["method"] for d in jobs] == ["ar", "pld"]
    assert list(jobs[0].glob("wandb/offline-run-*")), "W&B wrote an offline run in the job dir"


def test_cli_errors_are_one_line_and_exit_2(tmp_path):
    """Clear errors (a bad value, a missing model dir), a refused resume that leaves the run dir byte for byte, the
    resume of a new run dir: each one line, exit status 2, no traceback."""
    run, new = tmp_path / "run", tmp_path / "new"
    resume = ("+method=pld", *TINY, "n_samples=1", f"hydra.run.dir={run}")
    cases = {
        "bad dtype": {"args": ["+method=jacobi", "model=tiny_random", "dtype=fp8", f"hydra.run.dir={tmp_path / 'bad'}"]},
        "no model": {"args": ["+method=ar", "model=local", "model.path=/no/such/dir",
                              f"hydra.run.dir={tmp_path / 'bad3'}"]},
        "first run": {"args": resume, "hash": run},
        # stays refused: test_spec, in process
        "other seed": {"args": [*resume, "model.seed=3"], "hash": run},
        "other seed, resume": {"args": [*resume, "model.seed=3", "resume=true"], "hash": run},
        "resume new": {"args": ["+method=pld", *TINY, "n_samples=1", "resume=true", f"hydra.run.dir={new}"]},
    }
    got = dict(zip(cases, run_cli_in_one_process([{"cwd": tmp_path, **c} for c in cases.values()]), strict=True))

    def errors(name: str) -> list[str]:
        p = got[name]
        assert p["returncode"] == 2 and "Traceback" not in p["stderr"], (name, p["stderr"][-2000:])
        return [x for x in p["stderr"].splitlines() if x.startswith("error:")]

    assert "dtype='fp8' is not valid" in got["bad dtype"]["stderr"] and errors("bad dtype")
    assert "/no/such/dir" in got["no model"]["stderr"] and errors("no model")

    assert got["first run"]["returncode"] == 0, got["first run"]["stderr"][-2000:]
    before = got["first run"]["hashes"]
    assert ".hydra/config.yaml" in before and "run.json" in before
    for name in ("other seed", "other seed, resume"):
        errors(name)
        assert got[name]["hashes"] == before, name
    assert "model.seed was 0, now 3" in got["other seed, resume"]["stderr"]

    lines = errors("resume new")
    assert len(lines) == 1 and lines[0].startswith(f"error: resume=true but {new} holds no run"), lines
    assert not (new / "run.json").exists() and not (new / "results.jsonl").exists()



def test_cli_broken_sandbox_is_one_error_line_and_exit_2(tmp_path):
    """A process of its own: the sandbox canary's verdict is kept per process."""
    out = tmp_path / "run"
    p = run_cli("+method=ar", "model=tiny_random", f"hydra.run.dir={out}", cwd=tmp_path,
                env={"PARDEC_SANDBOX": "bwrap", "PATH": "/nonexistent"})  # bwrap required, and not found
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert errors == ["error: sandbox canary failed: PARDEC_SANDBOX=bwrap but bubblewrap cannot run here: bwrap "
                      "not found"], p.stderr[-2000:]
    assert not (out / "results.jsonl").exists()


def test_file_system_errors_are_one_line_and_a_full_disk_keeps_the_records(tmp_path):
    """A run dir under a file (ENOTDIR) and a disk that fills after the second record (ENOSPC, injected): each is one
    `error:` line naming the path, exit 2, no traceback; the full disk's records are kept and resume completes them."""
    (tmp_path / "afile").write_text("")
    run_dir = tmp_path / "run"
    args = ["+method=pld", *TINY, "perplexity.enabled=false"]
    prelude = (
        "import errno, os\n"
        "import pardec.evaluation.results as R\n"
        "_append, _n = R.append_jsonl, [0]\n"
        "def append_jsonl(path, recs):\n"
        "    if os.environ.get('FILL_DISK') and _n[0] >= 2:\n"
        "        raise OSError(errno.ENOSPC, 'No space left on device', str(path))\n"
        "    _n[0] += 1\n"
        "    return _append(path, recs)\n"
        "R.append_jsonl = append_jsonl\n")
    cases = [{"cwd": tmp_path, "args": [*args, f"hydra.run.dir={tmp_path}/afile/run"]},
             {"cwd": tmp_path, "args": [*args, f"hydra.run.dir={run_dir}"], "env": {"FILL_DISK": "1"}},
             {"cwd": tmp_path, "args": [*args, f"hydra.run.dir={run_dir}", "resume=true"]}]
    under_file, full, resumed = run_cli_in_one_process(cases, prelude=prelude)
    for r in (under_file, full):
        lines = r["stderr"].strip().splitlines()
        assert r["returncode"] == 2 and "Traceback" not in r["stderr"], r["stderr"][-2000:]
        assert lines[-1].startswith("error: cannot write ")
    assert f"{tmp_path}/afile/run: Not a directory" in under_file["stderr"]
    assert "No space left on device; the records written so far are kept" in full["stderr"]
    assert resumed["returncode"] == 0, resumed["stderr"][-2000:]
    recs = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 6 and len({(r["id"], r["role"]) for r in recs}) == 6  # 3 prompts x 2 roles, none twice
