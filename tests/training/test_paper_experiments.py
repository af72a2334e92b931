"""The CLLM paper-scale experiments (cllm_gsm8k, cllm_spider, cllm_code): the paper's targets and settings compose and
validate (no weights, no network: training validation reads no model file), and each file documents its launch
command and the GPU memory it expects."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from pardec import CONF_DIR
from pardec.train import validate
from tests.training.test_train_app import _compose

# The CLLM paper's targets (github.com/hao-ai-lab/Consistency_LLM README.md, "Target Pre-trained Models"): ABEL-7B-001
# for GSM8K; DeepSeek-Coder-7B-Instruct fine-tuned by the authors on Spider and on Code-Search-Net Python.
TARGETS = {
    "cllm_gsm8k": ("abel_7b_001", "GAIR/Abel-7B-001", "gsm8k"),
    "cllm_spider": ("deepseek_coder_7b_instruct_spider", "cllm/deepseekcoder-7b-instruct-spider", "spider"),
    "cllm_code": ("deepseek_coder_7b_instruct_code", "cllm/deepseekcoder_7b_codesearch_net_python", "code_search_net"),
}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_cllm_paper_experiments_use_the_papers_targets_and_settings(name):
    config, path, dataset = TARGETS[name]
    cfg = _compose([f"+experiment={name}", "device=cpu"])  # a GPU recipe (device: cuda), validated on this CPU
    spec = validate(cfg)
    assert (spec.model.name, spec.model.path, spec.model.source) == (config, path, "hub")
    assert spec.model.dtype == "bf16" and spec.dataset.name == dataset and spec.dataset.split == "train"
    assert spec.collect.block_size == 16  # n = 16 (data/generate_trajectory.py)
    t = spec.trainer
    assert (t["loss_type"], t["ar_weight"], t["learning_rate"], t["num_train_epochs"], t["lr_scheduler_type"],
            t["warmup_steps"], t["per_device_train_batch_size"], t["bf16"]) == (
        "global", 10.0, 2.0e-5, 1, "cosine", 0.03, 1, True)
    assert spec.deepspeed is not None and spec.deepspeed.name == "zero3.json" and spec.lora is None


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_cllm_paper_experiments_document_launch_and_gpu_memory(name):
    header = (CONF_DIR / "experiment" / f"{name}.yaml").read_text().split("\ndefaults:")[0]
    assert f"torchrun --standalone --nproc_per_node 8 -m train +experiment={name}" in header
    assert "GPU memory per GPU (estimate" in header and "ZeRO-3 over 8 GPUs" in header and " GB" in header


@pytest.mark.slow  # a subprocess (~6 s)
def test_cli_cfg_job_prints_the_experiment(tmp_path):
    """The issue's check, literally: `python -m train +experiment=cllm_gsm8k --cfg job` composes (exit 0) and prints
    the paper's target and settings."""
    p = subprocess.run([sys.executable, "-m", "train", "+experiment=cllm_gsm8k", "--cfg", "job", "--resolve"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert (cfg["kind"], cfg["experiment_name"], cfg["model"]["path"]) == ("cllm", "cllm_gsm8k", "GAIR/Abel-7B-001")
    assert cfg["collect"]["block_size"] == 16 and cfg["trainer"]["learning_rate"] == 2.0e-5
