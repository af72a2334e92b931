"""pardec.evaluation.tables: the comparison rows and the printed tables of a summary."""

from __future__ import annotations

from pardec.evaluation import comparison_rows, format_comparison, format_table

SUMMARY = {
    "method": "pld", "baseline": "ar", "dataset": "humaneval", "model": "tiny_random", "draft": None, "dtype": "fp32",
    "n_samples": 2, "repeats": 1, "exactness": "distribution", "tokens_per_s": 20.0, "tokens_per_s_std": None,
    "baseline_tokens_per_s": 10.0, "baseline_tokens_per_s_std": None, "hf_tokens_per_s": None, "speedup": 2.0,
    "speedup_std": None, "speedup_median": 2.0, "tokens_per_forward": 1.5, "exact_match_rate": 1.0,
    "metric_name": "pass", "metric": 0.5, "baseline_metric": 0.5, "perplexity": None, "baseline_perplexity": None,
    "energy": {"measured": False, "reason": "no counters"}, "peak_rss_mb": 100.0, "extras": {}, "skipped": [],
    "n_errors": 0, "errors": [], "peers": {},
}


def test_comparison_rows_put_the_baseline_first():
    rows = comparison_rows(SUMMARY)
    assert [r["role"] for r in rows] == ["baseline", "method"]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == 2.0 and rows[1]["method"] == "pld"
    head, base, method = format_comparison({**SUMMARY, "decode_tokens_per_s": 23.5}).splitlines()
    assert "decode tokens/s" in head and "23.50" in method.split()
    assert "speedup vs ar" in head and base.split()[:2] == ["baseline", "ar"] and "2.00" in method.split()


def test_format_table_says_what_was_not_measured():
    table = format_table(SUMMARY)
    assert "not measured: no counters" in table and "pass (method / baseline)" in table
    assert table.endswith(format_comparison(SUMMARY))


def test_divergences_and_ranks_get_a_row_when_there_are_any():
    assert "divergences" not in format_table({**SUMMARY, "n_divergences": 0, "n_near_ties": 0})
    s = {**SUMMARY, "dtype": "bf16", "n_divergences": 3, "n_near_ties": 2, "near_tie_ulps": 4,
         "peers": {"also:jacobi": {"method": "jacobi", "tokens_per_s": 1.0, "speedup": 0.1, "tokens_per_forward": 1.0,
                                   "exact_match_rate": 0.5, "n_divergences": 1, "n_near_ties": 0}},
         "ranks": [{"rank": 0, "host": "n1", "device": "cuda:0"}, {"rank": 1, "host": "n1", "device": "cuda:1"}]}
    rows = dict(line.split("  ", 1) for line in format_table(s).split("\n\n")[0].splitlines())
    assert rows["divergences (near-ties)"].strip() == ("method 3 (2), also:jacobi 1 (0); near-tie: target margin < 4 "
                                                       "ulps of bf16")
    assert rows["ranks"].strip() == "0: n1 cuda:0; 1: n1 cuda:1"
