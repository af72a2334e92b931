"""The SDSAT adaptive-token contract (Liu et al. 2024): what ``python -m train +experiment=sdsat_*`` writes into a
model and the ``sdsat`` decoder reads.

Adaptive tokens are special tokens added to the tokenizer (one, ``<|sdsat_adaptive|>``; diverse SDSAT-D: one per
offset, ``<|sdsat_adaptive_1|>`` .. ``<|sdsat_adaptive_L|>``). :func:`attach_adaptive` gives a model their
embedding rows (the mean of the ordinary tokens' rows) and records them in ``model.config.sdsat``, which
``save_pretrained`` writes into ``config.json`` and the decoder reads (:func:`adaptive_of`, :func:`adaptive_ids_of`)::

    {"schema_version": 1, "adaptive_tokens": [...], "adaptive_ids": [...], "max_span": L, "diverse": bool}
"""

from __future__ import annotations

from typing import Any

import torch

ADAPTIVE_TOKEN = "<|sdsat_adaptive|>"
SDSAT_SCHEMA_VERSION = 1  # of model.config.sdsat


def adaptive_tokens(max_span: int, diverse: bool) -> list[str]:
    """The adaptive token strings: one shared token, or (diverse) one per offset 1..``max_span``."""
    if max_span < 1:
        raise ValueError(f"max_span={max_span!r} is out of range: it must be an integer >= 1")
    return [f"<|sdsat_adaptive_{j}|>" for j in range(1, max_span + 1)] if diverse else [ADAPTIVE_TOKEN]


def add_adaptive_tokens(tokenizer, tokens: list[str]) -> list[int]:
    """Add ``tokens`` as extra special tokens (those already present keep their ids); their ids, in order."""
    known = set(tokenizer.get_vocab())
    new = [t for t in tokens if t not in known]
    if new:
        tokenizer.add_special_tokens({"extra_special_tokens": new}, replace_extra_special_tokens=False)
    return list(tokenizer.convert_tokens_to_ids(list(tokens)))


def attach_adaptive(model, tokenizer, tokens: list[str], max_span: int, diverse: bool) -> list[int]:
    """Add ``tokens`` to ``tokenizer`` and give ``model`` their embedding rows; returns their ids. Idempotent.

    The embeddings grow to ``len(tokenizer)`` (never shrink: a padded vocabulary keeps its rows); the rows of the
    adaptive ids, in the input embeddings and (untied) the output head, are set to the mean of the rows below the
    first adaptive id (the ordinary tokens). ``model.config.sdsat`` records tokens, ids, max_span and diverse."""
    want = max_span if diverse else 1
    if len(tokens) != want:
        raise ValueError(f"{'diverse' if diverse else 'identical'} adaptive tokens with max_span={max_span} need "
                         f"{want} token(s); got {len(tokens)}: {tokens}")
    ids = add_adaptive_tokens(tokenizer, tokens)
    sdsat = {"schema_version": SDSAT_SCHEMA_VERSION, "adaptive_tokens": list(tokens), "adaptive_ids": ids,
             "max_span": max_span, "diverse": diverse}
    old = adaptive_of(model.config)
    rows = model.get_input_embeddings().weight.shape[0]
    if old == sdsat and rows > max(ids):
        return ids  # attached before (e.g. a saved SDSAT model with its tokenizer)
    if old is not None:
        raise ValueError(f"the model already carries other SDSAT adaptive tokens ({old['adaptive_tokens']} at ids "
                         f"{old['adaptive_ids']}); cannot attach {tokens} at ids {ids}")
    if len(tokenizer) > rows:
        model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    _mean_rows(model.get_input_embeddings(), ids)
    head = model.get_output_embeddings()
    if head is not None and head.weight is not model.get_input_embeddings().weight:
        _mean_rows(head, ids)
    model.config.sdsat = sdsat
    return ids


@torch.no_grad()
def _mean_rows(module: torch.nn.Module, ids: list[int]) -> None:
    """Rows ``ids`` of an embedding / head weight [V, H] (and bias [V]) := the mean over rows [0, min(ids))."""
    k = min(ids)
    for p in (module.weight, getattr(module, "bias", None)):
        if p is not None:
            p[ids] = p[:k].float().mean(0).to(p.dtype)


def adaptive_of(config) -> dict | None:
    """The ``sdsat`` dict of an HF config (or a ``config.json`` dict); None if it has none."""
    sdsat = config.get("sdsat") if isinstance(config, dict) else getattr(config, "sdsat", None)
    if sdsat is None:
        return None
    if sdsat.get("schema_version") != SDSAT_SCHEMA_VERSION:
        raise ValueError(f"config.sdsat: schema_version {sdsat.get('schema_version')!r}, this pardec reads "
                         f"{SDSAT_SCHEMA_VERSION}; train the adaptive tokens again")
    return dict(sdsat)


def adaptive_ids_of(config: Any) -> list[int] | None:
    """The adaptive token ids an SDSAT-trained model's config (an HF config or a config.json dict) records."""
    sd = adaptive_of(config)
    return [int(i) for i in sd["adaptive_ids"]] if sd and sd.get("adaptive_ids") else None
