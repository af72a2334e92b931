"""scripts/host_reads.py: host reads per forward on a virtual GPU, with the sites named by --trace."""

from __future__ import annotations

import json

import pytest

from scripts import host_reads


def test_host_reads_counts_and_names_sites(tmp_path, capsys):
    out = tmp_path / "reads.json"
    assert host_reads.main(["--methods", "ar,jacobi,sps", "--new-tokens", "8", "--trace", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ar", "jacobi", "sps"} and all(r["tokens"] == 8 for r in rows.values())
    # one read per target forward (+ the prompt's and the prefill's), the budgets tests/decoding hold per method
    assert rows["ar"]["reads"] <= rows["ar"]["target_forwards"] + 2
    assert rows["jacobi"]["reads"] <= rows["jacobi"]["target_forwards"] + 2
    assert rows["sps"]["draft_forwards"] > 0 and rows["sps"]["reads"] <= rows["sps"]["target_forwards"] + 2
    assert all(site["where"].endswith(tuple("0123456789")) for site in rows["ar"]["sites"])
    assert "| jacobi | greedy | 8 |" in capsys.readouterr().out


def test_host_reads_refuses_unknown_methods(capsys):
    with pytest.raises(SystemExit):
        host_reads.main(["--methods", "ar,bogus"])
    assert "--methods ['bogus'] not valid; choose from:" in capsys.readouterr().err
