"""``python -m pardec.bench batch``: its checks before anything loads, the crossover and the table from cells, and
an end-to-end run on the tiny model (every cell exact against batch-1 ``ar``, the figure, resumption, a changed
setting refused)."""

from __future__ import annotations

import json

import pytest

from pardec.bench import batch
from pardec.config import ConfigError


def _cell(method: str, b: int, tps: float) -> dict:
    return {"method": method, "batch_size": b, "tokens_per_s": tps, "latency": {"mean": 1.0, "p50": 1.0, "p95": 2.0},
            "tokens_per_forward": 1.5, "exact_match": 1.0, "busy": {"busy": False}}


def test_sizes_and_methods_are_checked_before_anything_loads():
    assert [m[1] for m in batch.parse_methods(batch.DEFAULT_METHODS)] == ["ar", "pld", "sps", "bild", "jacobi", "eagle3",
                                                                          "eagle3", "dflash", "medusa", "firp",
                                                                          "spectr", "mjsd", "lookahead", "ouroboros"]
    modes = [m[2].get("mode", "tree") for m in batch.parse_methods(batch.DEFAULT_METHODS) if m[1] == "eagle3"]
    assert modes == ["chain", "tree"]  # EAGLE-3's chain and its paper's tree
    assert batch.parse_sizes("8,1,2,2") == [1, 2, 8]
    for bad in ("0,2", "a", ""):
        with pytest.raises(ConfigError, match="--batch-sizes"):
            batch.parse_sizes(bad)
    assert [m[0] for m in batch.parse_methods("pld,sps:gamma=3")] == ["ar", "pld", "sps:gamma=3"]
    assert batch.parse_methods("sps:gamma=3")[1][2] == {"gamma": 3}
    with pytest.raises(ConfigError, match="method 'hf_pld' has no batched implementation"):
        batch.parse_methods("ar,hf_pld")
    with pytest.raises(ConfigError, match=r"method 'sps' has no parameter\(s\) \['adaptive'\]"):
        batch.parse_methods("sps:adaptive=true")


def test_crossover_is_the_first_batch_size_below_batched_ar():
    cells = [_cell("ar", 1, 10), _cell("ar", 2, 18), _cell("ar", 4, 30), _cell("pld", 1, 15), _cell("pld", 2, 20),
             _cell("pld", 4, 25), _cell("sps", 1, 12), _cell("sps", 2, 19), _cell("sps", 4, 31)]
    assert batch.crossover(cells) == {"pld": 4, "sps": None}
    text = batch.table({"cells": cells})
    assert "| pld | 4 | 25.0 | 0.83x | 2.50x |" in text
    assert "Crossover (first batch size below batched ar): pld: 4, sps: never (up to 4)" in text


def test_a_run_in_another_attention_mode_has_its_own_block_and_identity():
    """``model.attn_implementation=invariant`` (exact int8 rows) is part of a run's identity and of its block in
    docs/batch.md; a run with the default attention keeps the identity and block it had."""
    plain = {"dataset": "gsm8k", "dtype": "int8"}
    assert batch.markers(plain) == ("<!-- batch-table gsm8k int8 -->", "<!-- /batch-table gsm8k int8 -->")
    assert batch.markers({**plain, "attention": "invariant"})[0] == "<!-- batch-table gsm8k int8 invariant -->"
    from pardec.config.schema import settings_diff

    assert settings_diff({**plain, "attention": "invariant"}, plain)  # one is not continued as the other


