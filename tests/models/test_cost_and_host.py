"""The per-machine forward-cost table (pardec.models.cost): choice of the cheapest row count, storage keyed by the
machine, and a measurement on a tiny model."""

from __future__ import annotations

import pardec.models.host as host
from pardec.bench.cost import measure
from pardec.models.cost import CostTable
from tests.conftest import tiny


def test_cheapest_row_count_at_least_n():
    # the shape measured on an AVX2 EPYC (fp32, 2 threads): 3 rows cost more than 5
    t = CostTable("m", "fp32", 200, {1: 46.7, 2: 68.6, 3: 85.9, 4: 80.3, 5: 66.8, 8: 71.5, 16: 89.2}, machine={})
    assert [t.cheapest_at_least(n) for n in (1, 2, 3, 4, 5, 6, 8, 16)] == [1, 5, 5, 5, 5, 6, 8, 16]
    assert t.cheapest_at_least(7) == 7  # not measured: as asked
    assert abs(t.relative(3) - 85.9 / 46.7) < 1e-12 and t.relative(7) is None
    flat = CostTable("m", "int8", 200, {1: 16.0, 2: 16.0, 3: 16.0}, machine={})
    assert flat.cheapest_at_least(2) == 2  # ties: the fewer rows


def test_tables_are_stored_per_machine(tmp_path, monkeypatch):
    t = CostTable("smollm2_135m", "int8", 200, {1: 16.1, 5: 16.5})
    f = t.save(tmp_path)
    assert f.parent.name == host.machine_key() and f.name == "smollm2_135m-int8.json"
    back = CostTable.load("smollm2_135m", "int8", tmp_path)
    assert back.ms == {1: 16.1, 5: 16.5} and back.machine == t.machine
    assert CostTable.load("smollm2_135m", "fp32", tmp_path) is None
    monkeypatch.setattr(host, "cpu_flags", lambda: ["avx2", "avx512f", "amx_tile"])  # another machine
    assert CostTable.load("smollm2_135m", "int8", tmp_path) is None


def test_int8_recipes_have_tables_of_their_own(tmp_path):
    """fbgemm's dynamic int8 is nearly flat from 1 to 5 rows, weight-only int8 costs 2.2x at 5: a table measured
    under one recipe must not pad the forwards of another (evaluation looks tables up by ModelConfig.precision())."""
    from pardec.config import ModelConfig

    default = ModelConfig(dtype="int8")
    wo = ModelConfig(dtype="int8", int8_weights="weight_only", int8_smooth=None, int8_skip=[])
    assert default.precision() == "int8-per_token-smooth0.5"
    assert wo.precision() == "int8-weight_only" and ModelConfig(dtype="bf16").precision() == "bf16"
    CostTable("smollm2_135m", default.precision(), 200, {1: 16.1, 5: 16.5}).save(tmp_path)
    assert CostTable.load("smollm2_135m", default.precision(), tmp_path).ms[5] == 16.5
    assert CostTable.load("smollm2_135m", wo.precision(), tmp_path) is None


def test_each_forward_has_a_table_of_its_own(tmp_path):
    """A compiled forward's rows cost differently from an eager one's: a run looks up its own forward's table
    (``table_key``) and no other: one measured on transformers' SDPA forward does not pad a compiled forward."""
    from pardec.models.cost import table_key

    p = "int8-per_token-smooth0.5"
    assert table_key(p) == p and table_key(p, "compiled") == f"{p}-compiled"
    assert table_key("fp32", "hf", "invariant") == "fp32-invariant"
    assert table_key("fp32", "lean", "eager") == "fp32-lean-eager"
    assert CostTable.find("smollm2_135m", p, "compiled", root=tmp_path) is None
    CostTable("smollm2_135m", p, 200, {1: 26.7, 16: 42.1}).save(tmp_path)
    assert CostTable.find("smollm2_135m", p, "compiled", root=tmp_path) is None  # no fallback to another forward's
    CostTable("smollm2_135m", table_key(p, "compiled"), 200, {1: 25.2, 16: 30.0}).save(tmp_path)
    assert CostTable.find("smollm2_135m", p, "compiled", root=tmp_path).ms[16] == 30.0
    assert CostTable.find("smollm2_135m", p, root=tmp_path).ms[16] == 42.1
    assert CostTable.find("smollm2_135m", "fp32", "compiled", root=tmp_path) is None


def test_best_draft_length_trades_expected_tokens_for_measured_ms():
    from pardec.models.cost import best_draft_length

    t = CostTable("m", "int8", 200, {1: 26.7, 2: 30.2, 4: 32.0, 5: 31.6, 8: 32.8, 16: 42.1}, machine={})
    # prompt lookup (no draft cost), accepting most tokens: up to 7 drafted tokens ride in an 8-row forward; 10
    # would need the 16-row one, 1.28x dearer for at most 3 more tokens
    assert best_draft_length(t, accepted=900, rejections=100, draft_ms=0.0, lo=1, hi=10) == 7
    # accepting few: one drafted token (a 2-row forward) beats a padded 5-row one
    assert best_draft_length(t, accepted=10, rejections=100, draft_ms=0.0, lo=1, hi=10) == 1
    assert best_draft_length(t, accepted=900, rejections=100, draft_ms=0.0, lo=1, hi=3) == 3  # hi caps it
    assert best_draft_length(t, accepted=900, rejections=100, draft_ms=0.0, lo=2, hi=1) == 2  # lo wins
    assert best_draft_length(t, accepted=900, rejections=1, draft_ms=0.0, lo=1, hi=40) == 15  # 16 rows, no more


def test_machine_names_the_cpu_flags_and_threads():
    m = host.machine()
    assert set(m) >= {"cpu", "flags", "cores", "threads", "torch"} and m["threads"] >= 1
    assert set(m["flags"]) <= set(host.VECTOR_FLAGS)
    assert m["cpu"] in host.describe(m) and f"{m['threads']} threads" in host.describe(m)


def test_measure_times_every_row_count_and_leaves_the_cache_as_it_was():
    table = measure(tiny(0).model, list(range(3, 40)), [1, 2, 4], "tiny", "fp32", repeats=2, warmup=1)
    assert sorted(table.ms) == [1, 2, 4] and all(v > 0 for v in table.ms.values())
    assert table.context == 37 - 4
