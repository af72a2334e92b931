"""The model seam's verbs on a virtual CUDA device (pardec.testing), with the model on one GPU and split over
two (as ``model.device_map=auto`` splits a big target): each verb gives what it gives on the CPU, and no CPU
tensor meets the model's CUDA ones."""

from __future__ import annotations

import pytest
import torch

from pardec.models.cached import CachedModel
from pardec.models.drafters import new_drafter
from pardec.models.pseudo import forward_pseudo, run_upper
from pardec.testing import VirtualCUDA
from tests.conftest import tiny


def _verbs(model, drafter) -> dict[str, list]:
    """Every verb of CachedModel once, their outputs moved to plain lists."""
    cm = CachedModel(model)
    out = {"prefill": cm.prefill(torch.tensor([[1, 504, 1812, 30]]))}
    n = cm.length
    tree = torch.tensor([[True, False, False], [True, True, False], [True, False, True]])  # a root, two children
    f = cm.forward(torch.tensor([[7, 8, 9]]), positions=torch.tensor([n, n + 1, n + 1]), attend=tree,
                   hidden_layer=1)
    out["tree"], out["hidden"] = f.logits, f.hidden
    cm.keep([0, 2])  # the accepted path: root and second child
    out["keep"] = torch.tensor(cm.tokens)
    out["logits_at"] = cm.forward(torch.tensor([[5, 6, 7]]), logits_at=[0, 2]).logits
    out["run_upper"] = run_upper(cm, f.hidden[:, :1], 1, positions=torch.tensor([cm.length]))
    cm.truncate(cm.length - 2)
    out["sync"] = torch.tensor(cm.sync(cm.tokens + [11, 12]))
    with torch.no_grad():
        p = forward_pseudo(cm, torch.tensor([[11, 12]]), drafter, drafter.layers, anchors=[1])
    out["pseudo"], out["pseudo_head"] = p.logits, cm.lm_head(p.pseudo)
    batch = CachedModel(model)
    batch.prefill(torch.tensor([[1, 2, 3], [4, 5, 6]]))
    other = batch.take_rows([0])
    other.forward(torch.tensor([[9]]))
    pads = batch.join_rows(other)
    valid = torch.ones(2, batch.length + 1, dtype=torch.bool)
    valid[0, 0] = False  # the padding join_rows added to the shorter row
    out["rows"] = batch.forward(torch.tensor([[3], [3]]), key_valid=valid, last_only=True).logits
    out["pads"] = torch.tensor(pads)
    return {k: v.detach().cpu().tolist() for k, v in out.items()}


def _drafter(model):
    torch.manual_seed(0)
    return new_drafter("firp", model.config, layers=[0, 1])


def _split(model, vc):
    """Layer 0 and the embeddings on cuda:0, the rest on cuda:1, with accelerate's hooks moving activations
    between them (what ``device_map=auto`` builds)."""
    from accelerate import dispatch_model

    a, b = "cuda:0", "cuda:1"  # (accelerate's integer ids need a real accelerator to resolve)
    device_map = {"model.embed_tokens": a, "model.rotary_emb": a, "model.layers.0": a, "model.layers.1": b,
                  "model.norm": b, "lm_head": b}
    return dispatch_model(model, device_map=device_map)


def test_model_seam_verbs_on_one_gpu():
    model = tiny(0).model
    drafter = _drafter(model)
    on_cpu = _verbs(model, drafter)
    with VirtualCUDA() as vc:
        vc.place(model)
        vc.place(drafter)
        on_cuda = _verbs(model, drafter)
    for k in on_cpu:
        torch.testing.assert_close(torch.tensor(on_cuda[k]), torch.tensor(on_cpu[k]), msg=k)


def test_model_seam_verbs_on_a_model_split_over_two_gpus():
    import copy

    from accelerate.hooks import remove_hook_from_submodules

    model = copy.deepcopy(tiny(0).model)
    drafter = _drafter(model)
    on_cpu = _verbs(model, drafter)
    with VirtualCUDA(devices=2) as vc:
        _split(model, vc)
        vc.place(drafter, "cuda:1")
        assert {p.device.index for p in model.parameters()} == {0, 1}
        on_cuda = _verbs(model, drafter)
        remove_hook_from_submodules(model)
    for k in on_cpu:
        torch.testing.assert_close(torch.tensor(on_cuda[k]), torch.tensor(on_cpu[k]), msg=k)


@pytest.mark.parametrize("verb", ["forward", "keep"])
def test_cpu_inputs_are_moved_onto_the_model(verb):
    """The seam takes ids and indices from the host and moves them itself."""
    with VirtualCUDA() as vc:
        model = vc.place(tiny(0).model)
        cm = CachedModel(model)
        cm.prefill(torch.tensor([[1, 2, 3]]))
        out = cm.forward(torch.tensor([4, 5]))
        if verb == "keep":
            cm.keep(torch.tensor([1]))
            assert cm.tokens == [1, 2, 3, 5]
        assert out.logits.device.type == "cuda"


def test_lean_forward_on_one_gpu():
    """forward_impl=lean on a virtual GPU: every forward argument gives what it gives on the CPU, and no CPU tensor
    meets the model's (the causal mask after a prefix, rotary tables, kept positions are made on its device)."""
    from tests.models.forward.test_lean import _script

    model = tiny(1).model
    on_cpu = [t.detach().cpu() for t in _script(CachedModel(model, forward_impl="lean"))]
    with VirtualCUDA() as vc:
        vc.place(model)
        cm = CachedModel(model, forward_impl="lean")
        on_cuda = [t.detach().cpu() for t in _script(cm)]
        assert cm.device.type == "cuda"
    for a, b in zip(on_cuda, on_cpu):
        torch.testing.assert_close(a, b)