def test_end_to_end_on_the_tiny_model(tmp_path, capsys):
    args = ["--methods", "pld,jacobi:block_size=3,sps:gamma=2", "--batch-sizes", "1,2", "--n", "3",
            "--max-new-tokens", "6", "--warmup-tokens", "2", "--out", str(tmp_path), "model=tiny_random",
            "draft=tiny_random", "dataset=humaneval", "threads=1"]
    assert batch.main(args) == 0
    data = json.loads((tmp_path / batch.FILE).read_text())
    cells = {(c["method"], c["batch_size"]) for c in data["cells"]}
    assert cells == {(m, b) for m in ("ar", "pld", "jacobi:block_size=3", "sps:gamma=2") for b in (1, 2)}
    assert all(c["exact_match"] == 1.0 and c["tokens"] > 0 for c in data["cells"])
    assert data["identity"]["model"] == "tiny_random" and data["identity"]["host"]["cpu"]
    assert (tmp_path / "batch.png").stat().st_size > 0
    assert "| sps:gamma=2 | 2 |" in (tmp_path / "batch.md").read_text()
    assert batch.main(args) == 0  # resumes: every cell kept, none measured again
    assert json.loads((tmp_path / batch.FILE).read_text())["cells"] == data["cells"]
    root = tmp_path / "repo"  # --publish onto a copy of the pages
    (root / "docs" / "results").mkdir(parents=True)
    (root / "docs" / "img").mkdir()
    page = root / "docs" / "batch.md"
    page.write_text("# Batched\n\n<!-- batch-table humaneval fp32 -->\nold\n<!-- /batch-table humaneval fp32 -->\n\n"
                    "<!-- batch-table gsm8k fp32 -->\nkept\n<!-- /batch-table gsm8k fp32 -->\nafter\n")
    assert batch.publish(tmp_path, data, root, "batch_test") == page
    text = page.read_text()
    assert "old" not in text and text.endswith("<!-- batch-table gsm8k fp32 -->\nkept\n<!-- /batch-table gsm8k fp32 -->\n"
                                               "after\n")  # another dataset's block stays
    assert "| sps:gamma=2 | 2 |" in text and "[results/batch_test.json](results/batch_test.json)" in text
    published = json.loads((root / "docs" / "results" / "batch_test.json").read_text())
    assert published["cells"][0]["vs_ar"] == 1.0 and published["crossover"] == batch.crossover(data["cells"])
    ratios = ("vs_ar", "vs_ar_at_1", "decode_vs_ar_at_1", "prefill_share")
    assert [{k: v for k, v in c.items() if k not in ratios} for c in published["cells"]] == data["cells"]
    for c in data["cells"]:  # the rounds' rate leaves out the prefills (admissions) and each request's first token
        assert 0 < c["prefill_s"] < c["wall_s"]
        assert c["decode_tokens_per_s"] == pytest.approx((c["tokens"] - 3) / (c["wall_s"] - c["prefill_s"]))
    assert published["cells"][0]["decode_vs_ar_at_1"] == 1.0
    assert published["cells"][0]["prefill_share"] == pytest.approx(data["cells"][0]["prefill_s"] / data["cells"][0]["wall_s"])
    assert (root / "docs" / "img" / "batch_test.png").is_file()
    with pytest.raises(ConfigError, match="has no <!-- batch-table humaneval int8 --> ... <!-- /batch-table humaneval "
                                          "int8 --> block to fill"):
        batch.publish(tmp_path, {**data, "identity": {**data["identity"], "dtype": "int8"}}, root, "batch_test")
    with pytest.raises(ConfigError, match="is not finished"):
        batch.publish(tmp_path, {**data, "cells": data["cells"][:3]}, root, "batch_test")
    capsys.readouterr()
    assert batch.main([*args[:4], "--n", "2", *args[6:]]) == 2
    err = capsys.readouterr().err
    assert "cannot continue the batch run" in err and "n was 3, now 2" in err


def test_a_method_that_needs_a_draft_is_refused_without_one(tmp_path, capsys):
    assert batch.main(["--methods", "sps", "--out", str(tmp_path), "model=tiny_random", "dataset=humaneval",
                       "draft=none"]) == 2
    assert "--methods entry 'sps' needs a draft model" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_each_cell_warms_up_a_full_batch_and_a_lone_row_before_its_clock(tmp_path, monkeypatch):
    """A batch's tail runs single rows, which a compiled forward compiles apart (compiled.ragged_step's kinds): the
    warm-up meets both before the timed run."""
    import pardec.decoding.batch as batched

    calls = []
    real = batched.run_batch

    def recording(dec, prompts, max_new_tokens, *a, **kw):
        calls.append((dec.target.max_rows, len(prompts), max_new_tokens))
        return real(dec, prompts, max_new_tokens, *a, **kw)

    monkeypatch.setattr(batched, "run_batch", recording)
    assert batch.main(["--methods", "ar", "--batch-sizes", "1,2", "--n", "3", "--max-new-tokens", "5",
                       "--warmup-tokens", "2", "--out", str(tmp_path), "model=tiny_random", "dataset=humaneval",
                       "threads=1"]) == 0
    assert calls == [(1, 1, 2), (1, 3, 5), (2, 2, 2), (2, 1, 2), (2, 3, 5)]
