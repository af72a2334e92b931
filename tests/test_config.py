"""pardec.config: typed sections name the bad key, Hydra overrides checked in one line, settings diffs."""

from __future__ import annotations

import pytest

from pardec.config import (
    ConfigError,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    check_overrides,
    settings_diff,
    to_dataclass,
)


@pytest.mark.parametrize("cls,data,where,message", [
    (SamplingConfig, {"temperature": "hot"}, "sampling", "sampling.temperature='hot' must be float"),
    (RunConfig, {"max_new_tokens": "abc"}, "the top-level keys", "max_new_tokens='abc' must be int (in the top-level "
                                                                 "keys)"),
    (RunConfig, {"n_samples": 2.5}, "the top-level keys", "n_samples=2.5 must be int or null (in the top-level keys)"),
    (ModelConfig, {"chat": "maybe"}, "draft", "draft.chat='maybe' must be bool or null"),
])
def test_wrong_types_name_the_key_value_and_type(cls, data, where, message):
    with pytest.raises(ConfigError) as e:
        to_dataclass(cls, data, where)
    assert str(e.value) == message


@pytest.mark.parametrize("argv,message", [
    (["dataset=nope"], "dataset='nope' is not valid; choose one of: cnn_dm, code_search_net, gsm8k, humaneval, "),
    (["+method=nope"], "method='nope' is not valid; choose one of: ar, bild, dflash, eagle3, firp, hf_assisted, hf_generate, hf_pld, "),
    (["+method=eagle"], "method='eagle' is now named 'eagle3'"),  # a name of an earlier release
    (["+method=ar", "draft=eagle"], "draft='eagle' is now named 'eagle3'"),
    (["model.layerz=3"], "Could not override 'model.layerz'. To append to your config use +model.layerz=3 (Key "
                         "'layerz' is not in struct)"),
    (["max_new_tokens=[1"], "override 'max_new_tokens=[1': "),
])
def test_overrides_hydra_would_refuse_are_one_line(argv, message):
    with pytest.raises(ConfigError) as e:
        check_overrides(argv, "evaluate")
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["+experiment=heads_firp_tiny", "trainer=heads"], "trainer='heads' is now named 'drafter'"),
    (["+kind=heads"], "kind='heads' is now named 'drafter'"),  # (what an experiment file's `- /kind: heads` meets)
])
def test_the_heads_kind_of_an_earlier_release_names_the_drafter_kind(argv, message):
    with pytest.raises(ConfigError) as e:
        check_overrides(argv, "train")
    assert str(e.value) == message


def test_good_overrides_and_flags_pass():
    check_overrides(["+method=jacobi", "model=tiny_random", "method.block_size=4", "hydra.run.dir=/tmp/x"],
                    "evaluate")
    with pytest.raises(ConfigError, match="experiment='nope' is not valid; choose one of: cllm_code"):
        check_overrides(["+experiment=nope"], "train")


def test_settings_diff_names_dotted_keys_with_both_values():
    old = {"model": ModelConfig(name="t", source="tiny_random").identity(), "max_new_tokens": 8, "also": ["pld"]}
    new = {"model": ModelConfig(name="t", source="tiny_random", seed=3).identity(), "max_new_tokens": 8,
           "also": [], "draft": None}
    assert settings_diff(old, new) == ["also was ['pld'], now []", "model.seed was 0, now 3"]
    assert settings_diff(new, new) == []
    assert "cache_dir" not in ModelConfig().identity() and "revision" in ModelConfig().identity()


def test_the_deepspeed_launchers_local_rank_argument_is_taken_out(monkeypatch):
    """`deepspeed --num_gpus N --module train ...` appends `--local_rank=N`, which Hydra refuses."""
    import os

    from pardec.config import launcher_argv

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})  # restored after
    assert launcher_argv(["+experiment=cllm_tiny", "stage=train", "--local_rank=1"]) == ["+experiment=cllm_tiny",
                                                                                       "stage=train"]
    assert os.environ["LOCAL_RANK"] == "1"
    monkeypatch.setenv("LOCAL_RANK", "3")  # the launcher's own environment wins
    assert launcher_argv(["--local_rank", "0", "+method=ar"]) == ["+method=ar"] and os.environ["LOCAL_RANK"] == "3"
    assert launcher_argv(["+method=ar", "-m"]) == ["+method=ar", "-m"]


def test_one_check_style_names_key_value_and_what_is_valid():
    from pardec.config import check_at_least, check_choice, check_range, check_types

    with pytest.raises(ConfigError, match=r"^drafter.type='eagle' is not valid; choose one of: medusa, firp$"):
        check_choice("drafter.type", "eagle", ("medusa", "firp"))
    with pytest.raises(ConfigError, match=r"choose one of: zero2, zero3 or null$"):
        check_choice("trainer.deepspeed", "zero9", ("zero2", "zero3"), or_null=True)
    check_choice("trainer.deepspeed", None, ("zero2",), or_null=True)
    with pytest.raises(ConfigError, match=r"^eval.k_max=True is out of range: it must be an integer >= 1$"):
        check_at_least("eval.k_max", True, 1, integer=True)
    check_at_least("eval.max_docs", None, 1, integer=True, or_null=True)
    with pytest.raises(ConfigError, match=r"^method.top_p=0.0 is out of range: it must be a number in \(0, 1\]$"):
        check_range("method.top_p", 0.0, 0, 1, integer=False, open_lo=True)
    with pytest.raises(ConfigError, match=r"^sampling.top_k='x' must be int$"):
        check_types(SamplingConfig, {"top_k": "x", "unknown": 1}, "sampling")

    def f(n: int = 3, m: Undefined = None):  # noqa: F821 (an annotation that cannot be evaluated goes unchecked)
        pass

    with pytest.raises(ConfigError, match=r"^method.n=1.5 must be int \(f\(n\)\)$"):
        check_types(f, {"n": 1.5, "m": "anything"}, "method", explain=lambda key, tp: f"f({key})")
