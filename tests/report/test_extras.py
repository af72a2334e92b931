"""pardec.report.extras (``python -m pardec.report extras``): method extras per (dataset, role), averaged over prompts
(summed for the Ouroboros split), the run's method labelled by its non-default parameters."""

from __future__ import annotations

import json

from pardec.report import COMMANDS
from pardec.subcommands import dispatch


def test_extras_rows_per_role(tmp_path, capsys):
    run = tmp_path / "runs" / "gsm8k"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({"dataset": "gsm8k", "method": "ouroboros",
                                                  "method_params": {"gamma": 4}}))
    recs = [{"role": "method", "extras": {"block_efficiency": b, "accepted_from_draft": 3}} for b in (2.0, 3.0)]
    recs += [{"role": "also:lookahead", "extras": {"pool_hit_rate": 0.5}}, {"role": "baseline", "extras": {}},
             {"role": "method", "error": "boom"}]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = dispatch("pardec.report", "", COMMANDS,
                    ["extras", str(run), "--keys", "block_efficiency,accepted_from_draft,pool_hit_rate"])
    lines = text.splitlines()
    assert lines[0] == "| dataset | role | n | block_efficiency | accepted_from_draft | pool_hit_rate |"
    assert "| gsm8k | lookahead | 1 | – | – | 0.50 |" in lines
    assert "| gsm8k | ouroboros (gamma=4) | 2 | 2.50 | 6 | – |" in lines
    assert text in capsys.readouterr().out
