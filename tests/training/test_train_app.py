"""`python -m train`: config composition and validation, the cllm_tiny experiment end to end, resume, and a
2-rank DeepSpeed ZeRO-2 run through the deepspeed launcher and a ZeRO-3 one through torchrun (CPU, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig

from pardec import CONF_DIR, REPO_ROOT
from pardec.config import ConfigError, ModelConfig, composed
from pardec.models.loading import load_model
from pardec.train import experiments, run, validate
from pardec.training.cllm.trainer import CLLMConfig
from pardec.training.cllm.trajectories import load_trajectories
from pardec.training.stages import read_part


def _compose(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``; ``threads`` (torch threads, 2 by default) is the test's own
    (tests/conftest.py: 1 per pytest-xdist worker) unless given: a run sets it for its whole process, and two
    workers' runs of 2 threads each on 2 cores wait on each other's threads (many times slower on a busy machine)."""
    from tests.conftest import THREADS

    if not any(o.split("=")[0].lstrip("+~") == "threads" for o in overrides):
        overrides = [*overrides, f"threads={THREADS}"]
    return composed("train", overrides)


def _tiny(tmp_path: Path, *extra: str) -> DictConfig:
    return _compose(["+experiment=cllm_tiny", f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out",
                     *extra])


def _available(name: str) -> bool:
    text = (CONF_DIR / "experiment" / f"{name}.yaml").read_text()
    groups = [line.split("override /")[1].split(":") for line in text.splitlines() if "override /" in line]
    return all((CONF_DIR / g.strip() / f"{o.strip()}.yaml").is_file() for g, o in groups)


@pytest.mark.slow
@pytest.mark.parametrize("name", experiments())
def test_every_experiment_validates(name):
    if not _available(name):
        pytest.skip(f"experiment {name} names a model/dataset config that does not exist yet")
    gpu_recipe = _compose([f"+experiment={name}"]).get("device") == "cuda"
    if gpu_recipe:  # a GPU recipe on this CPU: one line, before anything loads; device=cpu rehearses it here
        with pytest.raises(ConfigError, match=f"experiment '{name}' runs on CUDA GPUs .*pass device=cpu"):
            validate(_compose([f"+experiment={name}"]))
    spec = validate(_compose([f"+experiment={name}"] + (["device=cpu"] if gpu_recipe else [])))
    assert spec.experiment == name and spec.device == ("cpu" if gpu_recipe else "auto")
    if gpu_recipe:
        assert spec.model.device == "cpu" and spec.model.name not in ("smollm2_135m", "tiny_random")
    prefix = name.split("_")[0]
    # one name: the prefix is the kind, or for kind drafter the drafter: heads_<medusa|firp> (Medusa's and FIRP's
    # heads), eagle3_ / dflash_ (named by the method)
    kind = {"eagle3": "drafter", "dflash": "drafter", "heads": "drafter"}.get(prefix, prefix)
    assert kind == _compose([f"+experiment={name}"]).kind
    if name.startswith("draft_"):  # kind: draft (tests/training/draft/ covers it)
        assert spec.gen.out_dir.endswith(f"completions/{name}/train")
        return
    if name.startswith(("eagle3_", "dflash_")):  # kind drafter, drafter.type eagle3 / dflash (tests/training/drafter/)
        assert spec.drafter["type"] == prefix
        assert spec.gen.out_dir.endswith((f"completions/{name}/train", "completions/draft_smollm2/train"))
        return
    if name.startswith("heads_"):  # kind: drafter (tests/training/drafter/ covers it)
        shared = "draft_" + name.split("_", 2)[2]  # the SmolLM2 ones reuse draft's data
        assert spec.drafter["type"] == name.split("_")[1]
        assert spec.gen.out_dir.endswith((f"completions/{name}/train", f"completions/{shared}/train"))
        return
    if name.startswith("sdsat_"):  # kind: sdsat (tests/training/sdsat/ covers it)
        assert spec.mask.out_dir.endswith(f"sdsat/{name}") and spec.eval_sources and spec.max_span >= 1
        return
    data = {"cllm_gsm8k_smollm2_budget": "cllm_gsm8k_smollm2_copies",  # shares another's data
            "cllm_gsm8k_smollm2_lora": "cllm_gsm8k_smollm2_copies"}.get(name, name)
    assert spec.collect.out_dir.endswith(f"trajectories/{data}") and spec.train_data == Path(spec.collect.out_dir)
    if name == "cllm_gsm8k_smollm2_budget":  # the copies recipe's data, the looping answers kept, a cheaper training
        copies = validate(_compose(["+experiment=cllm_gsm8k_smollm2_copies"]))
        assert spec.collect == copies.collect and spec.model == copies.model and spec.dataset == copies.dataset
        assert replace(spec.gen, batch_size=16) == copies.gen and (spec.ar_clean, copies.ar_clean) == (False, True)
        diff = {k: (copies.trainer.get(k), v) for k, v in spec.trainer.items() if copies.trainer.get(k) != v}
        assert diff.pop("bf16")[1] is True and diff == {"num_train_epochs": (1.5, 1.1), "eval_steps": (20, 50)}
    if name == "cllm_gsm8k_smollm2_lora":  # the budget recipe, LoRA on every block linear at rank 32 and its lr
        budget = validate(_compose(["+experiment=cllm_gsm8k_smollm2_budget"]))
        assert spec.collect == budget.collect and spec.gen == budget.gen and spec.model == budget.model
        assert spec.lora == {"enabled": True, "r": 32, "alpha": 64, "dropout": 0.05, "target_modules": [
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]} and budget.lora is None
        diff = {k: (budget.trainer.get(k), v) for k, v in spec.trainer.items() if budget.trainer.get(k) != v}
        assert diff == {"learning_rate": (2e-4, 1e-3), "bf16": (True, False)}  # fp32: hosts without bf16 too
    if name == "cllm_gsm8k_smollm2_copies":  # the SmolLM2 recipe with its named collection overrides, nothing else
        base = validate(_compose(["+experiment=cllm_gsm8k_smollm2"]))
        assert (spec.collect.augment, spec.collect.guess_from, spec.collect.max_prompts) == ("copies", "prompt", 480)
        assert (base.collect.augment, base.collect.guess_from) == ("in_place", "context")  # the paper's collection
        assert spec.gen.out_dir.endswith(f"completions/{name}/train") and spec.model == base.model
        assert (spec.collect.block_size, spec.collect.max_new_tokens) == (base.collect.block_size, 48)


