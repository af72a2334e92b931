"""Shared fixtures: tiny random Llamas (2 layers, hidden 64) built in code, with SmolLM2's tokenizer cut to its first
8,192 ids (``model.vocab``)."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import warnings

import pytest
import torch

from pardec.config import ModelConfig
from pardec.models.loading import LoadedModel, load_model


def pytest_configure(config):
    """The run's shared directory (tests/shared.py), made by the controlling process before its workers start (they
    inherit the variable); a worker, or a run that was given one, keeps it."""
    from tests.shared import ENV

    if not hasattr(config, "workerinput") and not os.environ.get(ENV):
        os.environ[ENV] = tempfile.mkdtemp(prefix="pardec-tests-")
        config._pardec_shared = os.environ[ENV]
    # a host without bubblewrap: the suite's own programs may be scored by the guard alone (the tests that need
    # bwrap skip themselves)
    if not os.environ.get("PARDEC_SANDBOX"):
        from pardec.metrics.sandbox import isolation

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if not isolation().startswith("bwrap"):
                os.environ["PARDEC_SANDBOX"] = "guard"
        isolation.cache_clear()


def pytest_unconfigure(config):
    shared = getattr(config, "_pardec_shared", None)
    if shared:
        shutil.rmtree(shared, ignore_errors=True)


#: the tiny models' vocabulary: SmolLM2's tokenizer cut to its first ids (``model.vocab``)
VOCAB = ModelConfig().vocab


@functools.cache
def tiny(seed: int = 0, dtype: str = "fp32", layers: int = 2) -> LoadedModel:
    """A tiny random Llama, built once per process and shared by every test that asks for it: built outside inference
    mode even when the first caller runs inside it, so that a later test may train through its weights (autograd
    refuses inference tensors)."""
    with torch.inference_mode(False):
        return load_model(ModelConfig(name="tiny_random", source="tiny_random", seed=seed, dtype=dtype, layers=layers))


#: torch threads per test: the machine's two cores, or one each when pytest-xdist runs two workers (``-n 2``)
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(THREADS)
    yield


def prompt_ids(tok, text: str) -> list[int]:
    return tok(text)["input_ids"]


@functools.cache
def noisy(seed: int = 0, scale: float = 0.3, noise_seed: int = 123) -> torch.nn.Module:
    """A copy of ``tiny(seed)`` with Gaussian noise (``scale`` x each tensor's std) on every weight: a draft
    that agrees with the target often but not always."""
    import copy

    with torch.inference_mode(False):  # shared as tiny() is
        model = copy.deepcopy(tiny(seed).model)
        g = torch.Generator().manual_seed(noise_seed)
        with torch.no_grad():
            for w in model.parameters():
                std = float(w.std()) if w.numel() > 1 else 0.0
                w.add_(torch.randn(w.shape, generator=g) * std * scale)
    return model


def draft_for(kind: str, seed: int = 0):
    """A draft CachedModel for ``tiny(seed)``: ``self`` (the target's own weights: every greedy draft token is
    accepted), ``noisy`` (a perturbed copy: partial acceptance), ``random`` (another random model)."""
    from pardec.models.cached import CachedModel

    if kind == "self":
        return CachedModel(tiny(seed).model, name="draft:self")
    if kind == "noisy":
        return CachedModel(noisy(seed), name="draft:noisy")
    if kind == "random":
        return CachedModel(tiny(seed + 7).model, name="draft:random")
    raise ValueError(kind)
