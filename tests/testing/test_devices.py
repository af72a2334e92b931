"""The virtual CUDA device itself: it fails where PyTorch on a GPU fails, passes where PyTorch passes, counts host
syncs, and leaves torch as it found it."""

from __future__ import annotations

import pytest
import torch

from pardec.testing.devices import DeviceMismatchError, VirtualCUDA


def test_tensors_report_and_keep_their_virtual_device():
    with VirtualCUDA() as vc:
        x = torch.ones(3, device="cuda")
        assert x.device == torch.device("cuda", 0) and x.is_cuda and x.get_device() == 0
        y = (x * 2).softmax(-1)[None]
        assert y.device.type == "cuda"
        assert torch.zeros_like(x).device.type == "cuda" and x.new_zeros(2).device.type == "cuda"
        assert torch.zeros(2).device.type == "cpu"
        assert x.cpu().device.type == "cpu" and x.device.type == "cuda"  # .cpu() copies, x stays
        assert torch.ones(2).to(x).device.type == "cuda" and torch.ones(2).to("cuda:0").device.type == "cuda"
        assert torch.as_tensor(torch.ones(2), device="cuda").device.type == "cuda"
        assert vc.syncs["to cpu"] == 1


@pytest.mark.parametrize("op", [
    lambda x, c: x + c,
    lambda x, c: torch.cat([x, c]),
    lambda x, c: torch.where(x > 0, x, c),
    lambda x, c: c.index_select(0, torch.zeros(1, dtype=torch.long, device="cuda")),
    lambda x, c: x.__setitem__(torch.tensor([0, 1, 2], device="cuda"), c),
    lambda x, c: torch.stack([x.sum(), c.sum()]),  # 0-dim CPU tensors are scalars only to elementwise ops
    lambda x, c: c.sum().add_(x.sum()),  # an in-place op cannot write CUDA values into a CPU tensor
    lambda x, c: torch.nn.functional.embedding(torch.zeros(1, dtype=torch.long), x[None].expand(4, 3)),
])
def test_cpu_tensors_meeting_cuda_ones_fail(op):
    with VirtualCUDA():
        x, c = torch.ones(3, device="cuda"), torch.ones(3)
        with pytest.raises(DeviceMismatchError, match="CPU|cuda"):
            op(x, c)


def test_what_pytorch_allows_across_devices_passes():
    with VirtualCUDA():
        x = torch.arange(6.0, device="cuda")
        assert (x + torch.tensor(2.0)).device.type == "cuda"  # 0-dim CPU tensors are scalars
        assert x[torch.tensor([0, 2])].tolist() == [0.0, 2.0]  # CPU indices into a CUDA tensor
        x.copy_(torch.ones(6))  # copies cross devices
        x[:2] = torch.ones(2)  # a slice assignment is a copy
        x[1] = torch.tensor(5.0)
        assert x.tolist() == [1.0, 5.0, 1.0, 1.0, 1.0, 1.0]


def test_two_gpus_do_not_mix():
    with VirtualCUDA(devices=2):
        a, b = torch.ones(2, device="cuda:0"), torch.ones(2, device="cuda:1")
        with pytest.raises(DeviceMismatchError, match="cuda:0, cuda:1"):
            a + b
        assert (a + b.to(a.device)).device == torch.device("cuda", 0)
        with pytest.raises(DeviceMismatchError, match="does not exist"):
            a.to("cuda:2")


def test_generators_must_be_on_the_device_they_sample_for():
    with VirtualCUDA():
        p = torch.ones(4, device="cuda") / 4
        with pytest.raises(DeviceMismatchError, match="generator on cpu"):
            torch.multinomial(p, 1, generator=torch.Generator())
        g = torch.Generator(device="cuda").manual_seed(0)
        assert g.device.type == "cuda" and isinstance(g, torch.Generator)
        assert torch.multinomial(p, 1, generator=g).device.type == "cuda"
        assert torch.rand(2, device="cuda", generator=g).device.type == "cuda"


def test_host_syncs_are_counted():
    with VirtualCUDA() as vc:
        x = torch.arange(4, device="cuda")
        x.sum().item()
        x.tolist()
        bool(x[0] > 1)
        x[x > 1]
        torch.ones(3).tolist()  # CPU reads are free
        torch.cuda.synchronize()
        with pytest.raises(DeviceMismatchError, match="numpy"):
            x.numpy()
    assert vc.syncs == {"item": 1, "tolist": 1, "__bool__": 1, "boolean mask index": 1, "cuda.synchronize": 1}


def test_modules_train_on_the_virtual_device_and_torch_is_restored():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    real_generator, real_available = torch.Generator, torch.cuda.is_available
    with VirtualCUDA():
        assert torch.cuda.is_available()
        model.to("cuda")
        assert all(p.device.type == "cuda" for p in model.parameters())
        ids = torch.tensor([[1, 2, 3]], device="cuda")
        loss = torch.nn.functional.cross_entropy(model(ids)[0], ids[0])
        loss.backward()
        assert model[1].weight.grad.device.type == "cuda"
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        opt.step()  # optimizer states are created on the parameters' device
        with pytest.raises(DeviceMismatchError):
            model(torch.tensor([[1, 2]]))  # CPU ids into CUDA embeddings
    assert torch.Generator is real_generator and torch.cuda.is_available is real_available


def test_what_loaders_and_launchers_ask_of_cuda_answers_as_on_a_gpu_node():
    """Module.to(device=...), torch.device(<int>), set_device, RNG states and memory queries: what transformers'
    loading, accelerate's device_map and torch.random.fork_rng ask, answered for the virtual devices."""
    real = torch.cuda.set_device, torch.cuda.get_rng_state, torch.cuda.mem_get_info
    with VirtualCUDA(devices=2, memory=123 << 20) as vc:
        m = torch.nn.Linear(2, 2).to(device=torch.device("cuda", 1), dtype=torch.float32)
        assert m.weight.device == torch.device("cuda", 1)
        assert torch.device(1) == torch.device("cuda", 1) and torch.tensor([0], device=1).device.index == 1
        torch.cuda.set_device(1)
        assert torch.cuda.current_device() == 1 and vc.current == 1
        with pytest.raises(DeviceMismatchError, match="cuda:2 does not exist"):
            torch.cuda.set_device(2)
        assert torch.cuda.mem_get_info(0)[0] == 123 << 20 and torch.cuda.get_device_properties(1).total_memory >= 80 << 30
        state = torch.cuda.get_rng_state(1)
        torch.cuda.set_rng_state(torch.zeros_like(state), 1)
        assert torch.equal(torch.cuda.get_rng_state(1), torch.zeros_like(state))
        with torch.random.fork_rng(devices=[0, 1]):
            torch.rand(3)
        assert torch.cuda.max_memory_allocated() == 0  # (nothing is allocated on a virtual device)
    assert (torch.cuda.set_device, torch.cuda.get_rng_state, torch.cuda.mem_get_info) == real