def test_errors_name_the_choices():
    with pytest.raises(ConfigError, match="no experiment given.*cllm_gsm8k.*cllm_tiny"):
        validate(_compose([]))
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['bogus'\] in trainer"):
        validate(_compose(["+experiment=cllm_tiny", "+trainer.bogus=1"]))
    with pytest.raises(ConfigError, match="trainer.deepspeed='zero9' is not valid; choose one of: zero2, zero3"):
        validate(_compose(["+experiment=cllm_tiny", "trainer.deepspeed=zero9"]))
    with pytest.raises(ConfigError, match="distance='kl' is not valid; choose one of: fkl, rkl, jsd"):
        validate(_compose(["+experiment=cllm_tiny", "trainer.distance=kl"]))
    with pytest.raises(ConfigError, match="loss_type='both' is not valid"):
        CLLMConfig(output_dir="/tmp/unused", loss_type="both")
    with pytest.raises(ConfigError, match="stage='mask'"):
        validate(_compose(["+experiment=cllm_tiny", "stage=mask"]))
    with pytest.raises(ConfigError, match=r"stage=eval needs held-out prompts: eval.sources is empty"):
        validate(_compose(["+experiment=cllm_tiny", "stage=eval"]))  # before any model loads
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['blocks'\] in eval; valid: sources, block_size"):
        validate(_compose(["+experiment=cllm_tiny", "+eval.blocks=4"]))
    with pytest.raises(ConfigError, match="eval.block_size=0 is out of range: it must be an integer >= 1"):
        validate(_compose(["+experiment=cllm_tiny", "eval.block_size=0"]))
    with pytest.raises(ConfigError, match=r"eval.sources\[0\] must be \{dataset"):
        validate(_compose(["+experiment=cllm_tiny", "eval.sources=[{name: gsm8k}]"]))
    with pytest.raises(ConfigError, match="trainer.states_per_sample=0 is out of range: it must be >= 1"):
        validate(_compose(["+experiment=cllm_tiny", "trainer.states_per_sample=0"]))
    with pytest.raises(ConfigError, match="trainer.proxy_records=-1 is out of range: it must be >= 0"):
        validate(_compose(["+experiment=cllm_tiny", "trainer.proxy_records=-1"]))


