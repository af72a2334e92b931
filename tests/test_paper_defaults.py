"""Every method's defaults are its paper's: one table per method (the five systems and the baselines) of the
values in the paper's settings table / section or its official code, checked against conf/method/<name>.yaml and
the decoder's own signature. Editing a default fails here with the paper's value and where it comes from. A key
with no paper value is listed as pardec's own, so a new key must be classified too. CPU-sized settings live in
named overrides (conf/method/*_cpu.yaml, bench.also), never in these defaults."""

from __future__ import annotations

import inspect

import pytest
from omegaconf import OmegaConf

from pardec import CONF_DIR
from pardec.decoding import METHODS

#: method -> key -> (the paper's value, where it is stated)
PAPER: dict[str, dict[str, tuple[object, str]]] = {
    "jacobi": {
        "block_size": (16, "CLLM §4.1 / Table 1: n = 16 for GSM8K, Spider, Code"),
        "guess_from": ("context", "CLLM Alg. 3 (initial guess from the prompt and output so far)"),
    },
    "lookahead": {
        "level": (5, "Lookahead decoding §5, 7B setting: N = 5"),
        "window": (15, "Lookahead decoding §5, 7B setting: W = 15"),
        "guess_set": (15, "Lookahead decoding §5, 7B setting: G = W = 15"),
        "pool_from_prompt": (False, "LADE lade/decoding.py CONFIG_MAP POOL_FROM_PROMPT = 0"),
        "pool_from_output": (False, "LADE lade/decoding.py CONFIG_MAP POOL_FROM_PROMPT = 0"),
    },
    "pld": {
        "max_ngram": (3, "prompt-lookup-decoding README: max_ngram_size = 3"),
        "num_pred": (10, "prompt-lookup-decoding README: num_pred_tokens = 10"),
    },
    "sps": {
        "gamma": (4, "Chen et al. 2023 (speculative sampling), §4: K = 4 draft tokens"),
        "adaptive": (False, "Chen et al. 2023: a fixed K"),
    },
    "ouroboros": {
        "gamma": (12, "Ouroboros official benchmark/test_human_eval.py (Yi-34B/6B HumanEval setting), README"),
        "window": (20, "Ouroboros official HumanEval setting: W = 20"),
        "guess_set": (20, "Ouroboros official HumanEval setting: G = 20"),
        "level": (7, "Ouroboros official HumanEval setting: N = 7"),
        "top_k_phrases": (3, "Ouroboros ouroboros/ouroboros.py default K = 3"),
        "accelerated_drafting": (True, "Ouroboros Table 4, last row (full method): §3.1 on"),
        "lengthening": (True, "Ouroboros Table 4, last row: §3.2 on"),
        "verified_phrases": (True, "Ouroboros Table 4, last row: §3.3 on"),
        "phrase_harvest": ("target", "Ouroboros §3.3, official CacheEngine.add_extra_ngram"),
        "refine_phrases": (True, "Ouroboros §3.3, official CacheEngine.update_in_place"),
        "warm_start": (True, "Ouroboros Table 4, last row: warm start (§3.4)"),
    },
    "mjsd": {
        "gamma": (4, "MJSD official evaluation.py multi_params (4, 1, 8)"),
        "num_beams": (8, "MJSD official evaluation.py multi_params (4, 1, 8)"),
        "width": (1, "MJSD official evaluation.py multi_params (4, 1, 8)"),
        "tau": (0.1, "MJSD App. D, Table 5: tau = 0.1"),
        "top_k": (20, "MJSD App. D: top-k 20"),
        "top_p": (0.9, "MJSD App. D: top-p 0.9"),
        "ratio": ("warped", "MJSD App. D: p and q warped, q = beam sampling's selection probability"),
    },
    "bild": {
        "fallback_threshold": (0.9, "MJSD's BiLD baseline, official evaluation.py BiLD_params (0.9, 2)"),
        "rollback_threshold": (2.0, "MJSD's BiLD baseline, official evaluation.py BiLD_params (0.9, 2)"),
        "max_draft": (10, "BiLD code num_small_iters = 10"),
        "variant": ("bild", "the BiLD paper's rule (Kim et al. 2023)"),
    },
    "medusa": {},
    "medusa_typical": {
        "posterior_threshold": (0.09, "Medusa §2.3.1, official medusa_generate posterior_threshold = 0.09"),
        "posterior_alpha": (0.3, "Medusa official medusa_generate posterior_alpha = 0.3 (sqrt of the threshold)"),
        "next_token": ("greedy", "Medusa §2.3.1: the first token is decoded greedily and accepted unconditionally"),
    },
    "firp": {
        "attention": ("pseudo", "FIRP §4.3 / Fig. 7: inference is No masked (a pseudo state sees the earlier ones)"),
    },
    "sdsat": {
        "k": (5, "SDSAT official main.py --k_list default (0, 5)"),
        "variant": ("two_step", "SDSAT §3: two-step-draft-then-verify"),
        "top_k": (10, "SDSAT official main.py top_k = 10"),
        "top_p": (0.95, "SDSAT official main.py top_p = 0.95"),
        "tree": ("official", "SDSAT official decoders/model/utils.py tree_depth_5 (4/8/8/5/3 nodes)"),
    },
    "hf_assisted": {
        "num_assistant_tokens": (20, "transformers 5.23 GenerationConfig default"),
        "num_assistant_tokens_schedule": ("constant", "transformers 5.23 GenerationConfig default"),
        "assistant_confidence_threshold": (0.4, "transformers 5.23 GenerationConfig default"),
    },
    "hf_pld": {
        "prompt_lookup_num_tokens": (10, "prompt-lookup-decoding README: num_pred_tokens = 10"),
        "max_matching_ngram_size": (2, "transformers 5.23 PromptLookupCandidateGenerator default"),
    },
    "eagle3": {
        "mode": ("tree", "EAGLE-3 §4: EAGLE-2's dynamic draft tree"),
        "total_tokens": (60, "EAGLE official eagle/model/ea_model.py EaModel.from_pretrained total_token=60"),
        "depth": (7, "EAGLE official ea_model.py EaModel.from_pretrained depth=7"),
        "top_k": (10, "EAGLE official ea_model.py EaModel.from_pretrained top_k=10"),
        "num_speculative_tokens": (3, "speculators convert/eagle/eagle3_converter.py greedy proposal speculative_tokens=3"),
    },
    "dflash": {
        "block_size": (None, "the drafter's trained block: the paper's 16 (z-lab's released -b16 drafters)"),
        "num_speculative_tokens": (None, "block_size - 1: z-lab dflash_generate verifies the whole block"),
        "tree": ("chain", "z-lab dflash_generate verifies the block as one chain (a tree is pardec's option)"),
    },
    "spectr": {},
    "mjgd": {},
    "ar": {},
    "hf_generate": {},
}

