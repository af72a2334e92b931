"""scripts/profile_step.py: a decode step's time split into parts that sum to the step, on tiny models."""

from __future__ import annotations

import pytest

from scripts import profile_step
from tests.conftest import noisy, tiny


@pytest.mark.parametrize("method", ["ar", "sps"])
def test_parts_sum_to_the_step_and_name_every_group(method):
    lm = tiny(0)
    draft = noisy(0) if method == "sps" else None
    prompts = [list(range(100, 112)), list(range(200, 209))]
    pr = profile_step.profile(method, lm.model, draft, lm.tokenizer, prompts, tokens=12, gamma=3, repeats=2)
    assert pr.steps >= (11 if method == "ar" else 3) and pr.total > 0 and pr.floor > 0
    assert sum(pr.parts.values()) == pytest.approx(pr.total, rel=1e-9)
    models = ["target"] + (["draft"] if method == "sps" else [])
    for who in models:
        for group in ("MLP linears", "attention projections", "LM head", "attention core (rotary, cache, SDPA)",
                      "norms"):
            assert pr.parts[f"{who}: {group}"] > 0, (who, group)
    assert (pr.draft_forwards_per_step > 0) == (method == "sps")
    if method == "ar":
        assert pr.tokens_per_step == 1.0
    # the hooks are gone: the models run as before
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in lm.model.modules())

@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_floor_runs_every_linear_in_order(dtype):
    lm = tiny(0, dtype)  # (bf16: prepacked linears on CPUs with AMX-bf16; inputs in the weights' dtype)
    ran = []
    handles = [m.register_forward_hook(lambda mod, a, o, n=n: ran.append(n)) for n, m in lm.model.named_modules()
               if n.rsplit(".", 1)[-1] in profile_step.LINEAR_GROUPS]
    profile_step.linear_floor(lm.model, 3, repeats=2)
    for h in handles:
        h.remove()
    names = [n for n, _ in lm.model.named_modules() if n.rsplit(".", 1)[-1] in profile_step.LINEAR_GROUPS]
    assert len(names) == 2 * 7 + 1 and ran == names * 2
