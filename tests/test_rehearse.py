"""`python -m pardec.rehearse`: every paper recipe is found and gets a rehearsal whose config is the recipe's except
for the model, device, data and size keys (both composed with Hydra and diffed). The launches themselves run in CI's
own step, `make rehearse` (.ci/run), not here."""

from __future__ import annotations

import pytest
import yaml

from pardec import CONF_DIR
from pardec.rehearse import (
    SMALL_MODELS,
    compose,
    config_diff,
    discover,
    find,
    launch_cmd,
    main,
    plan,
    swapped,
)
from pardec.rehearse.plans import SPLIT_HIDDEN, SPLIT_LAYERS

RECIPES = discover()
NAMES = [r.name for r in RECIPES]
#: the paper recipes when this test was written (more may be added: they are found by scanning)
KNOWN = {"cllm_code", "cllm_gsm8k", "cllm_sharegpt", "cllm_spider", "draft_llama2_7b", "heads_firp_llama2_7b",
         "heads_medusa_vicuna7b", "sdsat_codellama7b", "mjsd_llama2_13b_cnn_dm", "ouroboros_dscoder33b_humaneval",
         "ouroboros_yi34b_cnn_dm", "ouroboros_yi34b_gsm8k", "ouroboros_yi34b_humaneval", "ouroboros_yi34b_wmt16"}


def test_every_paper_recipe_is_discovered():
    assert KNOWN <= set(NAMES), sorted(KNOWN - set(NAMES))
    for path in sorted((CONF_DIR / "experiment").glob("*.yaml")):  # every GPU training recipe
        if (yaml.safe_load(path.read_text()) or {}).get("device") == "cuda":
            assert path.stem in NAMES
    for r in RECIPES:
        assert r.model not in SMALL_MODELS or r.needs in NAMES, r  # a small target only when it is a trained one
    # an evaluation of what a training recipe trains comes after that training's rehearsal
    for r in RECIPES:
        if r.needs:
            order = [x.name for x in find([r.name])]
            assert order.index(r.needs) < order.index(r.name)


def test_a_bad_name_is_one_line_listing_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as e:
        main(["cllm_gsm9k"])
    msg = str(e.value)
    assert "\n" not in msg and "cllm_gsm9k" in msg and all(n in msg for n in NAMES)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_the_rehearsal_changes_only_model_device_data_and_sizes(name, tmp_path):
    """The rehearsal's composed config equals the recipe's except at SWAP_KEYS; the trainer (DeepSpeed stage,
    losses, schedule), the stages, dtypes and the method's parameters are the recipe's."""
    (recipe,) = [r for r in RECIPES if r.name == name]
    p = plan(recipe, tmp_path)
    assert p.overrides["size"] and "threads=1" in p.overrides["device"]
    base = compose(recipe.app, [f"+{recipe.group}={name}", *p.location])
    rehearsal = compose(recipe.app, [f"+{recipe.group}={name}", *p.all_overrides(), *p.location])
    diff = config_diff(base, rehearsal)
    assert diff, "the rehearsal must shrink something"
    assert not [k for k in diff if swapped(k, recipe.app) is None], diff
    for section in ("trainer", "method", "sampling", "collect", "drafter", "adaptive", "bench", "perplexity"):
        if section in base:
            kept = {k: v for k, v in config_diff(base[section], rehearsal[section]).items()
                    if swapped(f"{section}.{k}", recipe.app) is None}
            assert not kept, (section, kept)
    assert base.get("dtype") == rehearsal.get("dtype") and base.get("stage") == rehearsal.get("stage")
    if recipe.app == "train":
        t0, t1 = base["trainer"], rehearsal["trainer"]
        assert t0.get("deepspeed") == t1["deepspeed"] and t1["deepspeed"] in ("zero2", "zero3")
        assert {k: v for k, v in t0.items() if k != "max_steps"} == {k: v for k, v in t1.items() if k != "max_steps"}
        assert t1["max_steps"] == 2 and rehearsal["device"] == "cpu"
        assert base.get("draft") == rehearsal.get("draft")  # the draft kind's shape (layers, vocabulary)
        assert rehearsal["model"]["source"] == "tiny_random"
    else:
        assert base["method"] == rehearsal["method"] and rehearsal["n_samples"] == 2
        # as on its GPUs: the recipe's devices and forward, run on virtual CUDA devices (pardec.testing.virtual_gpus)
        assert rehearsal["model"]["device"] == base["model"]["device"] != "cpu"
        assert rehearsal["forward_impl"] == base["forward_impl"]
        assert p.gpus_per_rank == (2 if base["model"].get("device_map") else 1)
        if not p.split_model:  # (a split one's launch sizes its devices by the model prepare() saves)
            cmd = launch_cmd(p, 2)
            assert cmd[cmd.index("pardec.testing.virtual_gpus") + 1:][:3] == ["--devices", "2", "evaluate"]
        if recipe.needs and "/train/runs/" in str(base["model"].get("path")):
            assert rehearsal["model"]["path"] == base["model"]["path"]  # the training rehearsal's tiny model
        else:
            assert rehearsal["model"]["source"] in ("tiny_random", "local")
        if base["model"].get("device_map"):  # a split target is a saved tiny model, its map kept
            assert rehearsal["model"]["device_map"] == base["model"]["device_map"]
            assert p.saved_models[p.split_model] == {"layers": SPLIT_LAYERS, "hidden": SPLIT_HIDDEN}
