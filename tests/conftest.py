"""Shared fixtures: tiny random Llamas (2 layers, hidden 64) with SmolLM2's real tokenizer, built in code."""

from __future__ import annotations

import functools

import pytest
import torch

from pardec.config import ModelConfig
from pardec.models.loading import LoadedModel, load_model


@functools.cache
def tiny(seed: int = 0, dtype: str = "fp32", layers: int = 2) -> LoadedModel:
    return load_model(ModelConfig(name="tiny_random", source="tiny_random", seed=seed, dtype=dtype, layers=layers))


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)
    yield


def prompt_ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]
