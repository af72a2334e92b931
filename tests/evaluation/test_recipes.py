"""Paper-scale recipes (`python -m evaluate +recipe=<name>`, conf/recipe/): each composes, passes validation with the
paper's values, and documents its launch command and GPU memory. No weights and no network: the one check that
needs the hub (the models can be had, the draft shares the target's tokenizer) is recorded instead of run, and
shown to fail in one line offline, as it would on a machine without the weights."""

from __future__ import annotations

import pytest
import torch
import yaml

from pardec import CONF_DIR
from pardec.config import ConfigError, check_overrides
from pardec.evaluation import spec as spec_module
from pardec.evaluation.spec import validate
from pardec.models import preflight
from tests.evaluation.helpers import cfg_of, run_cli

RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))

#: (target hub id, draft hub id) of each model pair
YI = ("01-ai/Yi-34B", "01-ai/Yi-6B")
DSC = ("deepseek-ai/deepseek-coder-33b-instruct", "deepseek-ai/deepseek-coder-1.3b-instruct")
LLAMA = ("meta-llama/Llama-2-13b-hf", "JackFram/llama-68m")

# The papers' values, from the official code (github.com/thunlp/Ouroboros @ 7dac65b, benchmark/test_<task>.py:
# argparse defaults and launch lines; K = topk=3, the default of ouroboros/ouroboros.py) and MJSD (Appendix D,
# Table 5: tau = 0.1; github.com/ZongyueQin/MJSD @ bb00dc9, evaluation.py: (gamma, width, beams) = (4, 1, 8), top-k
# 20, top-p 0.9, 128 tokens, the first 100 prompts, 4 repeats). The recipe files cite file and line for each.
OUROBOROS = {  # recipe: (models, dataset, max_new_tokens, gamma, W, G, N, K)
    "ouroboros_yi34b_humaneval": (YI, "humaneval", 512, 12, 20, 20, 7, 3),
    "ouroboros_dscoder33b_humaneval": (DSC, "humaneval", 512, 11, 20, 20, 7, 3),
    "ouroboros_yi34b_gsm8k": (YI, "gsm8k", 256, 4, 15, 15, 6, 3),
    "ouroboros_yi34b_cnn_dm": (YI, "cnn_dm", 128, 10, 15, 15, 5, 3),
    "ouroboros_yi34b_wmt16": (YI, "wmt16", 64, 5, 16, 16, 5, 3),
}
MJSD = {  # recipe: (models, dataset, max_new_tokens, method params)
    "mjsd_llama2_13b_cnn_dm": (LLAMA, "cnn_dm", 128,
                               {"gamma": 4, "width": 1, "num_beams": 8, "tau": 0.1, "top_k": 20, "top_p": 0.9}),
}

#: the trained systems decoded on their papers' targets and benchmarks: recipe: (the experiment that trains what it
#: decodes, model path or hub id, dataset, method, the method's paper parameters)
TRAINED = {
    "cllm_abel7b_gsm8k": ("cllm_gsm8k", "train/runs/cllm_gsm8k/default/final", "gsm8k", "jacobi",
                          {"block_size": 16}),
    "cllm_vicuna7b_mt_bench": ("cllm_sharegpt", "train/runs/cllm_sharegpt/default/final", "mt_bench", "jacobi",
                               {"block_size": 32}),
    "firp_llama2_7b_mt_bench": ("heads_firp_llama2_7b", "meta-llama/Llama-2-7b-chat-hf", "mt_bench", "firp",
                                {"tree": "T63"}),
    "sdsat_codellama7b_humaneval": ("sdsat_codellama7b", "train/runs/sdsat_codellama7b/default/final", "humaneval",
                                    "sdsat", {"k": 5, "variant": "two_step"}),
}


