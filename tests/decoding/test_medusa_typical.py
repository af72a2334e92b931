"""medusa_typical against Medusa's typical acceptance as written (Cai et al. 2024, Sec. 2.3.1; the reference
``evaluate_posterior`` / ``generate_candidates`` with ``fast=True``), on hand-set logits: ties of equal accepted
length go to the most likely path, the token after the accepted path is the target's argmax by default, and the
other next-token rules (``sample``: pardec's earlier one; ``typical``: the reference with ``fast=False``)."""

from __future__ import annotations

import inspect
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding.heads import MedusaTypical, typical_accept
from pardec.decoding.tree import Tree
from tests.conftest import tiny
from tests.decoding.drafters import drafter_dir

ROOT = Path(__file__).resolve().parents[2]

# root -> a (token 1) -> c (token 3); root -> b (token 2) -> d (token 4); V = 5
TREE = Tree.from_parents([-1, 0, 0, 1, 2], [-1, 1, 2, 3, 4])


def _logits(rows: dict[int, dict[int, float]]) -> torch.Tensor:
    """[5, 5] logits whose row n (after node n) has the given probabilities (the rest 0)."""
    out = torch.full((5, 5), -1e9)
    for n, row in rows.items():
        for tok, p in row.items():
            out[n, tok] = torch.tensor(p).log()
    return out


S = SamplingConfig(temperature=1.0, seed=0)
# row 0: p(a) .4, p(b) .6 (entropy .673, bar min(.09, .3 * .510) = .09: both pass); rows 1 and 2: p(c | a) =
# p(d | b) = .5 (bar .09: both pass). Depth 2 ties: a c has likelihood .4 * .5 = .2, b d .6 * .5 = .3.
# Row 4 (after d): p(1) .6, p(2) .35, p(3) .05 (entropy .824, bar min(.09, .3 * .439) = .09: token 3 is under it).
ROWS = {0: {1: .4, 2: .6}, 1: {3: .5, 0: .5}, 2: {4: .5, 0: .5}, 3: {0: 1.}, 4: {1: .6, 2: .35, 3: .05}}


def test_equal_lengths_go_to_the_most_likely_path():
    v = typical_accept(TREE, _logits(ROWS), S, torch.Generator().manual_seed(0), threshold=0.09, alpha=0.3)
    assert v.path == [0, 2, 4]  # b d (likelihood .3), not a c (.2), which comes first in node order
    assert v.tokens == [2, 4, 1]  # then the target's argmax after d: token 1 (p .6)


def test_a_deeper_path_beats_a_more_likely_shorter_one():
    rows = {**ROWS, 2: {4: .05, 0: .95}}  # row 2: entropy .199, bar min(.09, .3 * .820) = .09 > p(d) = .05
    v = typical_accept(TREE, _logits(rows), S, torch.Generator().manual_seed(0), threshold=0.09, alpha=0.3)
    assert v.path == [0, 1, 3] and v.tokens == [1, 3, 0]  # a c (depth 2) over b (depth 1, more likely than a)


def test_nothing_passes_then_the_argmax():
    rows = {**ROWS, 0: {1: .02, 2: .03, 0: .95}}  # bar .09 at the root: neither a nor b passes
    v = typical_accept(TREE, _logits(rows), S, torch.Generator().manual_seed(0), threshold=0.09, alpha=0.3)
    assert v.path == [0] and v.tokens == [0]


@pytest.mark.parametrize("rule", ["greedy", "sample", "typical"])
def test_the_next_token_rules(rule):
    """After b d (row 4: p = .6 / .35 / .05 for tokens 1 / 2 / 3, bar .09): greedy always 1; typical samples
    1 and 2 only, in ratio .6 : .35 (p 1 = .6 / .95 = .632); sample follows .6 / .35 / .05."""
    logits, n = _logits(ROWS), 4000
    gen = torch.Generator().manual_seed(1)
    got = Counter(typical_accept(TREE, logits, S, gen, 0.09, 0.3, rule).tokens[-1] for _ in range(n))
    if rule == "greedy":
        assert got == {1: n}
    elif rule == "typical":
        assert set(got) == {1, 2} and got[1] / n == pytest.approx(.6 / .95, abs=0.03)
    else:
        assert set(got) == {1, 2, 3} and got[3] / n == pytest.approx(.05, abs=0.015)
        assert got[1] / n == pytest.approx(.6, abs=0.03)


def test_defaults_are_the_papers_and_bad_rules_are_one_line():
    params = inspect.signature(MedusaTypical.__init__).parameters
    conf = yaml.safe_load((ROOT / "conf/method/medusa_typical.yaml").read_text())
    for key, want in {"posterior_threshold": 0.09, "posterior_alpha": 0.3, "next_token": "greedy"}.items():
        assert params[key].default == conf[key] == want, key
    heads = str(drafter_dir(tiny(0).model, "medusa"))
    with pytest.raises(ConfigError, match=r"^method.next_token='beam' is not valid; choose one of: greedy, sample, "
                                          r"typical$"):
        MedusaTypical(None, path=heads, next_token="beam")  # spec validation builds it so, before any model


def test_next_token_is_checked_by_spec_validation_before_loading(monkeypatch):
    from pardec.evaluation import validate
    from pardec.models import loading
    from tests.evaluation.helpers import cfg_of

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    heads = str(drafter_dir(tiny(0).model, "medusa"))
    with pytest.raises(ConfigError, match=r"^method.next_token='beam' .*'greedy', 'sample', 'typical'[^\n]*$"):
        validate(cfg_of("+method=medusa_typical", "model=tiny_random", f"method.path={heads}", "method.next_token=beam"))
