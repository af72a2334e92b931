"""scripts/int8_quality.py on the tiny model: fp32 agrees with its own records, int8 rows are measured for both
weight schemes (with a draft), and bad values are refused."""

from __future__ import annotations

import math

import pytest
import torch

from pardec.config import ModelConfig
from pardec.models.loading import load_model
from pardec.training.completions import GenerateConfig, generate, generation_meta
from pardec.training.stages import Prompt
from scripts import int8_quality


@pytest.fixture
def corpus(tmp_path):
    lm = load_model(ModelConfig(name="tiny_random", source="tiny_random", device="cpu"))
    prompts = [Prompt(i, f"src/{i}", lm.tokenizer(t)["input_ids"]) for i, t in enumerate(["Hello there", "1 2 3 4"])]
    cfg = GenerateConfig(max_new_tokens=5, batch_size=2, out_dir=str(tmp_path / "corpus"))
    generate(cfg, lm.model, lm.tokenizer.pad_token_id, set(), prompts, generation_meta(cfg, {"name": "tiny"}, set()))
    draft_dir = tmp_path / "draft"
    lm.model.save_pretrained(draft_dir)  # a "draft" identical to the target
    lm.tokenizer.save_pretrained(draft_dir)
    return tmp_path / "corpus", draft_dir, lm


def test_int8_quality_measures_fp32_and_both_schemes(corpus, tmp_path, capsys):
    path, draft_dir, lm = corpus
    out = int8_quality.main(["--corpus", str(path), "--model", "tiny_random", "--draft", str(draft_dir),
                             "--threads", "1", "--out", str(tmp_path / "q.json")])
    labels = [r["label"] for r in out["rows"]]
    assert labels == ["fp32", "int8 weight_only", "int8 per_tensor", "int8 per_channel", "int8 per_channel:smooth=0.8",
                      "int8 per_channel:smooth=0.8:skip=down_proj", "int8 per_token:smooth=0.5"]
    fp32 = out["rows"][0]["corpora"]["corpus"]
    assert fp32["positions"] == 10 and fp32["top1_vs_fp32_records"] == 1.0  # greedy records of this very model
    assert fp32["draft_agreement"] == 1.0  # the draft is the target
    # the perplexity is the records' own: recompute it by hand for the first record
    rec = int8_quality.load_completions(path)[0]
    with torch.no_grad():
        logp = torch.log_softmax(lm.model(torch.tensor([rec["prompt_ids"] + rec["completion_ids"]])).logits[0], -1)
    p = len(rec["prompt_ids"])
    nll0 = -sum(float(logp[p - 1 + j, t]) for j, t in enumerate(rec["completion_ids"]))
    nll, n = int8_quality.record_nll(lm.model, [rec])
    assert n == 5 and math.isclose(nll, nll0, rel_tol=1e-4)
    for r in out["rows"][1:]:
        x = r["corpora"]["corpus"]
        assert 0 <= x["top1_vs_fp32_records"] <= 1 and x["perplexity_of_records"] > 0
        assert 0 <= x["draft_agreement"] <= 1
    assert (tmp_path / "q.json").is_file()
    assert "| int8 per_tensor |" in capsys.readouterr().out
    bf16 = int8_quality.main(["--corpus", str(path), "--model", "tiny_random", "--recipe", "bf16", "--threads", "1"])
    assert [r["label"] for r in bf16["rows"]] == ["fp32", "bf16"]
    x = bf16["rows"][1]["corpora"]["corpus"]
    assert x["positions"] == 10 and 0 <= x["top1_vs_fp32_records"] <= 1 and x["perplexity_of_records"] > 0
    assert int8_quality.parse_recipe("per_channel:smooth=0.5:skip=down_proj+o_proj") == {
        "int8_weights": "per_channel", "int8_smooth": 0.5, "int8_skip": ["down_proj", "o_proj"]}


@pytest.mark.parametrize("args, msg", [(["--recipe", "per_row"], "scheme 'per_row' not valid; choose from: "
                                        "weight_only, per_channel, per_tensor"),
                                       (["--recipe", "per_channel:clip=3"], "option 'clip' not valid; choose from: "
                                        "smooth, skip"),
                                       (["--max-records", "0"], "--max-records 0: it must be >= 1")])
def test_int8_quality_refuses_bad_values(args, msg, capsys, tmp_path):
    with pytest.raises(SystemExit):
        int8_quality.main(["--corpus", str(tmp_path), "--model", "tiny_random", *args])
    assert msg in capsys.readouterr().err
