"""`python -m pardec.testing.virtual_gpus`: a pardec run as on a GPU node, on the CPU. ``model.device=cuda`` with
``forward_impl=auto`` takes the CUDA graphs' path (replayed by the eager stand-in), and a target with
``model.device_map=auto`` splits over two virtual devices as accelerate splits a real one (what the rehearsal of
the GPU recipes runs: tests/test_rehearse.py, ``make rehearse``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pardec.config import ModelConfig
from pardec.models.forward import compiled
from pardec.models.loading import load_model
from pardec.testing import VirtualCUDA
from pardec.testing.graphs import eager_cuda_graphs
from pardec.testing.virtual_gpus import main


def test_auto_on_a_virtual_gpu_replays_cuda_graphs_and_equals_ar(tmp_path):
    """(A process of its own: the Hydra app configures logging and the process's streams.)"""
    out = tmp_path / "run"
    run = subprocess.run([sys.executable, "-m", "pardec.testing.virtual_gpus", "--devices", "1", "evaluate",
                          "model=tiny_random", "model.device=cuda", "threads=1", "max_new_tokens=8", "n_samples=2",
                          "bench.warmup=0", "+method=pld", "dtype=fp32", f"hydra.run.dir={out}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    s = json.loads((out / "summary.json").read_text())
    assert s["forward_impl"] == "cudagraph" and s["exact_match_rate"] == 1.0 and s["n_errors"] == 0
    line = run.stderr.strip().splitlines()[-1]
    assert line.startswith("virtual-gpus: 1 device(s)")
    assert int(line.split(", ")[-1].split()[0]) >= 2  # one-token steps and verifications, each captured once
    assert compiled.CUDA_GRAPHS.capture is compiled._Graph and not torch.cuda.is_available()  # (this process's)


def test_a_split_target_spreads_over_two_virtual_devices(tmp_path):
    saved = tmp_path / "target"
    m = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu", layers=8, hidden=128))
    m.model.save_pretrained(saved)
    m.tokenizer.save_pretrained(saved)
    size = sum(f.stat().st_size for f in saved.glob("*.safetensors"))
    os.environ["HF_DEACTIVATE_ASYNC_LOAD"] = "1"  # (what the runner sets: the loader's threads see no torch mode)
    try:
        with VirtualCUDA(devices=2, memory=int(0.9 * size)), eager_cuda_graphs():
            split = load_model(ModelConfig(name="local", source="local", path=str(saved), device="cuda",
                                           device_map="auto", dtype="fp32"))
            assert set(split.model.hf_device_map.values()) == {0, 1}  # fits on two devices, not on one
            ids = torch.tensor([[5, 6, 7]], device="cuda:0")
            logits = split.model(ids).logits
    finally:
        del os.environ["HF_DEACTIVATE_ASYNC_LOAD"]
    assert torch.allclose(logits, m.model(torch.tensor([[5, 6, 7]])).logits, atol=1e-5)


def test_bad_arguments_are_one_line(capsys):
    for argv, bad in ((["--devices", "0", "evaluate"], "--devices=0"), (["train2"], "train2")):
        with pytest.raises(SystemExit):
            main(argv)
        assert bad in capsys.readouterr().err
