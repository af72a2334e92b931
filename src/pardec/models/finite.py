"""NaN/inf in a model's logits raise :class:`NonFiniteLogitsError` naming the model and the position, instead of
decoding garbage (:class:`~pardec.models.cached.CachedModel`'s forwards, the batch cache's
:class:`~pardec.models.ragged.RaggedModel`).

On the CPU the check runs at once (the forward raises). On an accelerator it costs no host sync in the forward: a
device-side flag per forward is copied to the host asynchronously and read when the model is next used (or by
:meth:`FiniteCheck.pending`); by then the caller has read the logits, so the read waits for nothing. The error then
comes one call later, before that call computes anything (a token decoded from bad logits is never run through the
model)."""

from __future__ import annotations

import torch


class NonFiniteLogitsError(RuntimeError):
    """A model produced NaN or inf logits; the message names the model and the position."""


class FiniteCheck:
    """The checks of one model's forwards: :meth:`check` after each, :meth:`pending` before the model is used."""

    def __init__(self) -> None:
        #: per forward on an accelerator, not yet read: (finite [B, T'] on the device, all-finite flag, the event
        #: after its copy to the host (CUDA) or None, (name, past, t, last_only, kept))
        self._unchecked: list[tuple] = []

    def pending(self) -> None:
        """Raise if an earlier forward's logits held NaN/inf. Reads flags the device already copied to the host."""
        pending, self._unchecked = self._unchecked, []
        for finite, ok, done, where in pending:
            if done is not None:
                done.synchronize()
            if not bool(ok):
                _raise(finite, *where, late=True)

    def check(self, logits: torch.Tensor, name: str, past: int | list[int], t: int, last_only: bool, kept) -> None:
        """NaN/inf in ``logits`` [B, T', V] of model ``name`` (``past``: the cached positions before the forward, or
        each row's; ``t`` new ones; ``kept``: the positions whose logits these are) raise: at once on the CPU; on an
        accelerator when the model is next used (a flag copied to the host without a sync)."""
        where = (name, past, t, last_only, kept)
        if logits.device.type == "cpu":
            # one reduction: min and max are finite only when every value is (NaN propagates through both); on the
            # CPU ~8x cheaper than isfinite + all over a large vocabulary (~130 us a row at 49k tokens)
            if not bool(torch.isfinite(torch.stack(torch.aminmax(logits))).all()):
                _raise(torch.isfinite(logits).all(-1), *where)
            return
        finite = torch.isfinite(logits).all(-1)  # [B, T']
        ok, done = finite.all(), None
        if ok.device.type == "cuda":
            ok = ok.to("cpu", non_blocking=True)  # into pinned memory; ``done`` says when it has arrived
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(finite.device))
        self._unchecked.append((finite, ok, done, where))


def _raise(finite: torch.Tensor, name: str, past: int | list[int], t: int, last_only: bool, kept,
           late: bool = False) -> None:
    b, j = (int(x) for x in (~finite).nonzero()[0])
    new = t - 1 if last_only else int(kept[j]) if isinstance(kept, torch.Tensor) else j
    before = past[b] if isinstance(past, list) else past
    raise NonFiniteLogitsError(
        f"model {name!r} produced non-finite logits (NaN/inf) at position {before + new} "
        f"(row {b}, new token {new} of {t}, cache length {before})"
        + (" in an earlier forward (found when the model was next used)" if late else ""))
