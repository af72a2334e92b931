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
    spec = SimpleNamespace(trainer={"bf16": bf16}, deepspeed=None, logger={})
    args = training_args(BaseConfig, spec, tmp_path / "run")
    assert args.bf16 is bf16 and args.device.type == "cpu"
    assert args.use_cpu is bf16  # declared a CPU run only where transformers needs it (bf16); fp32 runs keep its default
