"""A :class:`~tests.decoding.stubs.TableLM` that honours ``logits_at``, for the n-gram methods' lookahead forward
(which reads the tree's nodes and the window's top level only). Shared by test_lookahead and test_ouroboros."""

from __future__ import annotations

from pardec.models.cached import ForwardOut
from tests.decoding.stubs import TableLM


class ChainLM(TableLM):
    def forward(self, ids, positions=None, attend=None, key_valid=None, last_only=False, logits_at=None,
                hidden_layer=None) -> ForwardOut:
        out = super().forward(ids, positions, attend, key_valid, last_only, None, hidden_layer)
        return ForwardOut(out.logits[:, logits_at]) if logits_at is not None else out
