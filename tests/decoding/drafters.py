"""Saved drafters for tiny test models: Medusa heads and FIRP projections randomly perturbed around their
initialisation (so their drafts are sometimes, not always, right) plus a branching tree file ``T``; an EAGLE-3
drafter fitted in seconds to the target's own greedy continuations (:func:`fit_eagle3`), so that its drafts are
often right on those contexts and rarely elsewhere; likewise a DFlash drafter (:func:`fit_dflash`)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from pardec.decoding.tree_search import save_tree
from pardec.models.drafters import new_drafter, save_drafter
from tests.shared import fingerprint, once

TREE_T = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
KEYS = {"medusa": "path", "medusa_typical": "path", "firp": "path", "eagle3": "path", "dflash": "path"}
_ROOT = Path(tempfile.mkdtemp(prefix="pardec-drafters-"))
_MADE: dict[tuple[int, str], Path] = {}


def fit_eagle3(model, sequences: list[list[int]], steps: int = 80, unroll: int = 3, lr: float = 3e-3,
               seed: int = 0):
    """An EAGLE-3 drafter for ``model`` over the tokens of ``sequences`` (its draft vocabulary), fitted with Adam in
    seconds to the target's argmax after each position (hard labels), unrolled ``unroll`` steps on its own outputs
    by the training-time test of :mod:`pardec.training.drafter.eagle`. Enough for drafts that are often right on those
    contexts and rarely elsewhere."""
    from pardec.models.cached import CachedModel
    from pardec.models.eagle import new_eagle3
    from pardec.models.vocab import DraftVocab
    from pardec.training.drafter.eagle import shift_left, ttt_unroll
    from pardec.training.drafter.target import TargetPass

    vocab = DraftVocab(sorted({t for s in sequences for t in s}), int(model.config.vocab_size))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = getattr(model.lm_head, "weight", None)  # (an int8 head has no float weight: a random start)
        d = new_eagle3(model.config, vocab, lm_head=head if head is not None and head.is_floating_point() else None)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences])
    valid = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences], dtype=torch.bool)
    # the features through pardec's capture (transformers' output_hidden_states would leave its recording hooks on
    # the shared test model), cloned out of inference mode for the draft's backward
    cm = CachedModel(model)
    out = cm.forward(ids, hidden_layer=tuple(d.config.layer_ids))
    with torch.no_grad():
        target = TargetPass(out.hidden.clone(), out.logits.clone(), model.model.embed_tokens(ids))
    index = torch.full((int(model.config.vocab_size),), -1, dtype=torch.long)
    index[vocab.ids] = torch.arange(len(vocab))
    argmax = index[target.logits.argmax(-1)]  # [B, T]: the target's argmax after each position, as a draft id
    opt = torch.optim.Adam(d.parameters(), lr=lr)
    for _ in range(steps):
        loss = 0.0
        for i, out in enumerate(ttt_unroll(d, d.fuse(target.features), target.emb, unroll)):
            label = shift_left(argmax, i + 1)  # step i at anchor t: the target's argmax at t + 1 + i
            label = label.masked_fill(~(shift_left(valid, i + 1) & (label >= 0)), -100)
            loss = loss + 0.8**i * torch.nn.functional.cross_entropy(d.logits(out).reshape(-1, len(vocab)),
                                                                     label.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return d.eval()


def fit_dflash(model, sequences: list[list[int]], steps: int = 30, lr: float = 1e-2, seed: int = 0,
               prompt_len: int = 1, **options):
    """A DFlash drafter for ``model`` (2 layers, blocks of 4 unless ``options`` say otherwise) fitted with Adam in
    seconds by :func:`pardec.training.drafter.dflash.block_terms` (CE, the paper's decay) on the tokens of
    ``sequences`` after their first ``prompt_len`` (every position an anchor), which are the target's own
    continuations: its drafts are often right on those contexts and rarely elsewhere. (30 steps at lr 1e-2 accept
    as deep on the tiny models as 120 at 3e-3, in a quarter of the time: every step's CE spans the whole
    vocabulary.)"""
    from pardec.models.cached import CachedModel
    from pardec.models.drafters import new_drafter
    from pardec.training.drafter.dflash import anchor_candidates, block_terms
    from pardec.training.drafter.target import TargetPass

    options = {"num_layers": 2, "block_size": 4, **options}
    # frozen float copies of the target's head and embedding: the shared test model gets no gradients (and an int8
    # head, which has no backward, is fitted through its float equivalent)
    with torch.no_grad():
        eye = torch.eye(int(model.config.hidden_size))
        head = torch.nn.Linear(eye.shape[0], int(model.config.vocab_size), bias=False).requires_grad_(False)
        head.weight.copy_(model.lm_head(eye).T.float())
        embed = torch.nn.Embedding.from_pretrained(model.model.embed_tokens.weight.detach().clone().float())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        d = new_drafter("dflash", model.config, embed=embed, lm_head=head, dflash=options)
    width = max(len(s) for s in sequences)
    ids = torch.tensor([s + [s[-1]] * (width - len(s)) for s in sequences])
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    for i, s in enumerate(sequences):
        mask[i, prompt_len - 1 : len(s) - 1] = True  # x_{j+1} is a continuation token
    rows = [anchor_candidates(m) for m in mask]
    anchors = torch.zeros(len(rows), max(len(r) for r in rows), dtype=torch.long)
    valid = torch.zeros(anchors.shape, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : len(r)], valid[i, : len(r)] = r, True
    cm = CachedModel(model)  # pardec's capture (module doc of fit_eagle3), cloned out of inference mode
    out = cm.forward(ids, hidden_layer=tuple(d.config.layer_ids))
    target = TargetPass(out.hidden.clone(), out.logits.clone(), None)
    opt = torch.optim.Adam(d.parameters(), lr=lr)
    for _ in range(steps):
        terms = block_terms(d, target, embed, head, ids, mask, anchors, valid, d.config.block_size, 7.0)
        opt.zero_grad()
        (terms.total / terms.count.sum().clamp(min=1)).backward()
        opt.step()
    return d.eval()


def _eagle_sequences(model) -> list[list[int]]:
    """The target's greedy continuations of the exactness sweep's short prompt and of a few random ones."""
    from pardec.decoding import build_decoder
    from pardec.models.cached import CachedModel

    g = torch.Generator().manual_seed(0)
    vocab = int(model.config.vocab_size)
    short = [[1, 504, 1812]] if vocab > 1812 else []
    prompts = short + [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(3 - len(short))]
    ar = build_decoder("ar", CachedModel(model))  # (the forward the model runs: auto)
    return [p + ar.generate(p, 30).tokens for p in prompts]


def drafter_dir(model, kind: str, k: int = 3, seed: int = 0) -> Path:
    """A drafter of ``kind`` (medusa | firp | eagle3 | dflash) for ``model``, saved once per test run for a float model
    (tests/shared.py: every worker reads the first one's), once per process otherwise."""
    key = (id(model), kind)
    if key not in _MADE:
        digest = fingerprint(model)
        make = functools.partial(_make_drafter, model, kind, k, seed)
        if digest is None:
            _MADE[key] = _ROOT / f"{kind}-{len(_MADE)}"
            make(_MADE[key])
        else:
            _MADE[key] = once(f"drafter-{kind}-k{k}-s{seed}-{digest}", make)
    return _MADE[key]


def _make_drafter(model, kind: str, k: int, seed: int, out: Path) -> None:
    if kind in ("eagle3", "dflash"):
        fit = fit_eagle3 if kind == "eagle3" else fit_dflash
        save_drafter(fit(model, _eagle_sequences(model), seed=seed), out, model.config, "tiny")
        return
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
    save_drafter(d, out, cfg, "tiny")
    save_tree(out / "trees" / "T.json", "T", TREE_T)


def drafter_params(method: str, model, tree: str = "T") -> dict:
    """The method parameters naming a drafter for ``model`` (sdsat: a stand-in adaptive id; {} for methods without
    one)."""
    if method == "sdsat":  # a tiny random model has no trained adaptive token: its last id stands in for one
        return {"adaptive_ids": [int(model.config.vocab_size) - 1]}
    if method not in KEYS:
        return {}
    if method in ("eagle3", "dflash"):
        return {"path": str(drafter_dir(model, method))}
    return {KEYS[method]: str(drafter_dir(model, "firp" if method == "firp" else "medusa")), "tree": tree}


def vocab_dir(ids: list[int], vocab_size: int) -> str:
    """A directory holding only a draft vocabulary's maps (``d2t``, ``t2d`` in ``drafter.safetensors``, as an EAGLE-3
    drafter keeps them): what ``dflash``'s ``draft_vocab`` reads."""
    from safetensors.torch import save_file

    from pardec.models.vocab import DraftVocab

    vocab = DraftVocab(sorted(set(ids)), vocab_size)
    out = _ROOT / f"vocab-{vocab_size}-{'-'.join(map(str, vocab.ids.tolist()))[:80]}-{len(vocab)}"
    if not out.is_dir():
        out.mkdir(parents=True)
        save_file({"d2t": vocab.d2t, "t2d": vocab.t2d}, str(out / "drafter.safetensors"))
    return str(out)
