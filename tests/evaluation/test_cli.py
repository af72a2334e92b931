"""pardec.evaluate, the `python -m evaluate` entry: runs from another directory, one-line errors with exit status 2,
multirun, a refused resume that leaves the run dir byte for byte."""

from __future__ import annotations

import json

import pytest

from tests.evaluation.helpers import TINY, hashes, run_cli

pytestmark = pytest.mark.slow  # each test starts `python -m evaluate` processes


def test_cli_from_another_directory_and_clear_errors(tmp_path):
    out = tmp_path / "run"
    p = run_cli("+method=jacobi", *TINY, f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "speedup (total time)" in p.stdout and (out / "summary.json").is_file()
    bad = run_cli("+method=jacobi", "model=tiny_random", "dtype=fp8", f"hydra.run.dir={tmp_path / 'bad'}", cwd=tmp_path)
    assert bad.returncode == 2 and "dtype='fp8' is not valid" in bad.stderr
    nomodel = run_cli("+method=ar", "model=local", "model.path=/no/such/dir", f"hydra.run.dir={tmp_path / 'bad3'}",
                   cwd=tmp_path)
    assert nomodel.returncode == 2 and "/no/such/dir" in nomodel.stderr


def test_multirun_gives_one_dir_per_job_and_wandb_offline(tmp_path):
    sweep = tmp_path / "sweep"
    p = run_cli("-m", "+method=ar,pld", "dataset=humaneval", *TINY, "n_samples=1", "logger=wandb",
             f"hydra.sweep.dir={sweep}", cwd=tmp_path,
             env={"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)})
    assert p.returncode == 0, p.stderr[-2000:]
    jobs = sorted(d for d in sweep.iterdir() if (d / "summary.json").is_file())
    assert [json.loads((d / "summary.json").read_text())["method"] for d in jobs] == ["ar", "pld"]
    assert list(jobs[0].glob("wandb/offline-run-*")), "W&B wrote an offline run in the job dir"


def test_cli_refused_resume_leaves_the_run_dir_byte_for_byte(tmp_path):
    out = tmp_path / "run"
    args = ("+method=pld", *TINY, "n_samples=1", f"hydra.run.dir={out}")
    assert run_cli(*args, cwd=tmp_path).returncode == 0
    before = hashes(out)
    assert ".hydra/config.yaml" in before and "run.json" in before
    for extra in (("model.seed=3",), ("model.seed=3", "resume=true")):  # stays refused: test_spec, in process
        p = run_cli(*args, *extra, cwd=tmp_path)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert hashes(out) == before, extra
    assert "model.seed was 0, now 3" in p.stderr


def test_cli_resume_of_a_new_run_dir_is_one_error_line(tmp_path):
    out = tmp_path / "new"
    p = run_cli("+method=pld", *TINY, "n_samples=1", "resume=true", f"hydra.run.dir={out}", cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: resume=true but {out} holds no run"), p.stderr[-2000:]
    assert not (out / "run.json").exists() and not (out / "results.jsonl").exists()


def test_cli_broken_sandbox_is_one_error_line_and_exit_2(tmp_path):
    out = tmp_path / "run"
    p = run_cli("+method=ar", "model=tiny_random", f"hydra.run.dir={out}", cwd=tmp_path,
                env={"PARDEC_SANDBOX": "bwrap", "PATH": "/nonexistent"})  # bwrap required, and not found
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert errors == ["error: sandbox canary failed: PARDEC_SANDBOX=bwrap but bubblewrap cannot run here: bwrap "
                      "not found"], p.stderr[-2000:]
    assert not (out / "results.jsonl").exists()
