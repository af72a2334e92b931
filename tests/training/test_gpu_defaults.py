"""GPU defaults: bf16 runs, mixed precision and TF32 on a CUDA machine, fp32 on the CPU; frozen teachers in the run's
dtype (issue 23). CUDA is simulated by patching ``torch.cuda.is_available`` where the configs are composed."""

from __future__ import annotations

import pytest
import torch

from tests.training.test_train_app import _compose


@pytest.mark.parametrize("cuda", [True, False])
@pytest.mark.parametrize("experiment", ["draft_tiny", "heads_medusa_tiny", "cllm_tiny", "sdsat_tiny"])
def test_training_defaults_follow_the_device(monkeypatch, experiment, cuda):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    cfg = _compose([f"+experiment={experiment}"])
    assert cfg.dtype == ("bf16" if cuda else "fp32") and cfg.model.dtype == cfg.dtype
    assert cfg.trainer.bf16 is cuda and cfg.tf32 is True
    if experiment.startswith("heads"):  # the frozen base runs in the run's dtype
        assert cfg.trainer.model_dtype == cfg.dtype
    if experiment.startswith("draft"):  # the student's weights stay fp32 (the teacher follows dtype, see below)
        assert cfg.trainer.model_dtype == "fp32"


@pytest.mark.parametrize("cuda", [True, False])
def test_evaluation_defaults_follow_the_device(monkeypatch, cuda):
    from hydra import compose, initialize_config_dir

    from pardec import CONF_DIR

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["+method=ar"])
    assert cfg.dtype == ("bf16" if cuda else "fp32") and cfg.model.dtype == cfg.dtype and cfg.tf32 is True
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        assert compose("evaluate", overrides=["+method=ar", "dtype=fp32"]).model.dtype == "fp32"


def test_draft_teacher_runs_in_the_run_dtype_and_tf32_is_set(tmp_path, monkeypatch):
    """With dtype=bf16 the frozen teacher is bf16 (and loaded so) while the student trains in fp32 (model_dtype);
    ``tf32`` reaches torch's backend flags."""
    import pardec.training.draft.trainer as draft_trainer
    from pardec.train import run

    seen = {}

    def fake_fit(trainer, spec, run_dir, d, finish):
        seen.update(teacher=trainer.teacher.dtype, student=next(trainer.model.parameters()).dtype)
        return {}

    monkeypatch.setattr(draft_trainer, "fit", fake_fit)
    import pardec.models.loading as loading

    loads = []
    real_load = loading.load_model
    monkeypatch.setattr(draft_trainer, "load_model", lambda cfg, *a: loads.append(cfg.dtype) or real_load(cfg, *a))
    base = ["+experiment=draft_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out",
            "dtype=bf16", "threads=1"]
    run_dir = tmp_path / "run"
    run(_compose([*base, "stage=generate"]), run_dir)
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        run(_compose([*base, "stage=train", "tf32=false"]), run_dir)
        assert torch.backends.cuda.matmul.allow_tf32 is False
        run(_compose([*base, "stage=train"]), run_dir)
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert seen == {"teacher": torch.bfloat16, "student": torch.float32}
    assert loads[-2:] == ["bf16", "bf16"]  # the target is loaded once per train stage, in the teacher's dtype: at 7B
    # a bf16 copy on each rank's host, not an fp32 one (27 GB x 8 ranks)


@pytest.mark.parametrize("experiment", ["cllm_gsm8k", "cllm_spider", "cllm_code", "sdsat_codellama7b"])
def test_the_7b_recipes_checkpoint_activations(experiment):
    assert _compose([f"+experiment={experiment}"]).trainer.gradient_checkpointing is True


@pytest.mark.slow
@pytest.mark.parametrize("experiment", ["cllm_tiny", "sdsat_tiny"])
def test_gradient_checkpointing_gives_the_same_losses(tmp_path, experiment):
    """The packed CLLM layout (custom 4D masks) and SDSAT's two halves train identically with activations
    recomputed in backward."""
    import json

    from pardec.train import run

    losses = []
    for gc in ("false", "true"):
        run_dir = tmp_path / gc
        run(_compose([f"+experiment={experiment}", f"paths.data_dir={tmp_path}/data",
                      f"paths.output_dir={tmp_path}/out", "threads=1", f"trainer.gradient_checkpointing={gc}"]),
            run_dir)
        history = json.loads((run_dir / "log_history.json").read_text())
        losses.append([h["loss"] for h in history if "loss" in h])
    assert losses[0] and losses[1] == pytest.approx(losses[0], rel=1e-4)
