"""``python -m pardec.bench`` and ``python -m pardec.report``: the subcommand lists, refusals naming the bad value and
the valid choices, ``cost`` measuring a tiny model's table, ``speed``'s table from summaries (and, slow, end to end
through ``python -m evaluate`` on the tiny model)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pardec import REPO_ROOT
from pardec.bench import COMMANDS as BENCH
from pardec.bench import cost, speed
from pardec.report import COMMANDS as REPORT
from pardec.report import bench_table
from pardec.subcommands import dispatch


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True, text=True)


@pytest.mark.parametrize(("package", "commands"), [("pardec.bench", BENCH), ("pardec.report", REPORT)])
def test_help_lists_every_subcommand_and_a_bad_one_is_refused(package, commands):
    p = _run(package, "--help")
    assert p.returncode == 0 and f"usage: python -m {package}" in p.stdout
    assert all(f"\n  {name} " in p.stdout for name in commands)
    p = _run(package, "nope")
    assert p.returncode == 2
    assert f"unknown subcommand 'nope' (choose from {', '.join(commands)})" in p.stderr


def test_subcommand_help_names_its_own_prog(capsys):
    for package, name in (("pardec.bench", "cost"), ("pardec.report", "extras")):
        with pytest.raises(SystemExit) as e:
            dispatch(package, "", BENCH if package == "pardec.bench" else REPORT, [name, "--help"])
        assert e.value.code == 0
        assert f"usage: python -m {package} {name}" in capsys.readouterr().out


@pytest.mark.slow
def test_cost_measures_and_prints_the_table_of_a_tiny_model(capsys, tmp_path):
    got = dispatch("pardec.bench", "", BENCH, ["cost", "--model", "tiny_random", "--dtypes", "fp32", "--tokens",
                                              "1,3", "--repeats", "1", "--context", "8", "--threads", "1",
                                              "--no-save", "--draft", str(tmp_path / "none")])
    (key, tables), = got.items()
    table = tables["tiny_random"]
    assert key == "fp32" and set(table.ms) == {1, 3} and all(ms > 0 for ms in table.ms.values())
    assert table.relative(1) == 1.0
    out = capsys.readouterr().out
    assert "| T | tiny_random ms | tiny_random / its T=1 |" in out and "\n| 3 | " in out
    assert f"note: no draft at {tmp_path / 'none'}" in out and "saved" not in out


def test_cost_refuses_bad_values(capsys):
    with pytest.raises(SystemExit):
        cost.main(["--dtypes", "fp32:fast", "--no-save"])
    assert "--dtypes: 'fp32:fast': only int8:<recipe> and bf16:unpacked take options" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cost.main(["--forward-impl", "turbo", "--no-save"])
    assert "invalid choice: 'turbo' (choose from" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cost.main(["--model", "nope", "--dtypes", "fp32", "--no-save"])
    assert "--model 'nope': no model config" in capsys.readouterr().err


SUMMARY = {
    "dataset": "humaneval", "dtype": "fp32", "sampling": {"temperature": 0.0, "top_k": 0, "top_p": 1.0},
    "method": "lookahead", "method_params": {"window": 4, "level": 5}, "baseline": "ar", "exactness": "tokens",
    "tokens_per_s": 30.0, "speedup": 1.5, "speedup_median": 1.4, "tokens_per_forward": 2.0, "exact_match_rate": 1.0,
    "baseline_tokens_per_s": 20.0, "baseline_tokens_per_forward": 1.0, "metric_name": "pass@1", "metric": 0.5,
    "baseline_metric": 0.5, "energy": {"measured": False, "reason": "no counters"},
    "peers": {"also:pld": {"method": "pld", "params": {"num_pred": 3}, "tokens_per_s": 25.0, "speedup": 1.25,
                           "tokens_per_forward": 1.6, "exact_match_rate": 1.0, "exactness": "tokens"}},
}


def test_speed_table_has_a_row_per_role_labelled_by_non_default_params():
    rows = bench_table([SUMMARY]).splitlines()
    assert rows[2].startswith("| humaneval | fp32 | greedy | ar | distribution | 20.0 | 1.00 | 1.00 |")
    assert rows[3].startswith("| humaneval | fp32 | greedy | pld (num_pred=3) | tokens | 25.0 | 1.25 (–) | 1.60 |")
    # lookahead's level 5 is its default: only the window differs
    assert rows[4].startswith("| humaneval | fp32 | greedy | lookahead (window=4) | tokens | 30.0 | 1.50 (1.40) |")
    assert "pass@1=0.50" in rows[4] and rows[-1] == "Energy not measured: no counters."


def test_speed_refuses_bad_values_before_running_anything(tmp_path, capsys):
    with pytest.raises(SystemExit):
        speed.main(["--methods", "pld,nope", "--draft", "none", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--methods 'nope': unknown method 'nope'" in err and "Valid methods: " in err and "pld" in err
    with pytest.raises(SystemExit):
        speed.main(["--dataset-path", "gsm8k", "--draft", "none", "--out", str(tmp_path)])
    assert "--dataset-path 'gsm8k': expected NAME=FILE" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_speed_end_to_end_on_the_tiny_model(tmp_path, capsys):
    """One evaluate run (HumanEval x 1, tiny model) with a bench.also role, then the report and table.md."""
    speed.main(["--model", "tiny_random", "--datasets", "humaneval", "--n", "1", "--max-new-tokens", "4",
                "--methods", "pld,jacobi", "--draft", "none", "--no-perplexity", "--threads", "1",
                "--out", str(tmp_path), "bench.warmup=0", "bench.include_hf=false"])
    table = (tmp_path / "table.md").read_text()
    assert "| humaneval | fp32 | greedy | ar | distribution |" in table
    assert "| humaneval | fp32 | greedy | jacobi |" in table and "| humaneval | fp32 | greedy | pld |" in table
    s = json.loads((tmp_path / "runs" / "humaneval" / "summary.json").read_text())
    assert s["method"] == "pld" and s["model"] == "tiny_random"
    assert "| pld |" in (tmp_path / "report" / "report.md").read_text()