@pytest.mark.parametrize("name", ["draft_tiny", "heads_medusa_tiny", "draft_llama2_7b", "heads_firp_llama2_7b"])
def test_zero3_is_refused_where_the_frozen_model_would_be_partitioned(name):
    """draft / drafter: the frozen teacher or target loads outside the engine, the drafter is saved from rank 0 whole:
    ZeRO-3 is refused at validation, before anything loads; ZeRO-2 is accepted."""
    with pytest.raises(ConfigError, match=r"trainer.deepspeed=zero3 is not supported by the (draft|drafter) kind.*zero2"):
        validate(_compose([f"+experiment={name}", "trainer.deepspeed=zero3", "device=cpu"]))
    assert validate(_compose([f"+experiment={name}", "trainer.deepspeed=zero2", "device=cpu"])).deepspeed.stem == "zero2"


@pytest.mark.slow  # two training runs
def test_tiny_end_to_end_with_lora_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    summary = run(_tiny(tmp_path, "trainer.lora.enabled=true", "trainer.lora.r=4"), run_dir)
    assert summary["collect"]["complete"] and summary["train"]["samples"] > 0
    assert summary["train"]["records"] == 5 and summary["train"]["proxy_records"] == 1  # one held out
    # the AR rows: whole answers of 20 tokens, the 8 past the 12 collected from stage generate
    assert summary["generate"]["complete"] and summary["generate"]["prompts"] == 6
    answers = summary["train"]["ar_answers"]
    assert (answers["extended"], answers["mismatched"], answers["ar_tokens"]) == (5, 0, 5 * 20), answers
    history = json.loads((run_dir / "log_history.json").read_text())
    proxy = [h for h in history if "eval_ff_proxy" in h]
    assert [h["step"] for h in proxy] == [1, 2]  # every eval step; the last one is the summary's, not redone
    assert all(h["eval_ff_proxy_states"] > 0 for h in proxy) and "eval_ff_proxy" in summary["train"]
    assert summary["train"]["eval_ff_proxy"] == proxy[-1]["eval_ff_proxy"]
    # the decoded proxy beside it: the held-out prompt decoded by jacobi (LoRA model), 12 collected tokens at most
    assert all(h["eval_ff_decode"] >= 1.0 and 0 < h["eval_ff_decode_tokens"] <= 12 for h in proxy)
    assert json.loads((run_dir / "train_summary.json").read_text())["experiment"] == "cllm_tiny"
    records = load_trajectories(tmp_path / "data" / "trajectories" / "cllm_tiny")
    assert len(records) == 6
    final = load_model(ModelConfig(name="local", source="local", path=str(run_dir / "final"), device="cpu"))
    base = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu"))
    ids = torch.tensor([records[0]["prompt_ids"]])
    assert not torch.allclose(final.model(ids).logits, base.model(ids).logits)  # merged LoRA weights
    assert final.tokenizer.eos_token == base.tokenizer.eos_token and final.model.config.use_cache

    # stage eval: skipped by stage=all without held-out prompts; with them, the final model and (eval.base) the base
    # Jacobi-decode them at the collected block and horizon, into cllm_eval.json and the summary's eval section
    assert summary["eval"] == {"skipped": "eval.sources is empty"}
    held = ("eval.sources=[{dataset: {name: gsm8k, path: '${paths.root_dir}/tests/training/data/gsm8k_tiny.jsonl', "
            "split: train}, max_prompts: 3}]")
    ev_summary = run(_tiny(tmp_path, "stage=eval", held, "eval.base=true"), run_dir)["eval"]
    ev = json.loads((run_dir / "cllm_eval.json").read_text())
    assert (ev["block_size"], ev["max_new_tokens"]) == (4, 12)
    per = ev["per_dataset"]["gsm8k"]
    for label in ("trained", "base"):
        runs = ev["prompts"]["gsm8k"][label]
        assert len(runs) == 3 and per[label]["prompts"] == 3 and all(1 <= r["fast_forward"] <= 4 for r in runs)
        assert per[label]["fast_forward"] == pytest.approx(sum(r["fast_forward"] for r in runs) / 3)
        assert per[label]["tokens"] == sum(r["tokens"] for r in runs) and 0 < per[label]["tokens"] <= 3 * 12
        assert per[label]["tokens_per_forward"] == pytest.approx(per[label]["tokens"] / per[label]["forwards"])
    assert ev_summary["fast_forward"] == ev["overall"]["trained"]["fast_forward"]
    assert ev_summary["base_fast_forward"] == ev["overall"]["base"]["fast_forward"]

    # full fine-tuning with checkpoints, then resumed from the latest one; collection is reused as is; the start's
    # evaluation (eval_on_start) runs once, not again at the step a resumed run starts from
    run(_tiny(tmp_path, "stage=all", "trainer.save_strategy=steps", "trainer.save_steps=1",
              "+trainer.eval_on_start=true"), run_dir)
    assert len(load_trajectories(tmp_path / "data" / "trajectories" / "cllm_tiny")) == 6
    assert json.loads((run_dir / "final" / "config.json").read_text())["use_cache"] is True
    run(_tiny(tmp_path, "stage=train", "trainer.max_steps=3", "trainer.save_strategy=steps", "trainer.save_steps=1",
              "trainer.resume_from_checkpoint=true", "+trainer.eval_on_start=true"), run_dir)
    state = json.loads((run_dir / "checkpoint-3" / "trainer_state.json").read_text())
    assert [h["step"] for h in state["log_history"] if "loss" in h] == [1, 2, 3]
    assert [h["step"] for h in state["log_history"] if "eval_ff_proxy" in h] == [0, 1, 2, 3]


