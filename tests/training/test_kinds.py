"""The experiment kinds' registry, the old spellings refused naming the new ones, and the trainer section's type checks:
all before anything loads."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from omegaconf import open_dict

from pardec import REPO_ROOT
from pardec.config import ConfigError
from pardec.registry import UnknownNameError
from pardec.train import check_old_spellings, validate
from pardec.training.kinds import load_kinds
from tests.training.test_train_app import _compose


def test_kinds_registry_names_every_kind_and_suggests():
    kinds = load_kinds()
    assert kinds.names() == ["cllm", "draft", "drafter", "sdsat"]
    assert all(kinds.get(k).name == k for k in kinds.names())
    cfg = _compose(["+experiment=cllm_tiny"])
    with open_dict(cfg):
        cfg.kind = "clm"
    with pytest.raises(UnknownNameError, match=r"unknown experiment kind 'clm'. Did you mean 'cllm'\? Valid experiment "
                                               r"kinds: cllm, draft, drafter, sdsat"):
        validate(cfg)


@pytest.mark.parametrize("arg, new", [
    ("+experiment=medusa_tiny", "+experiment=heads_medusa_tiny"),
    ("trainer=distill", "trainer=draft"),
    ("distill.loss=ce", "trainer.loss=ce"),
    ("heads.type=firp", "drafter.type=firp"),
    ("+heads.layers=[1]", "+drafter.layers=[1]"),
    ("distill.sources.0.max_prompts=3", "completions.sources.0.max_prompts=3"),
])
def test_old_spellings_are_refused_naming_the_new_one(arg, new):
    with pytest.raises(ConfigError, match=re.escape(f"`{arg}` is an old spelling: write `{new}`")) as e:
        check_old_spellings(["stage=train", arg, "seed=1"])
    assert "\n" not in str(e.value)
    check_old_spellings(["+experiment=heads_firp_tiny", "trainer=draft", "drafter.type=firp", "stage=train"])


@pytest.mark.parametrize("old, moved", [("heads", "`heads` -> `drafter`"),
                                        ("distill", "`distill.loss` -> `trainer.loss`, `distill` -> `completions`")])
def test_old_sections_in_an_experiment_file_are_refused(old, moved):
    cfg = _compose(["+experiment=heads_firp_tiny"])
    with open_dict(cfg):  # an experiment written before the rename: a heads / distill section
        cfg[old] = {"type": "firp", "layers": [1, 2]} if old == "heads" else dict(cfg.completions)
    with pytest.raises(ConfigError, match=re.escape(f"experiment 'heads_firp_tiny' has a `{old}:` section, an old "
                                                    f"spelling: rename it ({moved})")):
        validate(cfg)


@pytest.mark.parametrize("override, pattern", [
    ("trainer.learning_rate=abc", "trainer.learning_rate='abc' must be float"),
    ("trainer.max_steps=1.5", "trainer.max_steps=1.5 must be int"),
    ("trainer.bf16=maybe", "trainer.bf16='maybe' must be bool"),
    ("trainer.lr_scheduler_type=[1]", r"trainer.lr_scheduler_type=\[1\] must be SchedulerType or str"),
    ("trainer.states_per_sample=x", "trainer.states_per_sample='x' must be int"),
])
def test_trainer_values_are_type_checked(override, pattern):
    with pytest.raises(ConfigError, match=pattern) as e:
        validate(_compose(["+experiment=cllm_tiny", override]))
    assert "\n" not in str(e.value)


@pytest.mark.slow
def test_cli_old_name_and_bad_trainer_value_end_in_one_line(tmp_path):
    """The defect: `trainer.learning_rate=abc` ended in a TypeError traceback. Now: one error line, exit 2, before any
    model loads (the deepspeed launcher's `--local_rank` ignored); an old experiment name likewise, naming the new."""
    for experiment, error in (
            ("heads_medusa_tiny", "error: trainer.learning_rate='abc' must be float"),
            ("medusa_tiny", "error: `+experiment=medusa_tiny` is an old spelling: write `+experiment=heads_medusa_tiny`")):
        p = subprocess.run([sys.executable, "-m", "train", f"+experiment={experiment}", "trainer.learning_rate=abc",
                            f"paths.output_dir={tmp_path}/out", f"paths.data_dir={tmp_path}/data",
                            "--local_rank=0"],  # as the deepspeed launcher appends it
                           capture_output=True, text=True, cwd=REPO_ROOT, timeout=300)
        assert p.returncode == 2, p.stderr
        lines = [x for x in p.stderr.splitlines() if x.strip()]
        assert lines == [error] and "Traceback" not in p.stderr
        assert not (tmp_path / "data").exists()


def test_one_process_without_a_launcher_gets_a_launchers_environment(monkeypatch):
    """`python -m train ... trainer.deepspeed=zero2` on one GPU without torchrun: DeepSpeed fell back to MPI
    discovery (ModuleNotFoundError: mpi4py). training_args now sets rank 0 of 1 on a free local port first."""
    import os

    from pardec.training.base import single_process_env

    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in keys})  # restored after
    single_process_env()
    assert (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]) == ("0", "0", "1")
    assert os.environ["MASTER_ADDR"] == "127.0.0.1" and 0 < int(os.environ["MASTER_PORT"]) < 65536
    monkeypatch.setenv("WORLD_SIZE", "2")  # under a launcher nothing changes
    monkeypatch.setenv("RANK", "1")
    single_process_env()
    assert os.environ["RANK"] == "1"
