"""pardec.report.heads (`python -m pardec.report heads`): the pseudo-vs-real cosine analysis and the bench rows it collects."""

from __future__ import annotations

import json

import torch

from pardec.models.heads import FirpProjections
from pardec.report import heads as heads_report
from tests.conftest import tiny


def test_cosine_at_birth_is_the_anchor_against_the_real_future_state():
    model = tiny(1, layers=3).model
    proj = FirpProjections(model.config.hidden_size, 0, [1, 2])  # identity: a pseudo state starts as its anchor's
    rec = {"prompt_ids": list(range(100, 106)), "completion_ids": list(range(200, 210))}
    got = heads_report.pseudo_cosine(model, proj, [rec], 1)
    with torch.no_grad():
        hs = model(input_ids=torch.tensor([rec["prompt_ids"] + rec["completion_ids"]]),
                   output_hidden_states=True).hidden_states
    n, start = 16, 5
    for i, layer in enumerate(proj.layers):
        h = hs[layer][0]
        anchors = torch.arange(start, n - i - 1)
        want = torch.cosine_similarity(h[anchors].double(), h[anchors + i + 1].double(), -1).mean()
        assert abs(got["cosine"][i][layer] - float(want)) < 1e-4
        assert all(c is None for c in got["cosine"][i][:layer])  # not born yet
        assert got["cosine"][i][-1] is not None  # after the last layer
    assert got["layers"][-1] == "out" and got["positions"] == n - start - 1


def test_bench_rows_collect_methods_and_roles(tmp_path):
    run = tmp_path / "runs" / "gsm8k"
    run.mkdir(parents=True)
    summary = {"dataset": "gsm8k", "method": "firp", "method_params": {"tree": "T16", "path": "p"},
               "tokens_per_forward": 2.5, "speedup": 0.9, "exact_match_rate": 1.0,
               "peers": {"hf": {"method": "hf_generate", "params": {}},
                         "also:medusa:tree=T32": {"method": "medusa", "params": {"tree": "T32"},
                                                  "tokens_per_forward": 2.1, "speedup": 1.1,
                                                  "exact_match_rate": 1.0}}}
    (run / "summary.json").write_text(json.dumps(summary))
    rows = heads_report.bench_rows([tmp_path])
    assert [(r["method"], r["tree"], r["tokens_per_forward"]) for r in rows] == [("firp", "T16", 2.5),
                                                                                ("medusa", "T32", 2.1)]