@pytest.fixture
def checked_models(monkeypatch) -> list:
    """Record instead of run :func:`~pardec.evaluation.spec.check_models` (hub availability and the tokenizer check,
    which load tokenizers from the hub): ``[(model, draft), ...]``."""
    calls: list = []
    monkeypatch.setattr(spec_module, "check_models", lambda model, draft: calls.append((model, draft)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the recipes run on CUDA (model.device: cuda)
    return calls


def _validated(name: str, checked_models: list):
    spec = validate(cfg_of(f"+recipe={name}"))
    assert len(checked_models) == 1, "validate() checks the models once, before any weights load"
    return spec


def test_every_recipe_has_its_paper_values_here():
    assert RECIPES == sorted({**OUROBOROS, **MJSD, **TRAINED})  # a new recipe: add the paper's values to this file


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_trained_systems_recipes_decode_what_their_experiment_trains(name, checked_models):
    """CLLM, FIRP and SDSAT on their papers' targets: the recipe reads the run dir its training experiment writes
    (``run_name: default``), greedy, bf16, and names the training command in its header."""
    experiment, model, dataset, method, params = TRAINED[name]
    if method == "firp":  # the trained projections' directory must hold a drafter.json (read at validation)
        composed = cfg_of(f"+recipe={name}")
        assert composed.method.path.endswith(f"train/runs/{experiment}/default/final")
        assert (composed.method.name, composed.method.tree, composed.dataset.name, composed.model.path) == (
            method, params["tree"], dataset, model) and composed.dtype == "bf16"
        with pytest.raises(ConfigError, match=r"method.path=.*holds no trained drafter.*heads_firp_smollm2"):
            validate(composed)
        checked_models.clear()
        return
    spec = _validated(name, checked_models)
    assert spec.method == method and {k: spec.method_params[k] for k in params} == params
    assert spec.model.path.endswith(model) and spec.dataset.name == dataset
    assert spec.sampling.greedy and spec.run.dtype == spec.model.dtype == "bf16" and spec.draft is None
    assert f"+experiment={experiment}" in (CONF_DIR / "recipe" / f"{name}.yaml").read_text()
    assert "run_name: default" in (CONF_DIR / "experiment" / f"{experiment}.yaml").read_text()


@pytest.mark.parametrize("name", sorted(OUROBOROS))
def test_ouroboros_recipes_compose_validate_and_hold_the_papers_values(name, checked_models):
    (target, draft), dataset, max_new, gamma, window, guess_set, level, top_k = OUROBOROS[name]
    spec = _validated(name, checked_models)
    assert spec.method == "ouroboros"
    p = spec.method_params
    assert (p["gamma"], p["window"], p["guess_set"], p["level"], p["top_k_phrases"]) == (gamma, window, guess_set,
                                                                                        level, top_k)
    assert p["accelerated_drafting"] and p["lengthening"] and p["verified_phrases"] and p["warm_start"]  # full method
    assert (spec.model.path, spec.draft.path) == (target, draft)
    assert spec.model.device_map == "auto" and spec.draft.device_map is None  # the 33B/34B target splits over GPUs
    assert spec.model.dtype == spec.draft.dtype == spec.run.dtype == "fp16"  # the official scripts' torch.float16
    assert spec.dataset.name == dataset and spec.run.max_new_tokens == max_new
    assert spec.sampling.greedy
    if dataset == "gsm8k":
        assert spec.dataset.extra["num_fewshot"] == 8  # N_SHOT = 8
    if dataset == "wmt16":
        assert (spec.dataset.extra["source"], spec.dataset.extra["target"]) == ("de", "en")


@pytest.mark.parametrize("name", sorted(MJSD))
def test_mjsd_recipes_compose_validate_and_hold_the_papers_values(name, checked_models):
    (target, draft), dataset, max_new, params = MJSD[name]
    spec = _validated(name, checked_models)
    assert spec.method == "mjsd"
    assert {k: spec.method_params[k] for k in params} == params
    assert spec.method_params["tau"] == 0.1  # Table 5
    assert (spec.model.path, spec.draft.path) == (target, draft)
    assert spec.model.dtype == spec.draft.dtype == "fp16"
    assert spec.dataset.name == dataset and spec.run.max_new_tokens == max_new
    assert (spec.run.n_samples, spec.run.repeats) == (100, 4)
    assert (spec.sampling.temperature, spec.sampling.top_k, spec.sampling.top_p) == (1.0, 20, 0.9)


@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_documents_its_launch_command_and_gpu_memory(name):
    text = (CONF_DIR / "recipe" / f"{name}.yaml").read_text()
    assert text.startswith("# @package _global_\n")
    header = text.split("\ndefaults:")[0]
    assert f"python -m evaluate +recipe={name}" in header
    assert "GPU memory (estimate" in header and " GB" in header


def test_the_model_check_is_what_fails_offline(monkeypatch):
    """Unmocked, validation reaches the hub check with the recipe's models: on a machine without the weights and with
    the hub switched off it is one line naming the model and the switch (no download tried)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (where there is none, the placement check stops first)
    monkeypatch.setattr(preflight, "_hub_cached", lambda repo, revision: False)
    monkeypatch.setattr(preflight, "hub_reachable", lambda timeout=3.0: pytest.fail("probed the hub while offline"))
    with pytest.raises(ConfigError, match=r"model 'yi_34b': hub model 01-ai/Yi-34B is not in the local Hugging "
                                          r"Face cache and the hub is off \(HF_HUB_OFFLINE\)") as e:
        validate(cfg_of("+recipe=ouroboros_yi34b_humaneval"))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name", RECIPES)
def test_a_gpu_recipe_where_cuda_is_not_usable_stops_in_one_line(name, monkeypatch):
    """Every paper recipe asks for CUDA (``model.device: cuda``): without it, validation stops before any weights
    load, instead of decoding a 7B-34B model on the CPU; ``model.device=cpu`` (and the draft's) runs it anyway. It is
    the first check that can fail: before the hub is probed, a tokenizer fetched or a trained drafter looked for."""
    monkeypatch.setattr(spec_module, "check_models", lambda model, draft: pytest.fail("probed the models first"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = cfg_of(f"+recipe={name}")
    assert cfg.model.device == "cuda" and (cfg.draft.get("name") is None or cfg.draft.device == "cuda")
    with pytest.raises(ConfigError, match="model.device=cuda but no CUDA device is usable here") as e:
        validate(cfg)
    assert "\n" not in str(e.value)
    if name.startswith("firp_"):
        return  # (on the CPU its validation then needs the trained projections: test above)
    monkeypatch.setattr(spec_module, "check_models", lambda model, draft: None)
    cpu = ["model.device=cpu"] + (["draft.device=cpu"] if cfg.draft.get("name") else [])
    assert validate(cfg_of(f"+recipe={name}", *cpu)).devices[0] == torch.device("cpu")


def test_an_unknown_recipe_is_one_line_listing_them():
    with pytest.raises(ConfigError, match="recipe='nope' is not valid; choose one of: " + ", ".join(RECIPES)):
        check_overrides(["+recipe=nope"], "evaluate")


def test_command_line_overrides_still_apply_on_top_of_a_recipe(checked_models):
    spec = validate(cfg_of("+recipe=ouroboros_yi34b_humaneval", "method.gamma=8", "n_samples=10"))
    assert spec.method_params["gamma"] == 8 and spec.run.n_samples == 10
    assert spec.method_params["window"] == 20  # the rest stays the recipe's


@pytest.mark.slow  # a subprocess (~6 s)
def test_cli_cfg_job_prints_the_recipe(tmp_path):
    """The issue's check, literally: `python -m evaluate +recipe=<name> --cfg job` composes (exit 0) and prints the
    paper's values."""
    p = run_cli("+recipe=ouroboros_yi34b_humaneval", "--cfg", "job", "--resolve", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    m = cfg["method"]
    assert (m["name"], m["gamma"], m["window"], m["guess_set"], m["level"], m["top_k_phrases"]) == (
        "ouroboros", 12, 20, 20, 7, 3)
    assert (cfg["model"]["path"], cfg["model"]["device_map"], cfg["draft"]["path"]) == ("01-ai/Yi-34B", "auto",
                                                                                     "01-ai/Yi-6B")
    assert cfg["dtype"] == cfg["model"]["dtype"] == "fp16" and cfg["max_new_tokens"] == 512


def test_a_method_swapped_under_a_recipe_names_the_recipes_parameters(monkeypatch):
    """``+recipe=ouroboros_... method=pld``: Hydra keeps the recipe's ``method:`` body over the new method group, and
    the refusal says so in its one line: the keys the recipe set, for which method, and how to drop them."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (past the placement check)
    GlobalHydra.instance().clear()
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["+recipe=ouroboros_yi34b_gsm8k", "method=pld", "threads=1"],
                      return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)  # a run's runtime choices (the recipe), as `python -m evaluate` has them
    try:
        with pytest.raises(ConfigError, match=r"method 'pld' has no parameter\(s\) \['gamma', .*\]; valid: max_ngram.* "
                                              r"\(recipe ouroboros_yi34b_gsm8k sets method.gamma, method.window, "
                                              r"method.guess_set, method.level, method.top_k_phrases, "
                                              r"method.warm_start for method ouroboros; drop them with ~method.gamma "
                                              r".*~method.warm_start, or keep method=ouroboros\)$") as e:
            validate(cfg)
    finally:
        HydraConfig.instance().cfg = None
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"has no parameter\(s\) \['gamma'\]; valid: [a-z_, ]+$"):
        validate(cfg_of("+method=pld", "+method.gamma=4"))  # no recipe: no note
