"""``drafter.feature_cache`` (:class:`pardec.training.drafter.target.FeatureCache`): the frozen target's states kept on
disk per training sequence, read instead of a live pass. What a cached pass returns against the live one (padding,
the logits recomputed from the kept final state), that a sequence is computed once and then read without running a
layer, that a file cut short by a kill is not read, that another target or other layers get their own directory,
and EAGLE-3 / DFlash training end to end through it; config errors."""

from __future__ import annotations

import json

import pytest
import torch

from pardec.config import ConfigError
from pardec.train import run
from pardec.training.drafter.target import FeatureCache, target_pass
from tests.conftest import tiny
from tests.training.test_train_app import _compose


def _batch():
    ids = torch.tensor([[4, 8, 15, 16, 23, 42, 7], [5, 9, 11, 3, 0, 0, 0]])
    valid = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])
    return ids, valid


def _layers_run(base):
    ran = []
    hooks = [layer.register_forward_hook(lambda m, a, o, i=i: ran.append(i)) for i, layer in enumerate(base.model.layers)]
    return ran, hooks


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_cached_pass_equals_the_live_one_and_runs_no_layer_the_second_time(tmp_path, dtype, tol):
    base = tiny(0, layers=4).model
    ids, valid = _batch()
    cache = FeatureCache(tmp_path, {"name": "tiny"}, [0, 2], final=True, dtype=dtype)
    live = target_pass(base, ids, [0, 2])
    first = cache.target_pass(base, ids, valid)
    ran, hooks = _layers_run(base)
    try:
        again = cache.target_pass(base, ids, valid)
    finally:
        for h in hooks:
            h.remove()
    assert ran == [] and (cache.misses, cache.hits) == (2, 2)
    assert len(list(cache.dir.glob("*.safetensors"))) == 2
    for out in (first, again):
        assert out.features.dtype == live.features.dtype and out.features.shape == live.features.shape
        for row in range(2):
            n = int(valid[row].sum())
            torch.testing.assert_close(out.features[row, :n], live.features[row, :n], rtol=tol, atol=tol)
            torch.testing.assert_close(out.logits[row, :n], live.logits[row, :n], rtol=tol, atol=tol * 10)
            assert not out.features[row, n:].any()  # padding: zeros
        assert torch.equal(out.emb, live.emb)
    assert torch.equal(first.features, again.features)  # the first pass returns what later runs read


def test_a_draft_reading_the_final_state_keeps_it_once_and_the_logits_come_from_it(tmp_path):
    base = tiny(0, layers=4).model
    ids, valid = _batch()
    cache = FeatureCache(tmp_path, {"name": "tiny"}, [4, 1], final=True, dtype=torch.float32)  # 4: after the final norm
    live, out = target_pass(base, ids, [4, 1]), cache.target_pass(base, ids, valid)
    torch.testing.assert_close(out.features[0], live.features[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits[0], live.logits[0], rtol=1e-4, atol=1e-4)
    kept = cache.get(ids[0])
    assert torch.equal(kept["final"], kept["features"][:, : base.config.hidden_size])


def test_without_logits_the_pass_stops_at_the_last_layer_and_keeps_no_final_state(tmp_path):
    base = tiny(0, layers=4).model
    ids, valid = _batch()
    cache = FeatureCache(tmp_path, {"name": "tiny"}, [0, 1], final=False)
    ran, hooks = _layers_run(base)
    try:
        out = cache.target_pass(base, ids, valid, logits=False)
    finally:
        for h in hooks:
            h.remove()
    assert out.logits is None and set(ran) == {0}  # the state entering layer 1 needs layer 0 only
    with pytest.raises(ValueError, match="keeps no final state"):
        cache.target_pass(base, ids, valid, logits=True)


def test_a_file_cut_short_is_not_read_and_another_target_or_layers_get_their_own_directory(tmp_path):
    base = tiny(0, layers=4).model
    ids, valid = _batch()
    cache = FeatureCache(tmp_path, {"name": "tiny"}, [0, 2], final=False)
    (cache.dir / f".{cache._file(ids[0]).stem}.123.tmp").write_bytes(b"cut short")  # a kill during a save
    cache.target_pass(base, ids, valid, logits=False)
    assert cache.misses == 2 and len(list(cache.dir.glob("*.safetensors"))) == 2
    meta = json.loads((cache.dir / "meta.json").read_text())
    assert meta["layers"] == [0, 2] and meta["dtype"] == "bfloat16" and meta["target"] == {"name": "tiny"}
    others = {FeatureCache(tmp_path, {"name": "tiny"}, [0, 3], final=False).dir,
              FeatureCache(tmp_path, {"name": "other"}, [0, 2], final=False).dir,
              FeatureCache(tmp_path, {"name": "tiny"}, [0, 2], final=True).dir,
              FeatureCache(tmp_path, {"name": "tiny"}, [0, 2], final=False, dtype=torch.float32).dir}
    assert len(others) == 4 and cache.dir not in others
    assert FeatureCache(tmp_path, {"name": "tiny"}, [0, 2], final=False).dir == cache.dir


@pytest.mark.parametrize("experiment,kind", [("dflash_tiny", "dflash"), ("eagle3_tiny", "eagle3")])
def test_training_through_the_cache_keeps_each_sequence_once(tmp_path, experiment, kind):
    run_dir = tmp_path / "out" / "run"
    fc = tmp_path / "features"
    summary = run(_compose([f"+experiment={experiment}", f"paths.data_dir={tmp_path}/data",
                            f"paths.output_dir={tmp_path}/out", f"+drafter.feature_cache={fc}"]), run_dir)
    (key,) = list(fc.iterdir())
    meta = json.loads((key / "meta.json").read_text())
    assert meta["final_state"] is (kind == "eagle3")  # EAGLE-3's soft labels need the target's logits; DFlash's CE not
    t = summary["train"]
    seen = min(t["samples"], t["steps"] * t["sequences_per_step"])  # the sequences the run's steps met
    assert seen >= 2 and len(list(key.glob("*.safetensors"))) == seen
    logged = [h for h in json.loads((run_dir / "log_history.json").read_text()) if "loss" in h]
    assert logged and all(torch.isfinite(torch.tensor(h["loss"])) for h in logged)
    assert (run_dir / "drafter_eval.json").exists()


def test_config_errors(tmp_path):
    base = [f"paths.data_dir={tmp_path}/data", f"paths.output_dir={tmp_path}/out"]
    with pytest.raises(ConfigError, match=r"drafter.feature_cache is not valid with drafter.type='medusa': it keeps the "
                                          r"target states that dflash, eagle3 train on") as e:
        run(_compose(["+experiment=heads_medusa_tiny", *base, f"+drafter.feature_cache={tmp_path}/fc"]),
            tmp_path / "out" / "bad")
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"drafter.feature_cache=3 is not valid: give a directory"):
        run(_compose(["+experiment=dflash_tiny", *base, "+drafter.feature_cache=3"]), tmp_path / "out" / "bad")
    assert not (tmp_path / "out").exists() and not (tmp_path / "fc").exists()
