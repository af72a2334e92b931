"""pardec.bench.gpu_smoke (`python -m pardec.bench gpu-smoke`) runs on the CPU (``--device cpu``) as a test of itself: every method in both dtypes, with
tokens-exact methods equal to `ar` in fp32, and two training steps of an experiment kind."""

from __future__ import annotations

import json

import pytest
import torch

from pardec.bench import gpu_smoke as smoke
from pardec.bench import gpu_speed as speed


@pytest.mark.heavy  # every method, both dtypes, a sharded evaluate
def test_gpu_smoke_runs_on_cpu(tmp_path):
    from pardec.decoding import METHODS

    rc = smoke.main(["--device", "cpu", "--model", "tiny_random", "--new-tokens", "8", "--kinds", "cllm",
                     "--forward-impls", "hf,lean", "--out", str(tmp_path)])  # (compiled: tests/models/forward/test_compiled.py)
    out = json.loads((tmp_path / "gpu_smoke.json").read_text())
    assert rc == 0, [r for r in out["decoding"] + out["training"] if "problem" in r]
    assert {(r["method"], r["dtype"], r["forward_impl"]) for r in out["decoding"]} == {
        (m, d, i) for m in METHODS.names() for d in ("fp32", "bf16") for i in ("hf", "lean")}
    assert all(r["ok"] for r in out["decoding"])
    assert all("speed_vs_hf_ar" in r for r in out["decoding"] if (r["method"], r["forward_impl"]) == ("ar", "lean"))
    assert out["training"] == [{**out["training"][0], "kind": "cllm", "ok": True, "steps": 2}]
    assert out["sharded_evaluate"] == {"skipped": "needs 2 CUDA devices"}
    md = (tmp_path / "gpu_smoke.md").read_text()
    assert "| sps | fp32 | hf |" in md and "| sps | fp32 | lean |" in md


def test_gpu_smoke_refuses_cuda_without_a_gpu_and_unknown_kinds(tmp_path, capsys):
    with pytest.raises(SystemExit):
        smoke.main(["--device", "cuda"])
    assert "no CUDA device is available here; use --device cpu" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        smoke.main(["--device", "cpu", "--kinds", "cllm,bogus"])
    assert "--kinds ['bogus'] not valid; choose from: cllm, draft" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        smoke.main(["--device", "cpu", "--forward-impls", "hf,fast"])
    assert "--forward-impls ['fast'] not valid; choose from: hf, lean" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        smoke.main(["--device", "cpu", "--dtypes", "fp32,fp16"])
    assert "--dtypes ['fp16'] not valid; choose from: fp32, bf16" in capsys.readouterr().err


def test_gpu_speed_runs_on_cpu_as_a_test_of_itself(tmp_path):
    """pardec.bench.gpu_speed on the CPU with its tiny shape: the cost table, `generate()` and `ar` on each forward,
    the same tokens (fp32), no sync counts off CUDA, and both files written."""
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        rc = speed.main(["--device", "cpu", "--shapes", "tiny", "--dtype", "fp32", "--tf32", "off", "--new-tokens", "12",
                         "--context", "40", "--sizes", "1,2,4", "--repeats", "2", "--impls", "hf,lean",
                         "--cost-impls", "lean,cudagraph", "--methods", "ar,pld,jacobi", "--out", str(tmp_path)])
        assert torch.backends.cuda.matmul.allow_tf32 is False  # --tf32 off reached pardec's switch
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert rc == 0
    out = json.loads((tmp_path / "gpu_speed.json").read_text())
    assert out["tf32"] == "off"
    (shape,) = out["shapes"]
    assert shape["shape"] == "tiny" and set(shape["cost_ms"]) == {"1", "2", "4"}  # (hf: measured as the reference)
    assert set(shape["cost_ms_by_impl"]["lean"]) == {"1", "2", "4"}
    assert "needs a model on a CUDA device" in shape["cost_ms_by_impl"]["cudagraph"]["problem"]
    rows = shape["decoding"]
    assert [(r["method"], r["forward_impl"]) for r in rows] == [
        ("hf_generate", "hf"), ("ar", "hf"), ("ar", "lean"), ("pld", "hf"), ("pld", "lean"), ("jacobi", "hf"),
        ("jacobi", "lean")]
    assert all(r["ok"] and r["tokens"] == 12 and r["same_as_generate"] and r["syncs"] is None for r in rows)
    assert all(r["tokens_per_forward"] >= 1 and r["ms_per_forward"] > 0 and r["graphed_forwards"] == 0 for r in rows)
    md = (tmp_path / "gpu_speed.md").read_text()
    assert "| ar | lean |" in md and "| jacobi | lean |" in md and "forward of T new rows" in md
    assert "fp32 (TF32 off), random weights" in md
    assert "| lean | " in md and "| cudagraph | ValueError: forward_impl=cudagraph" in md


def test_gpu_speed_refuses_unknown_shapes_and_cuda_without_a_gpu(capsys):
    with pytest.raises(SystemExit):
        speed.main(["--device", "cpu", "--shapes", "7b,13b"])
    assert "--shapes ['13b'] not valid; choose from: tiny, smollm2, 1b, 7b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        speed.main(["--device", "cpu", "--shapes", "tiny", "--methods", "ar,sps"])
    assert "--methods ['sps'] not valid; choose from: ar, pld, jacobi, lookahead" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        speed.main(["--device", "cuda"])
    assert "no CUDA device is available here; --device cpu runs it as a test" in capsys.readouterr().err


def test_count_cuda_syncs_runs_the_function_and_counts_nothing_off_cuda():
    from pardec.testing import count_cuda_syncs

    assert count_cuda_syncs(lambda: 7, "cpu") == (7, None)
