"""medusa / firp: token-exact with oracle drafts that force deep acceptance (and a wrong top-1 that only a branch of
the tree catches), medusa_typical's acceptance rule on a hand-made tree, and their one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from pardec.config import ConfigError, SamplingConfig
from pardec.decoding import Stopper, build_decoder
from pardec.decoding.heads import Firp, Medusa, MedusaTypical, typical_accept
from pardec.decoding.tree import Tree
from pardec.decoding.tree_search import save_tree
from pardec.models.cached import CachedModel
from tests.conftest import tiny
from tests.decoding.drafters import drafter_dir

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


class Oracle:
    """Drafts = the true continuation as one-hot logits; every ``corrupt``-th drafted position has a wrong top-1
    and the truth at rank 1 (only a tree with a rank-1 branch there accepts it)."""

    truth: list[int]
    corrupt: int = 1000

    def generate(self, *a, **kw):
        self.out_tokens = None
        return super().generate(*a, **kw)

    def begin(self, *a, **kw):
        st, last = super().begin(*a, **kw)
        self.out_tokens = st.out.tokens
        return st, last

    def _drafts(self, state, node):
        real = super()._drafts(state, node)
        c = 1 if self.out_tokens is None else len(self.out_tokens)  # tokens committed when these drafts apply
        out = torch.full_like(real, -30.0)
        for d in range(real.shape[0]):
            t = self.truth[c + d] if c + d < len(self.truth) else 0
            if (c + d) % self.corrupt == 0:
                out[d, (t + 1) % out.shape[-1]], out[d, t] = 0.0, -1.0
            else:
                out[d, t] = 0.0
        return out


class OracleMedusa(Oracle, Medusa):
    pass


class OracleFirp(Oracle, Firp):
    pass


def _setup(seed=0):
    lm = tiny(seed)
    cm = CachedModel(lm.model)
    ids = lm.tokenizer(PROMPT)["input_ids"]
    ref = build_decoder("ar", cm, lm.tokenizer).generate(ids, 40, Stopper(lm.tokenizer))
    return lm, cm, ids, ref


@pytest.mark.parametrize("cls", [OracleMedusa, OracleFirp])
@pytest.mark.parametrize("tree,corrupt", [("chain", 1000), ("T", 1000), ("T", 3), ("chain", 3)])
def test_oracle_drafts_are_accepted_deep_and_output_stays_exact(cls, tree, corrupt):
    lm, cm, ids, ref = _setup()
    kind = "medusa" if cls is OracleMedusa else "firp"
    dec = cls(cm, lm.tokenizer, path=str(drafter_dir(lm.model, kind)), tree=tree)
    dec.truth, dec.corrupt = ref.tokens + [0] * 8, corrupt
    res = dec.generate(ids, 40, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens
    assert sum(res.accepted) == 40
    if corrupt == 1000:  # every draft right: 1 + K = 4 tokens per step after the first
        assert res.accepted[1:-1] == [4] * (len(res.accepted) - 2)
    elif tree == "T":  # the rank-1 branch catches what a chain would lose: still deeper than a chain would get
        assert res.tokens_per_forward > 2.0
    assert res.draft_accepted <= res.drafted


@pytest.mark.parametrize("stop_at", [0, 5, 13])
def test_eos_inside_an_accepted_path(stop_at):
    lm, cm, ids, ref = _setup(1)
    eos = ref.tokens[stop_at]
    stop = Stopper(lm.tokenizer, eos_ids=[eos])
    want = build_decoder("ar", cm, lm.tokenizer).generate(ids, 40, stop)
    for cls, kind in ((OracleMedusa, "medusa"), (OracleFirp, "firp")):
        dec = cls(cm, lm.tokenizer, path=str(drafter_dir(lm.model, kind)), tree="T")
        dec.truth = ref.tokens + [0] * 8
        res = dec.generate(ids, 40, stop)
        assert res.tokens == want.tokens and res.stop_reason == "eos"


def test_medusa_typical_is_greedy_exact_and_samples_in_support():
    lm, cm, ids, ref = _setup()
    path = str(drafter_dir(lm.model, "medusa"))
    dec = build_decoder("medusa_typical", cm, lm.tokenizer, path=path, tree="T")
    assert dec.generate(ids, 40, Stopper(lm.tokenizer)).tokens == ref.tokens
    res = dec.generate(ids, 20, Stopper(lm.tokenizer), SamplingConfig(temperature=0.7, top_k=5, seed=3))
    assert len(res.tokens) == 20 and sum(res.accepted) == 20
    assert MedusaTypical.exactness == "approximate" and Medusa.exactness == "distribution"


def test_typical_acceptance_rule_by_hand():
    # root 0 -> a (token 1) -> c (token 3); root -> b (token 2)
    tree = Tree.from_parents([-1, 0, 0, 1], [-1, 1, 2, 3])
    logits = torch.full((4, 5), -20.0)
    logits[0, 1], logits[0, 2] = 0.0, 0.0  # two equally likely: p = 0.5 each, entropy log 2
    logits[1, 3] = -3.0  # token 3 after a: p ~ 0.28 of a flat-ish row
    s = SamplingConfig(temperature=1.0, seed=0)
    gen = torch.Generator().manual_seed(0)
    v = typical_accept(tree, logits, s, gen, threshold=0.09, alpha=0.3)
    # bar at root = min(0.09, 0.3 * exp(-log 2)) = 0.09: both a and b pass; at a, token 3 has p(3) well above its bar
    assert v.path == [0, 1, 3] and v.tokens[:2] == [1, 3]
    v = typical_accept(tree, logits, s, gen, threshold=0.6, alpha=1.0)  # bar 0.5 at the root: nobody passes
    assert v.path == [0] and v.tokens[0] in (1, 2)


def test_bad_drafter_inputs_are_one_line_errors(tmp_path):
    lm = tiny(0)
    cm = CachedModel(lm.model)
    heads = str(drafter_dir(lm.model, "medusa"))
    with pytest.raises(ConfigError, match=r"needs trained medusa weights: method.path=<dir>"):
        build_decoder("medusa", cm, lm.tokenizer)
    # the previous release's keys: refused naming the one key every method reads a drafter from
    for name, old in (("medusa", "heads"), ("medusa_typical", "heads"), ("firp", "projections")):
        with pytest.raises(ConfigError, match=rf"^method.{old} is now method.path \(the one key every method reads "
                                              rf"its trained drafter from\): pass method.path={heads}$"):
            build_decoder(name, cm, lm.tokenizer, **{old: heads})
    with pytest.raises(ConfigError, match=r"method.k=0 is out of range: it must be an integer in \[1, 3\]"):
        build_decoder("medusa", cm, lm.tokenizer, path=heads, k=0)
    with pytest.raises(ConfigError, match=r"method.k=4 is out of range"):
        build_decoder("firp", cm, lm.tokenizer, path=str(drafter_dir(lm.model, "firp")), k=4)
    with pytest.raises(ConfigError, match=r"holds 'medusa' weights; this method needs 'firp'"):
        build_decoder("firp", cm, lm.tokenizer, path=heads)
    with pytest.raises(ConfigError, match=r"method.tree='T99' is not a tree file or a known name.*T"):
        build_decoder("medusa", cm, lm.tokenizer, path=heads, tree="T99")
    deep = tmp_path / "deep.json"
    save_tree(deep, "deep", [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ConfigError, match=r"tree depth 4 .* exceeds the drafter's 3 heads"):
        build_decoder("medusa", cm, lm.tokenizer, path=heads, tree=str(deep))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "pardec-tree", "version": 1, "paths": [[0, 1]]}))
    with pytest.raises(ConfigError, match=r"no parent"):
        build_decoder("medusa", cm, lm.tokenizer, path=heads, tree=str(bad))
    other = tiny(1, layers=3)
    with pytest.raises(ConfigError, match=r"trained for another model"):
        build_decoder("firp", CachedModel(other.model), other.tokenizer, path=str(drafter_dir(lm.model, "firp")))


@pytest.mark.parametrize("attention", ["real", "pseudo"])
def test_firp_attention_patterns_stay_exact_and_differ_in_their_drafts(attention, caplog):
    """``pseudo`` (the default, FIRP's No masked inference, §4.3): step i of a node sees the node's steps < i;
    ``real`` (Masked, Fig. 7's ablation): its prefix and itself only. Drafts differ from the second step on; the
    output never does; the combination with the projections' training is logged."""
    import logging

    lm, cm, ids, ref = _setup()
    path = str(drafter_dir(lm.model, "firp"))  # saved with attention "real" (§3.3: trained teacher-forced)
    assert build_decoder("firp", cm, lm.tokenizer, path=path).attention == "pseudo"  # the default
    with caplog.at_level(logging.INFO, logger="pardec.decoding.heads"):
        dec = build_decoder("firp", cm, lm.tokenizer, path=path, tree="T", attention=attention)
    assert dec.attention == attention
    assert f"trained with attention=real, decoded with attention={attention}" in caplog.text
    assert ("Masked ablation" in caplog.text) == (attention == "real")
    res = dec.generate(ids, 40, Stopper(lm.tokenizer))
    assert res.tokens == ref.tokens
    other = build_decoder("firp", cm, lm.tokenizer, path=path, attention="pseudo" if attention == "real"
                          else "real")
    cm.prefill(torch.tensor([ids[:-1]]))
    mine = dec._forward(torch.tensor([ids[-1:]]))[1]  # [1 node, K, H]
    cm.prefill(torch.tensor([ids[:-1]]))
    theirs = other._forward(torch.tensor([ids[-1:]]))[1]
    torch.testing.assert_close(mine[:, 0], theirs[:, 0], rtol=1e-4, atol=1e-5)  # step 0 sees no other step
    assert not torch.allclose(mine[:, 1:], theirs[:, 1:], atol=1e-4)


def test_firp_attention_is_checked_before_any_model():
    with pytest.raises(ConfigError, match=r"method.attention='causal' is not valid; choose one of: real, pseudo"):
        Firp(None, path="/nonexistent", attention="causal")
