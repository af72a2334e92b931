"""pardec.training.checkpoints: every experiment has a stable run dir, checkpoints are marked complete after their
save, and `trainer.resume_from_checkpoint` resumes the newest complete one (a save cut short by a kill is skipped
with a warning; none, or a named incomplete one, is one line naming the dir) before anything loads."""

from __future__ import annotations

import json
import logging
import struct

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from safetensors.torch import save_file

from pardec import CONF_DIR
from pardec.config import ConfigError
from pardec.train import experiments, run
from pardec.training.checkpoints import MARKER, problems, resume_checkpoint, safetensors_problem
from tests.training.test_train_app import _available, _compose


@pytest.mark.parametrize("name", experiments())
def test_every_experiment_has_a_stable_run_dir(name):
    """A relaunch (and `trainer.resume_from_checkpoint=true`) must find the killed run's dir: not a timestamp."""
    if not _available(name):
        pytest.skip(f"experiment {name} names a model/dataset config that does not exist yet")
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=[f"+experiment={name}"])
    run_name = OmegaConf.to_container(cfg, resolve=False)["run_name"]
    assert "${" not in str(run_name) and run_name, f"{name}: run_name={run_name!r}"


def test_safetensors_header_check(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(4, 4), "b": torch.zeros(3)}, str(path))
    assert safetensors_problem(path) is None
    whole = path.read_bytes()
    path.write_bytes(whole[:-5])  # the tensors' data cut short
    assert "is truncated" in safetensors_problem(path)
    path.write_bytes(whole[:20])  # inside the header
    assert "is truncated (header of" in safetensors_problem(path)
    path.write_bytes(whole[:5])
    assert safetensors_problem(path) == "model.safetensors is truncated (5 bytes)"
    path.write_bytes(struct.pack("<Q", 4) + b"{x:1" + whole[8:])
    assert safetensors_problem(path) == "model.safetensors has an unreadable header"


def _medusa(tmp_path, *extra: str) -> list[str]:
    return ["+experiment=heads_medusa_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out",
            "trainer.save_strategy=steps", "trainer.save_steps=1", *extra]


def test_resume_skips_a_checkpoint_cut_short_and_refuses_none(tmp_path, caplog):
    run_dir = tmp_path / "run"
    # no checkpoint-* at all: one line naming the dir, before anything is generated or loaded
    with pytest.raises(ConfigError) as e:
        run(_compose(_medusa(tmp_path, "trainer.resume_from_checkpoint=true")), run_dir)
    msg = str(e.value)
    assert f"the run dir {run_dir} holds no checkpoint-* dir" in msg and "run_name" in msg and "\n" not in msg
    assert not (tmp_path / "data").exists()

    run(_compose(_medusa(tmp_path)), run_dir)  # 2 steps: checkpoint-1, checkpoint-2, each marked after its save
    for step in (1, 2):
        marker = json.loads((run_dir / f"checkpoint-{step}" / MARKER).read_text())
        assert marker["step"] == step and marker["files"]["trainer_state.json"] > 0
        assert marker["files"]["model.safetensors"] == (run_dir / f"checkpoint-{step}" / "model.safetensors").stat().st_size
        assert problems(run_dir / f"checkpoint-{step}") == []

    # a kill during checkpoint-2's save: its weights cut short, no marker
    ckpt2 = run_dir / "checkpoint-2"
    (ckpt2 / MARKER).unlink()
    weights = ckpt2 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ConfigError) as e:  # named explicitly: one line naming what is missing
        run(_compose(_medusa(tmp_path, "stage=train", f"trainer.resume_from_checkpoint={ckpt2}")), run_dir)
    assert str(e.value).startswith(f"trainer.resume_from_checkpoint={ckpt2} is incomplete")
    assert "model.safetensors is truncated" in str(e.value) and "\n" not in str(e.value)

    caplog.set_level(logging.WARNING, logger="pardec.train")
    summary = run(_compose(_medusa(tmp_path, "stage=train", "trainer.max_steps=3",
                                   "trainer.resume_from_checkpoint=true")), run_dir)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "skipping" in r.getMessage()]
    assert len(warnings) == 1 and "checkpoint-2 (model.safetensors is truncated" in warnings[0], warnings
    assert warnings[0].endswith("resuming from checkpoint-1")
    assert summary["train"]["steps"] == 3
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]  # steps 2 and 3 trained again
    assert problems(ckpt2) == []  # saved again (and marked) by the resumed run

    # a checkpoint written without a marker (an older pardec, or a kill between the save and the marker) is accepted
    # when whole; its safetensors cut short, it is not
    ckpt3 = run_dir / "checkpoint-3"
    (ckpt3 / MARKER).unlink()
    assert resume_checkpoint(True, run_dir) == str(ckpt3)
    (ckpt3 / "trainer_state.json").unlink()
    assert problems(ckpt3) == ["trainer_state.json is missing"]
    assert resume_checkpoint(True, run_dir, warn=False) == str(ckpt2)
