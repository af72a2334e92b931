"""Verification rules alone: greedy longest prefix / path, and exactness in distribution (chi-square) of chain
speculative sampling (with and without draft distributions q) and of recursive rejection over tree siblings,
with and without top-k / top-p."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pardec.config import SamplingConfig
from pardec.decoding.sampling import warp
from pardec.decoding.tree import Tree
from pardec.decoding.verify import verify_chain, verify_tree
from tests.stats import chi_square_p

V = 6
SETTINGS = {"t1": SamplingConfig(temperature=1.0), "warped": SamplingConfig(temperature=0.7, top_k=5, top_p=0.9)}


def _tables(seed: int, scale: float = 1.0):
    """Random conditional logits: L1 [V], L2 [V, V] (given t1), L3 [V, V, V] (given t1, t2)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(V, generator=g) * scale, torch.randn(V, V, generator=g) * scale,
            torch.randn(V, V, V, generator=g) * scale)


def _target_joint(tp, s: SamplingConfig) -> dict:
    l1, l2, _ = tp
    p1, p2 = warp(l1, s), warp(l2, s)
    return {(a, b): float(p1[a] * p2[a, b]) for a in range(V) for b in range(V)}


def _logits_after(tp, prefix: list[int]) -> torch.Tensor:
    l1, l2, l3 = tp
    return [l1, l2[prefix[0]] if prefix else None, l3[prefix[0], prefix[1]] if len(prefix) > 1 else None][len(prefix)]


def _two_tokens_chain(tp, dp, s, gen, k, use_q):
    """Speculative sampling rounds (draft dp, target tp) until two tokens are committed."""
    out: list[int] = []
    while len(out) < 2:
        draft, qs = [], []
        for _ in range(min(k, 2 - len(out))):
            q = warp(_logits_after(dp, out + draft), s)
            draft.append(int(torch.multinomial(q, 1, generator=gen)))
            qs.append(q)
        rows = torch.stack([_logits_after(tp, out + draft[:i]) for i in range(len(draft) + 1)])
        out += verify_chain(torch.tensor(draft), rows, s, gen, torch.stack(qs) if use_q else None)
    return tuple(out[:2])


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("use_q", [True, False])
def test_chain_speculative_sampling_is_exact_in_distribution(setting, use_q):
    s = SETTINGS[setting]
    tp, dp = _tables(0), _tables(1)
    gen = torch.Generator().manual_seed(42)
    n = 3000
    obs = Counter(_two_tokens_chain(tp, dp, s, gen, 2, use_q) for _ in range(n))
    p, dof = chi_square_p(obs, _target_joint(tp, s), n)
    assert dof >= 5
    assert p > 1e-3, (setting, use_q, p)


def test_chain_rule_without_residual_is_detected():
    """Power check: accepting drafts with min(1, p/q) but resampling from p (not the residual) is biased, and the
    test above must see it."""
    s = SETTINGS["t1"]
    tp, dp = _tables(0), _tables(1)
    gen = torch.Generator().manual_seed(42)
    p1, q1 = warp(tp[0], s), warp(dp[0], s)
    obs = Counter()
    n = 6000
    for _ in range(n):
        x = int(torch.multinomial(q1, 1, generator=gen))
        ok = float(torch.rand((), generator=gen)) * float(q1[x]) < float(p1[x])
        obs[(x if ok else int(torch.multinomial(p1, 1, generator=gen)),)] += 1
    p, _ = chi_square_p(obs, {(a,): float(p1[a]) for a in range(V)}, n)
    assert p < 1e-6


def test_chain_greedy_longest_prefix_plus_target_token():
    logits = torch.full((4, V), -5.0)
    for i, t in enumerate([2, 3, 1, 4]):
        logits[i, t] = 5.0
    s = SamplingConfig()
    assert verify_chain(torch.tensor([2, 3, 1]), logits, s, None) == [2, 3, 1, 4]
    assert verify_chain(torch.tensor([2, 0, 1]), logits, s, None) == [2, 3]
    assert verify_chain(torch.tensor([5, 3, 1]), logits, s, None) == [2]
    assert verify_chain(torch.tensor([], dtype=torch.long), logits[:1], s, None) == [2]
    with pytest.raises(ValueError, match="logit rows"):
        verify_chain(torch.tensor([1, 2]), logits, s, None)


def _sample_without_replacement(q: torch.Tensor, m: int, gen) -> list[int]:
    q = q.clone()
    out = []
    for _ in range(m):
        x = int(torch.multinomial(q / q.sum(), 1, generator=gen))
        out.append(x)
        q[x] = 0.0
    return out


def _two_tokens_tree(tp, dp, s, gen, stochastic: bool):
    """One tree verification (root with 3 children, the first two with 2 children each), then plain target
    sampling if fewer than two tokens were committed."""
    q = {}
    if stochastic:  # children drawn from the draft without replacement
        q[0] = warp(dp[0], s)
        firsts = _sample_without_replacement(q[0], min(3, int((q[0] > 0).sum())), gen)
    else:  # deterministic candidates
        firsts = [0, 3, 5]
    paths = []
    for j, a in enumerate(firsts):
        if j < 2:
            qa = warp(dp[1][a], s)
            seconds = _sample_without_replacement(qa, min(2, int((qa > 0).sum())), gen) if stochastic else [1, 4]
            paths += [[a, b] for b in seconds]
        else:
            paths.append([a])
    tree = Tree.from_paths(paths)
    if stochastic:
        for node in range(1, len(tree)):
            if tree.children[node]:
                q[node] = warp(dp[1][tree.labels[node]], s)
    rows = torch.stack([_logits_after(tp, [tree.labels[n] for n in tree.path_to(i)[1:]]) for i in range(len(tree))])
    verdict = verify_tree(tree, rows, s, gen, q if stochastic else None)
    out = list(verdict.tokens)
    assert [tree.labels[n] for n in verdict.path[1:]] == out[: len(verdict.path) - 1]
    if len(out) < 2:
        out.append(int(torch.multinomial(warp(tp[1][out[0]], s), 1, generator=gen)))
    return tuple(out[:2])


@pytest.mark.slow
@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("stochastic", [True, False])
def test_tree_recursive_rejection_is_exact_in_distribution(setting, stochastic):
    s = SETTINGS[setting]
    tp, dp = _tables(2), _tables(3)
    gen = torch.Generator().manual_seed(7)
    n = 3000
    obs = Counter(_two_tokens_tree(tp, dp, s, gen, stochastic) for _ in range(n))
    p, dof = chi_square_p(obs, _target_joint(tp, s), n)
    assert dof >= 5
    assert p > 1e-3, (setting, stochastic, p)


def test_tree_greedy_takes_the_longest_argmax_path():
    # root children 7, 8; 8 -> 9 -> 10; 7 -> 11
    tree = Tree.from_paths([[7, 11], [8, 9, 10]])
    logits = torch.full((len(tree), 16), -1.0)
    node_8, node_9 = tree.path_to(5)[1], tree.path_to(5)[2]
    for node, tok in {0: 8, node_8: 9, node_9: 2}.items():
        logits[node, tok] = 1.0
    verdict = verify_tree(tree, logits, SamplingConfig(), None)
    assert verdict.path == [0, node_8, node_9] and verdict.tokens == [8, 9, 2]
    logits[0] = -1.0
    logits[0, 5] = 1.0  # the target wants 5: no child matches
    assert verify_tree(tree, logits, SamplingConfig(), None).tokens == [5]
