"""Shared by the oracle tests of the n-gram methods (test_lookahead, test_ouroboros), and one torch thread for the
distribution tests."""

from __future__ import annotations

import pytest
import torch

from pardec.models.cached import CachedModel
from tests.conftest import tiny


class TracksOutput:
    """Mixin for oracle decoders: ``self.out_tokens`` is the committed output, live (the oracle's index into the
    true continuation)."""

    def begin(self, *a, **kw):
        st, last = super().begin(*a, **kw)
        self.out_tokens = st.out.tokens
        return st, last


@pytest.fixture(scope="module")
def setup():
    """(tiny model, its CachedModel, a short code prompt's ids)."""
    lm = tiny(0)
    return lm, CachedModel(lm.model), lm.tokenizer("def fibonacci(n):\n    return")["input_ids"]


@pytest.fixture
def one_thread():
    """One torch thread: 16-token forwards (the distribution tests) gain nothing from two, and on a busy machine two
    threads' waits for each other multiply the run time (tens of times for ouroboros' many small forwards)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
