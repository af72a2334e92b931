"""Untrained drafters for exercising the decoders that need one (``python -m pardec.bench gpu-smoke``,
``scripts/host_reads.py``, tests)."""

from __future__ import annotations

from pathlib import Path


def untrained_drafters(model, work: Path) -> tuple[object, dict[str, dict]]:
    """Drafters for every method that needs one, untrained, for ``model`` (a Llama-style target): (a draft model:
    the target's first and last layers over its whole vocabulary, method parameters per method): Medusa heads and
    FIRP projections saved under ``work`` with a chain tree, an EAGLE-3 drafter over the whole vocabulary, a one-layer
    DFlash drafter with blocks of 8; SDSAT's
    adaptive token stands in as the last vocabulary id. They exercise the decoders (exactness, devices, host reads), not their speed."""
    from pardec.decoding.tree_search import save_tree  # heavy: torch, transformers
    from pardec.models.draft import build_draft  # heavy: torch, transformers
    from pardec.models.drafters import new_drafter, save_drafter  # heavy: torch, transformers

    n = model.config.num_hidden_layers
    draft = build_draft(model, sorted({0, n - 1}), list(range(model.config.vocab_size)))
    params: dict[str, dict] = {"sdsat": {"adaptive_ids": [int(model.config.vocab_size) - 1]}}
    params["eagle3"] = {"path": str(save_drafter(new_drafter("eagle3", model.config, lm_head=model.lm_head),
                                                work / "eagle3", model.config, "smoke"))}
    dflash = new_drafter("dflash", model.config, embed=model.get_input_embeddings(), lm_head=model.lm_head,
                         dflash={"num_layers": 1, "block_size": 8})
    params["dflash"] = {"path": str(save_drafter(dflash, work / "dflash", model.config, "smoke"))}
    for kind, methods in (("medusa", ("medusa", "medusa_typical")), ("firp", ("firp",))):
        d = (new_drafter("medusa", model.config, num_heads=3, lm_head=model.lm_head) if kind == "medusa"
             else new_drafter("firp", model.config, layers=[n // 2, n // 2, n - 1]))
        out = save_drafter(d, work / kind, model.config, "smoke")
        save_tree(out / "trees" / "chain.json", "chain", [[0], [0, 0], [0, 0, 0]])
        for m in methods:
            params[m] = {"path": str(out), "tree": "chain"}
    return draft, params
