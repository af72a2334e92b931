"""`python -m pardec.plan`: per-GPU memory of the paper recipes from their real architectures on the meta device
(conf/model_configs/*/config.json; no weights, no network)."""

from __future__ import annotations

import json
import re

import pytest

from pardec import CONF_DIR
from pardec import plan as P
from pardec.config import ConfigError
from pardec.recipes import hub_id, shipped_config

BIG = P.matching(["*7b*", "*13b*", "*33b*", "*34b*"])
TRAIN = sorted(set(BIG) | {n for n in P.paper_recipes() if P.recipes()[n] == "train"})
YI = sorted(n for n in P.recipes() if n.startswith("ouroboros_yi34b_"))


def test_the_size_patterns_find_the_gpu_recipes():
    assert {"draft_llama2_7b", "heads_firp_llama2_7b", "heads_medusa_vicuna7b", "sdsat_codellama7b"} <= set(BIG)
    assert {"cllm_gsm8k", "cllm_code", "cllm_spider", "cllm_sharegpt"} <= set(TRAIN)  # 7B targets, unsized names
    assert len(YI) == 4


@pytest.mark.parametrize("name", TRAIN)
def test_every_gpu_training_recipe_fits_80gb_at_its_world(name):
    p = P.plan(name)
    assert p.world == P.launch_world(name) == 8  # the documented `torchrun --nproc_per_node 8` launch line
    assert p.zero in (2, 3) and p.params > 6e9
    assert p.fits(80), P.table([p])


@pytest.mark.parametrize("name", YI)
def test_ouroboros_yi_recipes_fit_the_gpus_their_header_states(name):
    header = (CONF_DIR / "recipe" / f"{name}.yaml").read_text()
    header = " ".join(line.lstrip("# ") for line in header.splitlines() if line.startswith("#"))
    assert "Two 80 GB GPUs" in header and "one 141 GB GPU" in header  # what the recipe promises
    one, two = P.plan(name), P.plan(name, gpus=2)
    assert one.fits(141) and two.fits(80)
    assert not one.fits(80) and one.gpus_needed[80] == 2  # one 80 GB GPU is not enough, as the header says
    assert P._fit_cell(one, 80) == "2 GPUs" and P._fit_cell(one, 141) == "yes"


@pytest.mark.parametrize(("hub_id", "published"), [("meta-llama/Llama-2-7b-chat-hf", 6.74e9), ("01-ai/Yi-34B", 34.4e9),
                                                    ("meta-llama/Llama-2-13b-hf", 13.0e9),
                                                    ("deepseek-ai/deepseek-coder-33b-instruct", 33.3e9)])
def test_parameter_counts_match_the_published_sizes(hub_id, published):
    assert abs(P.arch(hub_id).params - published) / published < 0.01


def test_every_hub_model_a_recipe_can_pick_has_a_shipped_config():
    for group in ("model", "draft"):
        for path in (CONF_DIR / group).glob("*.yaml"):
            hub = hub_id(path.stem, group)
            if hub and hub != "???":
                assert shipped_config(hub).is_file(), f"{group}/{path.name}: ship {shipped_config(hub)}"


