"""scripts/ragged_invariance.py on the tiny model in int8: with invariant attention every position of every prompt
is bitwise batch-1 ``ar``'s, and the result file says what it compared."""

from __future__ import annotations

import json

from scripts import ragged_invariance


def test_invariant_rows_are_bitwise_and_the_result_file_is_written(tmp_path):
    out = tmp_path / "r.json"
    result = ragged_invariance.main(["--model", "tiny_random", "--dtype", "int8", "--steps", "4", "--out", str(out)])
    assert result["bitwise_equal"]["invariant"] == [5, 5, 5] and len(result["bitwise_equal"]["sdpa"]) == 3
    saved = json.loads(out.read_text())
    assert saved["dtype"] == "int8" and saved["n"] == 3 and saved["host"]["cores"] >= 1 and saved["command"]