#: keys with no paper value: pardec's own (paths, switches for pardec's variants, CPU conveniences: ``int8_weights``,
#: the drafter's linears under dtype=int8, a CPU mode no paper has)
PARDEC_ONLY: dict[str, set[str]] = {
    "jacobi": {"max_iters", "record_trajectories"},
    "pld": {"min_ngram", "num_pred_by_cost"},
    "sps": {"gamma_min", "gamma_max", "gamma_by_cost", "confidence_threshold"},
    "medusa": {"path", "tree", "k", "int8_weights"},
    "medusa_typical": {"path", "tree", "k", "int8_weights"},
    "firp": {"path", "tree", "k", "int8_weights"},
    "sdsat": {"adaptive_ids"},
    "eagle3": {"path", "int8_weights"},
    "dflash": {"path", "int8_weights", "draft_vocab", "compile"},
    "spectr": {"k", "gamma"},  # SpecTr §5 sweeps the number of drafts and their length: no single paper value
    "mjgd": {"K", "num_beams"},  # the MJSD code has no MJGD run
}


def _yaml(method: str) -> dict:
    cfg = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "method" / f"{method}.yaml"))
    cfg.pop("name")
    return cfg


def test_every_method_has_a_table():
    assert set(PAPER) == set(METHODS.names())


@pytest.mark.parametrize("method", sorted(PAPER))
def test_every_key_is_the_papers_or_declared_pardecs_own(method):
    keys = set(_yaml(method))
    unclassified = keys - set(PAPER[method]) - PARDEC_ONLY.get(method, set())
    assert not unclassified, (f"conf/method/{method}.yaml: key(s) {sorted(unclassified)} have neither a paper value "
                              f"in tests/test_paper_defaults.py PAPER nor a place in PARDEC_ONLY")
    missing = set(PAPER[method]) - keys
    assert not missing, f"conf/method/{method}.yaml lost key(s) {sorted(missing)}"


@pytest.mark.parametrize("method", sorted(PAPER))
def test_defaults_are_the_papers(method):
    cfg = _yaml(method)
    sig = inspect.signature(METHODS.get(method).__init__).parameters
    for key, (value, where) in PAPER[method].items():
        assert cfg[key] == value, (f"conf/method/{method}.yaml: {key}={cfg[key]!r}, but the paper's value is "
                                   f"{value!r} ({where}); put a CPU-sized value in a named override instead")
        if key in sig and sig[key].default is not inspect.Parameter.empty:
            assert sig[key].default == value, (f"{method}'s __init__ default {key}={sig[key].default!r}, but the "
                                               f"paper's value is {value!r} ({where})")
