"""trainer.gradient_checkpointing is pardec's key on every supported transformers release: on 5.24+, where
TrainingArguments renamed the field activation_checkpointing (the old name warns and goes in v6), the value lands
in the new field without a deprecation warning. trainer.bf16 on a machine without a GPU is bf16 autocast on the
CPU, not transformers' "doesn't support bf16/gpu" error."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from pardec.training.base import BaseConfig, training_args


@pytest.mark.parametrize("on", [True, False])
def test_gradient_checkpointing_reaches_the_current_field_without_a_warning(tmp_path, on):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        args = BaseConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=on,
                          gradient_checkpointing_kwargs={"use_reentrant": False} if on else None)
    assert args.gradient_checkpointing is on  # what pardec's trainers read
    if hasattr(args, "activation_checkpointing"):
        assert args.activation_checkpointing is on
        assert args.activation_checkpointing_kwargs == ({"use_reentrant": False} if on else None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs bf16 on itself")
@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_without_a_gpu_trains_on_the_cpu_in_autocast(tmp_path, bf16):
    spec = SimpleNamespace(trainer={"bf16": bf16}, deepspeed=None, logger={}, device="auto")
    args = training_args(BaseConfig, spec, tmp_path / "run")
    assert args.bf16 is bf16 and args.device.type == "cpu"
    assert args.use_cpu is bf16  # declared a CPU run only where transformers needs it (bf16); fp32 runs keep its default


def test_min_lr_reaches_a_deepspeed_run_as_the_same_rate():
    """Under DeepSpeed, ``lr_scheduler_kwargs.min_lr`` becomes ``min_lr_rate`` (transformers would read
    ``optimizer.defaults``, which the ZeRO optimizer lacks): 5e-5 -> 1e-5 is a rate of 0.2."""
    from pardec.training.base import with_min_lr_rate

    out = with_min_lr_rate({"learning_rate": 5e-5, "lr_scheduler_type": "cosine_with_min_lr",
                            "lr_scheduler_kwargs": {"min_lr": 1e-5}})
    assert out["lr_scheduler_kwargs"] == {"min_lr_rate": pytest.approx(0.2)}
    plain = {"learning_rate": 1e-4, "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}
    assert with_min_lr_rate(plain) is plain and with_min_lr_rate({}) == {}


def test_a_gpu_recipe_rehearsed_on_the_cpu_is_declared_a_cpu_run(tmp_path):
    """``device=cpu`` (a GPU recipe run here): the Trainer is told so (``use_cpu``), bf16 or not."""
    for bf16 in (True, False):
        spec = SimpleNamespace(trainer={"bf16": bf16}, deepspeed=None, logger={}, device="cpu")
        args = training_args(BaseConfig, spec, tmp_path / "run")
        assert args.use_cpu is True and args.device.type == "cpu"
