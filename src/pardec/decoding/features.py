"""What the decoders of hidden-state drafters (``eagle3``, ``dflash``) share: a prefill that keeps the target's
features, the hidden states entering the layers the drafter reads, at every prompt position."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pardec.decoding.base import DraftClock


def feature_prefill(target, layers) -> tuple[Callable[[torch.Tensor], torch.Tensor], dict]:
    """(``prefill(ids)``: the target reset and run over the prompt, its last position's logits returned; a dict whose
    ``"features"`` it fills with the hidden states entering ``layers`` [T, len(layers) * H]) for
    :meth:`~pardec.decoding.base.Decoder.begin`."""
    box: dict = {}

    def prefill(ids: torch.Tensor) -> torch.Tensor:
        target.reset()
        out = target.forward(ids, last_only=True, hidden_layer=layers)
        box["features"] = out.hidden[0]
        return out.logits[:, -1]

    return prefill, box


def begin_with_features(decoder, prompt_ids, max_new_tokens: int, stop, sampling):
    """A hidden-state drafter's generation set up: the draft clock reset, the prompt prefilled by the target keeping
    the features of ``decoder.layers`` (:func:`feature_prefill`), :meth:`~pardec.decoding.base.Decoder.begin`'s
    state. Returns (state, the last token, the prompt's features [T, len(layers) * H])."""
    prefill, box = feature_prefill(decoder.target, decoder.layers)
    decoder.clock = DraftClock()
    st, last = decoder.begin(prompt_ids, max_new_tokens, stop, sampling, prefill)
    return st, last, box.pop("features")
