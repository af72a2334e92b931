"""trainer.gradient_checkpointing is pardec's key on every supported transformers release: on 5.24+, where
TrainingArguments renamed the field activation_checkpointing (the old name warns and goes in v6), the value lands
in the new field without a deprecation warning."""

from __future__ import annotations

import warnings

import pytest

from pardec.training.base import BaseConfig


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
