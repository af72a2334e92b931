"""pardec.evaluation.results: nothing non-finite reaches JSON."""

from __future__ import annotations

from tests.evaluation.helpers import strict_json


def test_non_finite_numbers_never_reach_json(tmp_path):
    from pardec.evaluation import finite, non_finite, write_json

    rec = {"nll": float("nan"), "extras": {"x": [1.0, float("inf")]}, "ok": 2.0}
    assert non_finite(rec) == "nll" and non_finite({"a": {"b": [0.0, -float("inf")]}}) == "a.b.1"
    assert non_finite({"a": 1.0, "b": None}) is None
    assert finite(rec) == {"nll": None, "extras": {"x": [1.0, None]}, "ok": 2.0}
    write_json(tmp_path / "s.json", {"perplexity": float("nan")})
    assert strict_json(tmp_path / "s.json") == [{"perplexity": None}]
