"""Integration: on the real offline model (SmolLM2-135M-Instruct, fp32) the lossless methods equal `ar`."""

import pytest

from pardec.config import DatasetConfig
from pardec.decoding import Stopper, build_decoder
from pardec.models.cached import CachedModel
from pardec.models.loading import SMOLLM2, load_model
from pardec.tasks.base import build_task

pytestmark = pytest.mark.heavy  # the real model


@pytest.fixture(scope="module")
def smollm2():
    return load_model(SMOLLM2)


def test_smollm2_loads_from_the_safetensors_cache(smollm2):
    assert smollm2.model.config.num_hidden_layers == 30 and smollm2.chat
    assert smollm2.model.dtype.is_floating_point


def test_jacobi_and_pld_equal_ar_on_smollm2(smollm2):
    tok = smollm2.tokenizer
    task = build_task(DatasetConfig(name="humaneval"))
    cm = CachedModel(smollm2.model)
    stop = Stopper(tok, [tok.eos_token_id], task.stop_strings(True))
    for doc in task.docs()[:2]:
        ids = task.prompt_ids(doc, tok, True, [])
        ref = build_decoder("ar", cm, tok).generate(ids, 40, stop)
        for method, params in [("jacobi", {"block_size": 8}), ("pld", {})]:
            res = build_decoder(method, cm, tok, **params).generate(ids, 40, stop)
            assert res.tokens == ref.tokens, (doc["id"], method)
            assert res.target_forwards <= ref.target_forwards
