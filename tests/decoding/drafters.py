"""Saved drafters (Medusa heads, FIRP projections) for tiny test models: randomly perturbed around their
initialisation (so their drafts are sometimes, not always, right) plus a branching tree file ``T``."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from pardec.decoding.tree_search import save_tree
from pardec.models.heads import new_drafter, save_drafter

TREE_T = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
KEYS = {"medusa": "heads", "medusa_typical": "heads", "firp": "projections"}
_ROOT = Path(tempfile.mkdtemp(prefix="pardec-drafters-"))
_MADE: dict[tuple[int, str], Path] = {}


def drafter_dir(model, kind: str, k: int = 3, seed: int = 0) -> Path:
    """A drafter of ``kind`` (medusa | firp) for ``model``, saved once per model."""
    key = (id(model), kind)
    if key not in _MADE:
        cfg = model.config
        n = cfg.num_hidden_layers
        if kind == "medusa":
            d = new_drafter("medusa", cfg, num_heads=k, lm_head=model.lm_head)
        else:
            d = new_drafter("firp", cfg, layers=sorted(min(n - 1, i * n // (k + 1)) for i in range(1, k + 1)))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in d.parameters():
                if p.dim() == 2 and p.shape[0] == p.shape[1]:
                    p.add_(torch.randn(p.shape, generator=g) * 0.05)
        out = save_drafter(d, _ROOT / f"{kind}-{len(_MADE)}", cfg, "tiny")
        save_tree(out / "trees" / "T.json", "T", TREE_T)
        _MADE[key] = out
    return _MADE[key]


def drafter_params(method: str, model, tree: str = "T") -> dict:
    """The method parameters naming a drafter for ``model`` (sdsat: a stand-in adaptive id; {} for methods without
    one)."""
    if method == "sdsat":  # a tiny random model has no trained adaptive token: its last id stands in for one
        return {"adaptive_ids": [int(model.config.vocab_size) - 1]}
    if method not in KEYS:
        return {}
    return {KEYS[method]: str(drafter_dir(model, "firp" if method == "firp" else "medusa")), "tree": tree}
