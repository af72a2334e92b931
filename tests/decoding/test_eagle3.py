"""Method ``eagle3`` (EAGLE-3's drafter, EAGLE-2's dynamic tree or a chain): greedy output equals ``ar`` token for
token on every forward implementation, with drafts accepted several deep; the dynamic tree is EAGLE-2's selection
(checked against a plain host re-implementation); bad settings are refused. Sampling: the deep distribution test
(``test_distribution_deep.py``); host reads: ``test_verify_device.py``."""

from __future__ import annotations

import heapq

import pytest
import torch

from pardec.config import ConfigError
from pardec.decoding import build_decoder
from pardec.decoding.eagle import Eagle, _DraftCache
from pardec.models.cached import CachedModel
from pardec.testing.graphs import cpu_graphs
from tests.conftest import tiny
from tests.decoding.drafters import _eagle_sequences, drafter_dir

SETTINGS = [{}, {"total_tokens": 8, "depth": 3, "top_k": 3}, {"total_tokens": 2, "depth": 1, "top_k": 1},
            {"mode": "chain"}, {"mode": "chain", "num_speculative_tokens": 7}]


@pytest.fixture(scope="module")
def fitted():
    lm = tiny(1, layers=4)
    return lm, drafter_dir(lm.model, "eagle3"), _eagle_sequences(lm.model)


@pytest.mark.parametrize("impl", ["hf", "lean", "cpu_graphs"])
def test_greedy_eagle_equals_ar_and_accepts_deep(fitted, impl):
    lm, path, seqs = fitted
    cm = CachedModel(lm.model, forward_impl=cpu_graphs() if impl == "cpu_graphs" else impl)
    ar = build_decoder("ar", cm, lm.tokenizer)
    fresh = torch.randint(0, lm.model.config.vocab_size, (6,), generator=torch.Generator().manual_seed(9)).tolist()
    # every setting on the lean forward (what a CPU runs); the tree and the chain on the others
    settings = SETTINGS if impl == "lean" else SETTINGS[:1] + SETTINGS[3:4]
    for prompt in (seqs[0][:3], fresh) if impl != "lean" else (seqs[0][:3], seqs[1][:5], fresh):
        ref = ar.generate(prompt, 30).tokens
        for params in settings:
            res = build_decoder("eagle3", cm, lm.tokenizer, None, path=str(path), **params).generate(prompt, 30)
            assert res.tokens == ref, (prompt, params)
            if prompt is not fresh and params.get("top_k", 10) > 1:  # the contexts the drafter was fitted on
                assert max(res.accepted) >= 3, (params, res.accepted)  # >= 2 drafted tokens accepted at once
                if params.get("mode") != "chain":  # (the chain's later tokens come from untrained steps)
                    assert res.target_forwards < 30 / 2.5, (params, res.target_forwards)  # > 2.5 tokens per forward


def _host_tree(d, embed, cache_kv, root, base, levels, top_k, total):
    """EAGLE-2's selection, node by node on the host (the reference's ``topK_genrate`` as a plain loop): returns
    {(token path): score} of the kept candidates."""
    cands = {}
    logp = torch.log_softmax(d.logits(root).float(), -1)
    top = logp.topk(top_k)
    front = [((int(d.to_target(i)),), float(v), root, [], []) for v, i in zip(top.values, top.indices)]
    for path, score, _, _, _ in front:
        cands[path] = score
    for i in range(levels - 1):
        nxt = []
        for path, score, h, ks, vs in front:
            past = (torch.cat([cache_kv[0], *ks], 2), torch.cat([cache_kv[1], *vs], 2))
            out, (k, v) = d(embed(torch.tensor([path[-1]]))[None], h[None, None], torch.tensor([base + i]), past=past)
            lp = torch.log_softmax(d.logits(out[0, 0]).float(), -1).topk(top_k)
            for val, idx in zip(lp.values, lp.indices):
                child = path + (int(d.to_target(idx)),)
                cands[child] = score + float(val)
                nxt.append((child, score + float(val), out[0, 0], ks + [k], vs + [v]))
        front = heapq.nlargest(top_k, nxt, key=lambda x: x[1])
    best = heapq.nlargest(total - 1, cands.items(), key=lambda x: x[1])
    return dict(best)


@torch.inference_mode()
def test_the_dynamic_tree_is_eagle2s_selection(fitted):
    lm, path, seqs = fitted
    cm = CachedModel(lm.model, forward_impl="lean")
    dec = build_decoder("eagle3", cm, lm.tokenizer, None, path=str(path), total_tokens=12, depth=3, top_k=3)
    prompt = seqs[2][:12]
    out = cm.forward(torch.tensor([prompt]), hidden_layer=dec.layers)
    cache = _DraftCache()
    root, _ = dec._catch_up(cache, out.hidden[0][:-1], torch.tensor(prompt[1:]), 0)
    tree, forwards = dec._tree(cache, root, len(prompt) - 1, 4)
    assert forwards == 3 and len(tree) == 12
    buf = tree.on("cpu")
    parent, labels, depth = buf.parent.tolist(), tree.labels.tolist(), buf.depth.tolist()
    assert all(parent[i] < i for i in range(1, 12)) and max(depth) <= 4
    paths = {}
    for i in range(1, 12):
        paths[i] = paths.get(parent[i], ()) + (labels[i],)
        assert depth[i] == len(paths[i])
    want = _host_tree(dec.drafter, dec.embed, cache.kv, root, len(prompt) - 1, 4, 3, 12)
    assert set(paths.values()) == set(want)
    kids = {}
    for i in range(1, 12):
        kids.setdefault(parent[i], []).append(labels[i])
    assert all(len(v) == len(set(v)) for v in kids.values())  # siblings distinct


def test_bad_settings_are_refused(fitted, tmp_path):
    lm, path, _ = fitted
    cm = CachedModel(lm.model)
    with pytest.raises(ConfigError, match="method.mode='beam' is not valid; choose one of: tree, chain"):
        build_decoder("eagle3", cm, None, None, path=str(path), mode="beam")
    with pytest.raises(ConfigError, match="needs an EAGLE-3 drafter: method.path=<dir>"):
        Eagle(cm)
    with pytest.raises(ConfigError, match="method.top_k=0 is out of range"):
        build_decoder("eagle3", cm, None, None, path=str(path), top_k=0)
    with pytest.raises(ConfigError, match="is not an EAGLE-3 checkpoint: found no files"):
        build_decoder("eagle3", cm, None, None, path=str(tmp_path))
    other = CachedModel(tiny(2, layers=3).model)
    with pytest.raises(ConfigError, match="was trained for another model"):
        build_decoder("eagle3", other, None, None, path=str(path))


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_an_exported_drafter_decodes_as_the_trained_one(fitted, fmt, tmp_path):
    """The export (python -m pardec.export) loaded back through method.path: the same drafts, so the same
    verifications, accepted counts and tokens as the pardec drafter it came from."""
    from pardec.export import export

    lm, path, seqs = fitted
    export(path, fmt, tmp_path / fmt)
    cm = CachedModel(lm.model, forward_impl="lean")
    runs = [build_decoder("eagle3", cm, lm.tokenizer, None, path=str(p), total_tokens=8, depth=3, top_k=3)
            .generate(seqs[0][:3], 20) for p in (path, tmp_path / fmt)]
    assert runs[0].tokens == runs[1].tokens and runs[0].accepted == runs[1].accepted
    assert runs[0].draft_accepted == runs[1].draft_accepted > 0