def test_a_bad_recipe_name_is_one_line_naming_it_and_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        P.main(["draft_llama2_7bb"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: unknown recipe 'draft_llama2_7bb'")
    assert "Did you mean 'draft_llama2_7b'?" in err and "Valid recipes:" in err
    assert "sdsat_codellama7b" in err and "ouroboros_yi34b_gsm8k" in err


def test_a_cpu_recipe_is_refused_naming_its_model():
    with pytest.raises(ConfigError, match=r"'cllm_tiny' runs model 'tiny_random' \(source tiny_random\).*sdsat_codellama7b"):
        P.plan("cllm_tiny")


@pytest.mark.parametrize("name", ["sdsat_codellama7b", "cllm_gsm8k"])
def test_zero3_needs_less_per_gpu_than_zero2(name):
    z2, z3 = (P.plan(name, overrides=[f"trainer.deepspeed={z}"]) for z in ("zero2", "zero3"))
    assert (z2.zero, z3.zero) == (2, 3)
    assert z3.total < z2.total
    assert z3.components["weights"] == pytest.approx(z2.components["weights"] / 8)
    assert z3.components["gathered"] == 2e9 and z2.components["gathered"] == 0  # stage3_max_live_parameters x 2 B


def test_zero2_shards_grads_and_adam_states_over_the_world():
    p8, p4 = P.plan("sdsat_codellama7b"), P.plan("sdsat_codellama7b", world=4)
    n = p8.trainable
    assert p8.components["optimizer"] == pytest.approx(12 * n / 8) and p4.components["optimizer"] == pytest.approx(12 * n / 4)
    assert p8.components["grads"] == pytest.approx((2 + 4) * n / 8)  # 16-bit and fp32 gradient partitions
    assert p8.components["weights"] == p4.components["weights"] == pytest.approx(2 * n)  # replicated in bf16
    ddp = P.plan("sdsat_codellama7b", overrides=["trainer.deepspeed=null", "trainer.model_dtype=fp32"])
    assert ddp.zero == 0 and ddp.components["optimizer"] == pytest.approx(8 * n)  # m + v, the fp32 params are the master


def test_frozen_models_and_trainable_drafters():
    draft = P.plan("draft_llama2_7b")
    assert draft.components["frozen"] == pytest.approx(2 * draft.params)  # the bf16 teacher on every rank
    assert 0.5e9 < draft.trainable < 1.5e9  # 4 layers + a 32000-row head; the embeddings frozen
    medusa = P.plan("heads_medusa_vicuna7b")
    assert medusa.trainable == 5 * (4096 * 4096 + 4096 + 4096 * 32000)  # 5 x (ResBlock + LM-head copy)
    firp = P.plan("heads_firp_llama2_7b")
    assert firp.trainable == 3 * (4096 * 4096 + 4096) and firp.components["kv"] > 0
    lora = P.plan("sdsat_codellama7b", overrides=["trainer.lora.enabled=true"])
    assert lora.trainable == 32 * 16 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    assert lora.total < P.plan("sdsat_codellama7b").total
    dflash, reduced = P.plan("dflash_llama31_8b"), P.plan("dflash_llama31_8b", overrides=["+drafter.draft_vocab_size=32000"])
    assert reduced.trainable - dflash.trainable == 32000 * 4096  # its own head over 32000 ids
    assert reduced.components["logits"] < dflash.components["logits"] / 3  # the slots' logits over 32000 of 128256


def test_activation_formula_follows_korthikanti_with_the_gated_mlp():
    a = P.arch("meta-llama/Llama-2-7b-chat-hf")
    assert a.gated and a.intermediate == 11008
    per = 17 * 4096 + 8 * 11008  # attention 11h + norms 4h + the gated MLP 2h + 8i (34h for a 4h GELU MLP)
    assert P.layer_activations(2048, 2048, a, 2, eager=False) == 2048 * per
    assert P.layer_activations(2048, 2048, a, 2, eager=True) == 2048 * (per + 5 * 32 * 2048)
    full = P.stack_activations(32, 2048, 2048, a, 2, False, checkpointing=False)
    ckpt = P.stack_activations(32, 2048, 2048, a, 2, False, checkpointing=True)
    assert full == 32 * 2048 * per and ckpt == 32 * 2048 * 4096 * 2 + 2048 * per
    gelu = P.Arch(**{**a.__dict__, "gated": False})
    assert P.layer_activations(2048, 2048, gelu, 2, eager=False) == 34 * 2048 * 4096


@pytest.mark.parametrize("name", ["sdsat_codellama7b", "heads_medusa_vicuna7b", "cllm_gsm8k"])
def test_model_states_agree_with_deepspeeds_estimators(name):
    """weights + grads + optimizer of a full fine-tune under ZeRO-2 and ZeRO-3 equal DeepSpeed's own estimate
    (estimate_zero2/3_model_states_mem_needs, no offload) within 5%; ZeRO-3's gathered parameters are planned on top."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for zero in ("zero2", "zero3"):
        p = P.plan(name, overrides=[f"trainer.deepspeed={zero}", "trainer.lora.enabled=false"]
                   if name.startswith("sdsat") else [f"trainer.deepspeed={zero}"])
        states = sum(p.components[k] for k in ("weights", "grads", "optimizer"))
        module = p.components["weights"] / 2 * (p.world if zero == "zero3" else 1)
        if p.trainable != module:  # a drafter beside a frozen base: DeepSpeed's estimate is of the trained module
            continue
        if zero == "zero2":
            ds = estimate_zero2_model_states_mem_needs(p.trainable, p.world, 1, cpu_offload=False)[1]
        else:
            ds = estimate_zero3_model_states_mem_needs(p.trainable, 0, p.world, 1, cpu_offload=False)[1]
        assert states == pytest.approx(ds, rel=0.05), (name, zero)


@pytest.mark.skipif(not __import__("pardec.metrics.memory", fromlist=["available"]).available(),
                    reason="measures with glibc's mallinfo2")
@pytest.mark.parametrize("loss", sorted(P.LOSS_PEAK))
@pytest.mark.parametrize("logit_bytes", [4, 2])
def test_each_loss_peak_is_the_measured_one(loss, logit_bytes):
    """LOSS_PEAK[loss] within 15% of the peak the real loss code holds, forward + backward, over logits
    [2, 256, 8192] in that dtype (pardec.metrics.memory), in fp32 copies of the logits: a training step's, after
    the first."""
    import torch

    from pardec.metrics.memory import peak_bytes
    from pardec.training.drafter.dflash import slot_nll
    from pardec.training.drafter.eagle import soft_ce
    from pardec.training.losses import ar_loss, ce_sum, token_divergence

    r, t, v = 2, 256, 8192
    g = torch.Generator().manual_seed(0)
    dtype = {4: torch.float32, 2: torch.bfloat16}[logit_bytes]
    logits = torch.randn(r, t, v, generator=g).to(dtype).requires_grad_(True)
    teacher = torch.randn(r, t, v, generator=g).to(dtype)
    labels = torch.randint(0, v, (r, t), generator=g)

    def soft(x):
        with torch.no_grad():
            p = teacher.float().log_softmax(-1).exp()
        return soft_ce(x, p)[1].sum()

    def dflash(x):
        logq, nll = slot_nll(x, labels)
        with torch.no_grad():
            (logq.argmax(-1) == labels).sum()
        return nll.sum()

    path = {"ce": lambda x: ar_loss(x, labels), "ce_smoothed": lambda x: ar_loss(x, labels, label_smoothing=0.1),
            "ce_sum": lambda x: ce_sum(x, labels, torch.ones(r, t, dtype=torch.bool))[0],
            "kl": lambda x: token_divergence(x, teacher).sum(), "soft_ce": soft, "dflash": dflash}[loss]
    path(logits).backward()  # once first: a first call also holds one-time buffers (up to 1.5 copies more)
    logits.grad = None
    measured = peak_bytes(lambda: path(logits).backward()) / (r * t * v * 4)
    assert P.LOSS_PEAK[loss] == pytest.approx(measured, rel=0.15), measured


def test_eval_kv_cache_and_weights():
    p = P.plan("mjsd_llama2_13b_cnn_dm", prompt_tokens=500)
    context = 500 + 128 + P.CONTEXT_MARGIN
    draft_kv = context * 2 * 2 * 12 * 64 * 2 * 8  # llama-68m x 8 beams
    assert p.components["kv"] == pytest.approx(context * 2 * 40 * 40 * 128 * 2 + draft_kv)
    assert p.components["weights"] == pytest.approx(2 * (p.params + P.arch("JackFram/llama-68m").params))
    assert p.fits(40) and not p.gpus_needed  # no device_map: no split


def test_an_eval_plan_holds_a_kv_cache_row_per_batched_prompt():
    one = P.plan("mjsd_llama2_13b_cnn_dm", prompt_tokens=500)
    eight = P.plan("mjsd_llama2_13b_cnn_dm", prompt_tokens=500, batch=8)
    target_row, draft_row = 2 * 40 * 40 * 128 * 2, 2 * 2 * 12 * 64 * 2  # Llama-2-13B, llama-68m: bytes per token
    context = one.components["kv"] / (target_row + 8 * draft_row)  # batch 1: the draft's cache x 8 beams
    # batched mjsd searches every prompt's beams without keeping them in the cache: one draft row per prompt
    assert eight.components["kv"] == pytest.approx(context * 8 * (target_row + draft_row))
    assert eight.components["weights"] == one.components["weights"]
    assert eight.components["activations"] == one.components["activations"]  # prompts prefilled one at a time
    assert any("batch 8" in n for n in eight.notes)
    with pytest.raises(ConfigError, match=r"batch=0 must be an integer >= 1"):
        P.plan("mjsd_llama2_13b_cnn_dm", batch=0)
    with pytest.raises(ConfigError, match="plans an evaluation decoding several prompts at once"):
        P.plan("cllm_gsm8k", batch=4)


def test_the_draft_cache_rows_are_what_the_batched_method_takes():
    """Over a batch, the draft's cache rows are the batched method's (BatchedMethod.draft_rows): spectr grows each
    prompt's k sequences in k rows, mjsd keeps no beam in the cache; batch 1: one row (MJSD: one per beam)."""
    rows = P.plans._draft_rows
    assert rows({"name": "spectr", "k": 3, "gamma": 4}, 4) == 12
    assert rows({"name": "spectr"}, 2) == 8  # its default k = 4
    assert rows({"name": "mjsd", "num_beams": 8}, 4) == 4
    assert rows({"name": "mjsd", "num_beams": 8}, 1) == 8
    assert rows({"name": "sps", "gamma": 5}, 4) == 4
    assert rows({"name": "ouroboros", "gamma": 12}, 4) == 4  # (no batched form: evaluate refuses it at batch > 1)


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    P.main(["draft_llama2_7b", "ouroboros_dscoder33b_humaneval", "--json", str(out)])
    text = capsys.readouterr().out
    assert re.search(r"^recipe\s+kind\s+world\s+ZeRO\s+params\s+weights", text, re.M)
    assert re.search(r"^draft_llama2_7b\s+draft\s+8\s+2\s+6\.74B", text, re.M)
    assert "GB = 1e9 bytes" in text
    rows = json.loads(out.read_text())
    assert [r["recipe"] for r in rows] == ["draft_llama2_7b", "ouroboros_dscoder33b_humaneval"]
    assert set(rows[0]["components_gb"]) == set(P.COMPONENTS) and rows[0]["fits"]["80"] is True
    assert rows[0]["total_gb"] == pytest.approx(sum(rows[0]["components_gb"].values()), abs=0.01)
    assert rows[1]["gpus_needed"]["80"] == 1 and rows[1]["world"] == 1


def test_help_works(capsys):
    with pytest.raises(SystemExit) as e:
        P.main(["--help"])
    assert e.value.code == 0 and "--all" in capsys.readouterr().out


def test_configs_resolve_with_the_gpu_defaults_on_any_machine():
    import torch

    before = torch.cuda.is_available()
    _, cfg = P.compose("draft_smollm2")  # sets neither dtype nor trainer.bf16
    assert cfg["dtype"] == "bf16" and cfg["trainer"]["bf16"] is True and cfg["model"]["dtype"] == "bf16"
    assert torch.cuda.is_available() == before


@pytest.mark.parametrize("name", ["cllm_abel7b_gsm8k", "cllm_vicuna7b_mt_bench", "sdsat_codellama7b_humaneval"])
def test_a_recipe_of_a_trained_model_is_planned_on_its_experiments_architecture(name):
    """An evaluation recipe that reads a run dir (``.../train/runs/<experiment>/default/final``) is planned on the
    architecture of the model that experiment trains (its weights are not at hand before training)."""
    assert name in P.paper_recipes()
    p = P.plan(name)
    assert 6.7e9 < p.params < 6.8e9 and p.fits(40)


def test_a_result_file_keeps_each_table_with_its_command(tmp_path, capsys):
    out = tmp_path / "plans.json"
    P.main(["sdsat_codellama7b", "--result", f"{out}#one"])
    P.main(["cllm_gsm8k", "--set", "trainer.deepspeed=zero2", "--result", f"{out}#two"])
    data = json.loads(out.read_text())
    assert set(data["tables"]) == {"one", "two"} and data["transcribed"] is False and data["date"]
    two = data["tables"]["two"]
    assert two["command"] == f"python -m pardec.plan cllm_gsm8k --set trainer.deepspeed=zero2 --result '{out}#two'"
    assert two["rows"][0][:4] == ["cllm_gsm8k", "cllm", "8", "2"] and len(two["columns"]) == len(two["rows"][0])


def test_the_data_generation_stages_are_planned_in_the_order_a_recipe_runs_them():
    """--stages: CLLM's Jacobi collection and whole answers before its train stage; a draft recipe's completions
    before and its held-out completions after; each the whole target in the run's dtype, one batch's KV cache and
    the logits that decoding keeps."""
    plans = P.stage_plans("cllm_gsm8k")
    kinds = [p.kind for p in plans]
    assert kinds[0] == "collect" and kinds[-1] == "cllm" and set(kinds) <= {"collect", "generate", "cllm"}
    collect, train = plans[0], plans[-1]
    from pardec.plan.compose import compose as compose_recipe

    cfg = compose_recipe("cllm_gsm8k", [])[1]["collect"]
    a = P.arch(collect.model)
    b, n = int(cfg["batch_size"]), int(cfg["block_size"])
    assert collect.components["weights"] == pytest.approx(a.params * 2)  # bf16, whole on every rank
    assert collect.components["logits"] == pytest.approx(b * n * a.vocab * 4)
    assert collect.components["grads"] == collect.components["optimizer"] == 0 and collect.world == train.world
    assert collect.components["kv"] > 0 and collect.world == 8
    draft = [p.kind for p in P.stage_plans("draft_llama2_7b")]
    assert draft == ["generate", "draft", "heldout"]
    gen = P.stage_plans("draft_llama2_7b")[0]
    topk = P.stage_plans("draft_llama2_7b", overrides=["completions.teacher_topk=8"])[0]
    assert topk.components["logits"] > gen.components["logits"] * 100  # every step's logits kept
    assert [p.kind for p in P.stage_plans("mjsd_llama2_13b_cnn_dm")] == ["eval"]  # an evaluation: one row


def test_cli_plans_the_stages_when_asked(capsys):
    P.main(["draft_llama2_7b", "--stages"])
    text = capsys.readouterr().out
    assert re.search(r"^draft_llama2_7b\s+generate\s+8\s+-", text, re.M)
    assert re.search(r"^draft_llama2_7b\s+heldout\s+8\s+-", text, re.M)