def _torchrun(tmp_path: Path, *overrides: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "train",
           "+experiment=cllm_tiny", "threads=1", f"paths.data_dir={tmp_path}/data",
           f"paths.output_dir={tmp_path}/out", *overrides]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def _sharded_stages(tmp_path: Path) -> None:
    """Two ranks' collection and generation: each rank wrote its half, rank 0 merged them in order."""
    traj = tmp_path / "data" / "trajectories" / "cllm_tiny"
    assert [len(read_part(traj / f"part-{r}.jsonl")) for r in (0, 1)] == [3, 3]
    completions = tmp_path / "data" / "completions" / "cllm_tiny" / "train"
    assert [len(read_part(completions / f"part-{r}.jsonl")) for r in (0, 1)] == [3, 3]
    assert [r["index"] for r in load_trajectories(traj)] == list(range(6))


@pytest.mark.heavy  # torchrun: two gloo ranks, then a plain launch
def test_the_deepspeed_launcher_zero2_and_a_plain_python_launch(tmp_path):
    """The README's launch lines on CPU: `deepspeed --num_gpus 2 --module train ...` (it appends --local_rank=N; both
    ranks find one run dir, the experiment's `default`) and `python -m train ... trainer.deepspeed=zero2` with
    no launcher at all (rank 0 of 1, no MPI discovery).

    The 2-rank launch (gloo) is also the ZeRO-2 run: sharded collection merged by rank 0, then ZeRO-2 training with
    checkpoints; both ranks agree on the run dir; rank 0 alone writes .hydra and final/. (torchrun: the ZeRO-3 runs
    below and tests/training/sdsat/test_sdsat.py, with the same sharded-collection checks.)"""
    import shutil

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT / "src")}
    common = ["+experiment=cllm_tiny", "threads=1", f"paths.data_dir={tmp_path}/data", "trainer.deepspeed=zero2"]
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent))
    assert launcher, "the deepspeed launcher is installed with deepspeed"
    cmd = [launcher, "--num_gpus", "2", "--module", "train", *common, "stage=all", "trainer.save_strategy=steps",
           "trainer.save_steps=2", f"paths.output_dir={tmp_path}/ds"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "ds" / "train" / "runs" / "cllm_tiny").iterdir()
    assert run_dir.name == "default"  # the experiment's run_name: a relaunch finds the same dir
    # marked complete by rank 0 once both ranks had saved (rank 1's optimizer shard and RNG state included)
    files = json.loads((run_dir / "checkpoint-2" / "pardec-complete.json").read_text())["files"]
    assert {"global_step2/zero_pp_rank_1_mp_rank_00_optim_states.pt", "rng_state_1.pth"} <= set(files)
    assert (run_dir / ".hydra").is_dir() and (run_dir / "train-rank1.log").is_file()
    assert (run_dir / "final" / "config.json").is_file()
    summary = json.loads((run_dir / "train_summary.json").read_text())
    assert summary["collect"]["complete"] and summary["train"]["samples"] > 0
    assert summary["train"]["records"] == 5 and summary["train"]["proxy_records"] == 1  # one held out
    assert summary["generate"]["complete"] and summary["train"]["ar_answers"]["extended"] == 5
    history = json.loads((run_dir / "log_history.json").read_text())
    proxy = [h for h in history if "eval_ff_proxy" in h]
    assert [h["step"] for h in proxy] == [1, 2]  # every eval step; the last one is the summary's, not redone
    assert all(h["eval_ff_proxy_states"] > 0 for h in proxy) and "eval_ff_proxy" in summary["train"]
    assert all(h["eval_ff_decode"] >= 1.0 for h in proxy)  # both ranks decoded the held-out prompt in step
    _sharded_stages(tmp_path)

    cmd = [sys.executable, "-m", "train", *common, "stage=train", f"paths.output_dir={tmp_path}/plain"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "mpi4py" not in proc.stderr, proc.stderr[-3000:]
    (run_dir,) = (tmp_path / "plain" / "train" / "runs" / "cllm_tiny").iterdir()
    assert (run_dir / "final" / "config.json").is_file()


def test_stage_by_stage_summaries_keep_the_earlier_stages_until_they_go_stale():
    from pardec.train import merge_stage_summaries

    stages = ("generate", "train", "eval")
    head = {"experiment": "x", "kind": "draft"}
    gen = merge_stage_summaries({}, {**head, "stage": "generate", "generate": {"prompts": 3}}, stages)
    train = merge_stage_summaries(gen, {**head, "stage": "train", "train": {"steps": 5}}, stages)
    ev = merge_stage_summaries(train, {**head, "stage": "eval", "eval": {"agreement": 0.5}}, stages)
    assert ev == {**head, "stage": "eval", "stages": list(stages), "generate": {"prompts": 3},
                  "train": {"steps": 5}, "eval": {"agreement": 0.5}}
    # retraining makes the old eval stale: it goes, generate stays
    again = merge_stage_summaries(ev, {**head, "stage": "train", "train": {"steps": 9}}, stages)
    assert again["stages"] == ["generate", "train"] and again["train"] == {"steps": 9} and "eval" not in again
    assert merge_stage_summaries(ev, {**head, "stage": "all", **{s: {} for s in stages}}, stages)["eval"] == {}


def test_shared_launch_ids():
    from pardec.config import shared_launch_id

    assert shared_launch_id({"TORCHELASTIC_RUN_ID": "0123456789ab"}) == "torchrun-01234567"
    assert shared_launch_id({"CROSS_SIZE": "1", "MASTER_PORT": "29500"}) == f"deepspeed-{os.getppid()}-29500"
    assert shared_launch_id({"CROSS_SIZE": "2", "MASTER_PORT": "29500"}) is None  # several nodes: no shared parent
    assert shared_launch_id({"TORCHELASTIC_RUN_ID": "none"}) is None and shared_launch_id({}) is None


@pytest.mark.heavy  # torchrun: two gloo ranks
def test_deepspeed_zero3_loads_a_local_model_sharded(tmp_path):
    """ZeRO-3 with a from_pretrained model (zero.Init while loading), LoRA, merged into final/ by rank 0."""
    local = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu"))
    local.model.save_pretrained(tmp_path / "base")
    local.tokenizer.save_pretrained(tmp_path / "base")
    _torchrun(tmp_path, "stage=all", "trainer.deepspeed=zero3", "model=local", f"model.path={tmp_path}/base",
              "trainer.lora.enabled=true")
    (run_dir,) = (tmp_path / "out" / "train" / "runs" / "cllm_tiny").iterdir()
    final = load_model(ModelConfig(name="local", source="local", path=str(run_dir / "final"), device="cpu"))
    changed = [k for k, v in local.model.state_dict().items() if not torch.equal(v, final.model.state_dict()[k])]
    assert changed and all("proj" in k for k in changed)  # LoRA targets only
    history = json.loads((run_dir / "log_history.json").read_text())  # the decoded proxy ran on sharded weights
    assert [h["eval_ff_decode"] >= 1.0 for h in history if "eval_ff_proxy" in h] == [True] * 2
    _sharded_stages(tmp_path)  # torchrun's ranks: collection sharded and merged as under the deepspeed launcher


def test_deepspeed_on_the_cpu_uses_gloo_allreduce_and_builds_no_op(monkeypatch):
    """A DeepSpeed run on the CPU never compiles DeepSpeed's shared-memory allreduce (a C++ op built on first use,
    ~75 s on two cores): after :func:`without_shm_allreduce`, DeepSpeed's own ``build_shm_op`` returns None."""
    import importlib

    import deepspeed.ops

    from pardec.training.base import without_shm_allreduce

    monkeypatch.setitem(deepspeed.ops.__compatible_ops__, "deepspeed_shm_comm",
                        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"])  # restored after the test
    without_shm_allreduce()
    assert importlib.import_module("deepspeed.comm.torch").build_shm_op() is None
