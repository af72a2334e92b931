"""Model configs read outside a composed config (``perplexity.model=<name>``)."""

from __future__ import annotations

import pytest

from pardec import CONF_DIR
from pardec.models.loading import named_config


@pytest.mark.parametrize("name", sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml") if p.stem != "local"))
def test_every_named_model_config_resolves_on_its_own(name):
    """Their `dtype: ${oc.select:dtype,fp32}` resolved to itself when the YAML was loaded alone (an
    InterpolationResolutionError for `perplexity.model=<name>`); now against the run's dtype."""
    assert named_config(name).dtype == "fp32"
    assert named_config(name, "bf16").dtype == "bf16"


def test_an_unknown_name_is_one_line():
    with pytest.raises(FileNotFoundError, match="no model config .*nope.yaml"):
        named_config("nope")


def test_device_map_reaches_from_pretrained_and_the_model_is_not_moved(tmp_path, monkeypatch):
    """``model.device_map=auto`` hands the placement to accelerate (a target larger than one GPU); load_model then
    leaves the dispatched model where it was put."""
    import torch

    from pardec.config import ConfigError, ModelConfig
    from pardec.models import loading
    from tests.conftest import tiny

    src = tiny(0)
    src.model.save_pretrained(tmp_path)
    src.tokenizer.save_pretrained(tmp_path)
    calls = []
    real = loading.AutoModelForCausalLM.from_pretrained

    def spy(path, **kw):
        model = real(path, **{k: v for k, v in kw.items() if k != "device_map"})
        moves = []
        model.to = lambda *a, **k: moves.append((a, k)) or model
        calls.append((kw, moves))
        return model

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", spy)
    lm = loading.load_model(ModelConfig(name="local", source="local", path=str(tmp_path), device_map="auto"))
    (kw, moves), = calls
    assert kw["device_map"] == "auto" and kw["dtype"] == torch.float32 and moves == [] and not lm.model.training
    loading.load_model(ModelConfig(name="local", source="local", path=str(tmp_path), device="cpu"))
    kw, moves = calls[1]
    assert "device_map" not in kw and moves  # a plain load is moved onto model.device
    with pytest.raises(ConfigError, match="device_map='auto' needs weights on disk"):
        loading.load_model(ModelConfig(name="tiny_random", source="tiny_random", device_map="auto"))


def test_processes_asking_at_once_dequantize_a_gguf_once(tmp_path, monkeypatch):
    """Two callers of materialize_gguf at once (ranks, test workers): one dequantizes, the other waits for its copy."""
    import threading
    import time

    import pardec.models.loading as loading
    from pardec.config import ModelConfig

    out = tmp_path / "models" / "m"
    calls = []

    def slow_dequantize(cfg, where):
        calls.append(where)
        time.sleep(0.5)  # long enough for the second caller to arrive while this one works
        where.mkdir(parents=True)
        (where / "config.json").write_text("{}")
        (where / "tokenizer_config.json").write_text("{}")

    monkeypatch.setattr(loading, "cache_dir_for", lambda cfg: out)
    monkeypatch.setattr(loading, "_dequantize", slow_dequantize)
    cfg = ModelConfig(name="m", source="gguf")
    got = []
    threads = [threading.Thread(target=lambda: got.append(loading.materialize_gguf(cfg))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [out, out] and (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir() if p.is_dir()] == ["m"]  # its temporary directory renamed


TEXTS = ["def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n", "Grüße, naïve café — 東京 🚀\t\r\n",
         "<|im_start|>user\nhi<|im_end|>", "  lots   of   spaces\n\n\n", "".join(chr(c) for c in range(32, 127))]


def test_a_tiny_models_tokenizer_is_smollm2s_cut_to_its_first_ids_and_still_encodes_any_text():
    """model.vocab (8,192 by default): a tiny_random model's tokenizer keeps SmolLM2's ids below it, a whole
    byte-level BPE that round-trips any text with its special tokens, chat template and their ids; its model's
    embedding and head are that wide. model.vocab=null keeps the whole vocabulary."""
    from pardec.config import ModelConfig
    from pardec.models.loading import SMOLLM2, load_model, load_tokenizer_only

    full = load_tokenizer_only(SMOLLM2)
    lm = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu"))
    cut = lm.tokenizer
    assert len(cut) == 8192 == lm.model.config.vocab_size == lm.model.lm_head.out_features
    for text in TEXTS:
        ids = cut(text, add_special_tokens=False)["input_ids"]
        assert max(ids) < 8192 and cut.decode(ids) == text
        assert len(ids) >= len(full(text, add_special_tokens=False)["input_ids"])  # fewer merges: as long or longer
    assert cut("the")["input_ids"] == full("the")["input_ids"]  # an early merge is kept
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert getattr(cut, name) == getattr(full, name)
    msgs = [{"role": "user", "content": "hi"}]
    assert cut.apply_chat_template(msgs, tokenize=False) == full.apply_chat_template(msgs, tokenize=False)
    whole = ModelConfig(name="tiny_random", source="tiny_random", device="cpu", vocab=None)
    assert len(load_tokenizer_only(whole)) == len(full) == 49152


def test_a_vocab_too_small_for_the_alphabet_is_refused(tmp_path):
    from pardec.config import ConfigError
    from pardec.models.loading import cut_tokenizer
    from tests.conftest import VOCAB, tiny

    with pytest.raises(ConfigError, match=r"model.vocab=100 is out of range: .*ids 0-\d+, so it must be at least \d+ "
                                          rf"\(or null for the whole vocabulary of {VOCAB}\)"):
        cut_tokenizer(tiny(0).tokenizer, 100, tmp_path / "t")


@pytest.mark.slow
def test_a_gguf_tokenizer_alone_is_read_once_without_dequantizing_the_weights(tmp_path):
    from dataclasses import replace

    from pardec.models.loading import SMOLLM2, load_tokenizer_only

    cfg = replace(SMOLLM2, cache_dir=str(tmp_path / "smollm2"))
    tok = load_tokenizer_only(cfg)
    assert len(tok) == 49152 and tok.eos_token_id == 2
    assert (tmp_path / "smollm2_tokenizer" / "tokenizer.json").is_file() and not (tmp_path / "smollm2").exists()
    again = load_tokenizer_only(cfg)  # from the saved directory
    assert again("def f(x):\n    return x")["input_ids"] == tok("def f(x):\n    return x")["input_ids"]
