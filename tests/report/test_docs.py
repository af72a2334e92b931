"""pardec.report docs: the committed pages match their result files; the renderer on made-up data."""

import json
from pathlib import Path

import pytest

from pardec.report import docs
from pardec.report.markdown import method_label

REPO = Path(__file__).resolve().parents[2]


def test_committed_pages_match_their_result_files():
    assert docs.check(REPO) == []


def _repo(tmp_path: Path, value: str = "1.50×") -> Path:
    (tmp_path / "docs" / "results").mkdir(parents=True)
    result = {"title": "t", "date": "2026-11-20", "transcribed": True,
              "tables": {"speed": {"columns": ["method", "× ar"], "rows": [["pld", value]]}},
              "leaderboard": [
                  {"method": "pld", "host_class": "cpu-fp32", "mode": "fp32", "dataset": "GSM8K", "speedup": 1.5,
                   "exact_match_rate": 1.0, "tokens_per_forward": 2.4, "host": "a"},
                  {"method": "pld", "host_class": "cpu-fp32", "mode": "fp32", "dataset": "HumanEval", "speedup": 1.2,
                   "exact_match_rate": 1.0, "tokens_per_forward": 2.0, "host": "a"}]}
    newer = {"date": "2026-11-25", "leaderboard": [
        {"method": "pld", "host_class": "cpu-fp32", "mode": "fp32", "dataset": "CNN/DM", "speedup": 1.5,
         "exact_match_rate": None, "tokens_per_forward": None, "host": "b"},
        {"method": "pld", "host_class": "gpu", "mode": "cudagraph bf16", "dataset": "GSM8K", "speedup": 2.0,
         "exact_match_rate": 0.4, "tokens_per_forward": 2.3, "host": "H200"}]}
    (tmp_path / "docs" / "results" / "a.json").write_text(json.dumps(result))
    (tmp_path / "docs" / "results" / "b.json").write_text(json.dumps(newer))
    (tmp_path / "README.md").write_text("# x\n\n<!-- leaderboard -->\nold\n<!-- /leaderboard -->\n")
    (tmp_path / "docs" / "page.md").write_text("text\n<!-- table: results/a.json#speed -->\nstale\n<!-- /table -->\nend\n")
    return tmp_path


def test_a_block_is_rewritten_and_then_checks_clean(tmp_path, capsys):
    root = _repo(tmp_path)
    assert docs.main(["--root", str(root), "--check"]) == 1
    assert docs.main(["--root", str(root)]) == 0
    page = (root / "docs" / "page.md").read_text()
    assert "| pld | 1.50× |" in page and "stale" not in page
    assert page.startswith("text\n<!-- table: results/a.json#speed -->\n") and page.endswith("<!-- /table -->\nend\n")
    assert "[results/a.json](results/a.json)" in page
    assert docs.main(["--root", str(root), "--check"]) == 0


def test_check_names_the_block_whose_number_drifted(tmp_path, capsys):
    root = _repo(tmp_path)
    docs.main(["--root", str(root)])
    (root / "docs" / "page.md").write_text((root / "docs" / "page.md").read_text().replace("1.50×", "1.51×"))
    before = (root / "docs" / "page.md").read_text()
    assert docs.main(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "docs/page.md: table results/a.json#speed" in err and "README.md" not in err
    assert (root / "docs" / "page.md").read_text() == before  # --check writes nothing


@pytest.mark.parametrize("marker, needle, choices", [
    ("results/missing.json#speed", "'results/missing.json'", "results/a.json, results/b.json"),
    ("results/a.json#nope", "'nope'", "valid choices: speed"),
])
def test_a_bad_marker_is_refused_naming_the_value_and_the_choices(tmp_path, capsys, marker, needle, choices):
    root = _repo(tmp_path)
    (root / "docs" / "page.md").write_text(f"<!-- table: {marker} -->\n<!-- /table -->\n")
    with pytest.raises(docs.DocsError) as e:
        docs.check(root)
    assert needle in str(e.value) and choices in str(e.value)
    assert docs.main(["--root", str(root)]) == 2
    assert needle in capsys.readouterr().err


def test_the_leaderboard_picks_the_best_entry_per_host_class(tmp_path):
    root = _repo(tmp_path)
    docs.main(["--root", str(root)])
    board = (root / "README.md").read_text()
    row = next(line for line in board.splitlines() if line.startswith("| `pld`"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1] == "1.50× (CNN/DM; EM –, – tok/fwd) [↗](docs/results/b.json)"  # a tie: the newer date wins
    assert cells[2] == "—"
    assert cells[3].startswith("2.00× (cudagraph bf16, GSM8K; EM 0.40, 2.30 tok/fwd)")


def test_a_bad_host_class_is_refused(tmp_path):
    root = _repo(tmp_path)
    bad = {"leaderboard": [{"method": "pld", "host_class": "tpu", "mode": "x", "dataset": "d", "speedup": 1.0,
                            "exact_match_rate": None, "tokens_per_forward": None, "host": "h"}]}
    (root / "docs" / "results" / "c.json").write_text(json.dumps(bad))
    with pytest.raises(docs.DocsError, match="'tpu'.*cpu-fp32, cpu-fast, gpu"):
        docs.check(root)


def test_bad_arguments_are_refused_by_name(tmp_path, capsys):
    with pytest.raises(SystemExit):
        docs.main(["--chek"])
    assert "--chek" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        docs.main(["--root", str(tmp_path)])
    assert "--root" in capsys.readouterr().err


def test_the_leaderboard_prefers_exact_entries_and_names_a_faster_inexact_one(tmp_path):
    root = _repo(tmp_path)
    fast = {"date": "2026-11-26", "leaderboard": [
        {"method": "pld", "host_class": "cpu-fast", "mode": "int8", "dataset": "GSM8K", "speedup": 2.1,
         "exact_match_rate": 0.0, "tokens_per_forward": 3.2, "host": "c"},
        {"method": "pld", "host_class": "cpu-fast", "mode": "int8 invariant", "dataset": "GSM8K", "speedup": 1.8,
         "exact_match_rate": 1.0, "tokens_per_forward": 3.0, "host": "c"},
        {"method": "pld", "host_class": "gpu", "mode": "cudagraph fp32", "dataset": "GSM8K", "speedup": 1.1,
         "exact_match_rate": 1.0, "tokens_per_forward": 2.3, "host": "H200"}]}
    (root / "docs" / "results" / "c.json").write_text(json.dumps(fast))
    docs.main(["--root", str(root)])
    row = next(line for line in (root / "README.md").read_text().splitlines() if line.startswith("| `pld`"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[2] == ("1.80× (int8 invariant, GSM8K; EM 1.00, 3.00 tok/fwd) [↗](docs/results/c.json); "
                        "not exact: 2.10× (int8, EM 0.00) [↗](docs/results/c.json)")
    assert cells[3].startswith("1.10× (cudagraph fp32, GSM8K; EM 1.00") and "not exact: 2.00×" in cells[3]
    # with no exact entry, the fastest is shown alone
    only = {"leaderboard": [fast["leaderboard"][0]]}
    (root / "docs" / "results" / "c.json").write_text(json.dumps(only))
    docs.main(["--root", str(root)])
    row = next(line for line in (root / "README.md").read_text().splitlines() if line.startswith("| `pld`"))
    assert [c.strip() for c in row.strip("|").split(" | ")][2] == \
        "2.10× (int8, GSM8K; EM 0.00, 3.18 tok/fwd) [↗](docs/results/c.json)".replace("3.18", "3.20")


def test_a_config_block_quotes_its_file_whole_and_a_missing_one_is_refused(tmp_path):
    root = _repo(tmp_path)
    (root / "conf" / "method").mkdir(parents=True)
    (root / "conf" / "method" / "pld.yaml").write_text("# pld (Saxena 2023)\nname: pld\nnum_pred: 10\n")
    docs.main(["--root", str(root)])  # (the README's leaderboard)
    (root / "docs" / "page.md").write_text("x\n<!-- config: conf/method/pld.yaml -->\nold copy\n<!-- /config -->\n")
    assert docs.check(root) == ["docs/page.md: config conf/method/pld.yaml"]
    docs.main(["--root", str(root)])
    assert (root / "docs" / "page.md").read_text() == (
        "x\n<!-- config: conf/method/pld.yaml -->\n```yaml\n# conf/method/pld.yaml\n# pld (Saxena 2023)\nname: pld\n"
        "num_pred: 10\n```\n<!-- /config -->\n")
    (root / "conf" / "method" / "pld.yaml").write_text("name: pld\nnum_pred: 12\n")  # the config changed
    assert docs.check(root) == ["docs/page.md: config conf/method/pld.yaml"]
    (root / "docs" / "page.md").write_text("<!-- config: conf/method/pdl.yaml -->\n<!-- /config -->\n")
    with pytest.raises(docs.DocsError, match="'conf/method/pdl.yaml'.*valid choices: conf/method/pld.yaml"):
        docs.check(root)


def test_writing_also_plots_the_cpu_fp32_column(tmp_path):
    root = _repo(tmp_path)
    assert docs.main(["--root", str(root), "--no-plot"]) == 0
    assert not (root / "docs" / "img").exists()
    assert docs.main(["--root", str(root)]) == 0
    png = root / "docs" / "img" / "leaderboard_cpu_fp32.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_committed_pages_quote_no_figure_without_a_source():
    assert docs.check_figures(REPO) == []


def test_prose_figures_skip_code_links_versions_and_generated_blocks():
    text = ("pld ran 1.17× (median 1.09) on 1,381 prompts, 40 % of rounds, 3× fewer; torch 2.13.0, arXiv 2602.06036, "
            "`lr 0.5`, §3.4, Table 2.1, [page](results/x_1.5.json)\n```\n9.99\n```\n<!-- table: results/a.json#t -->\n| 7.77 |\n"
            "<!-- /table -->\n<!-- a note 8.88 -->\n")
    assert docs.prose_figures(text) == ["1.17", "1.09", "1,381", "40", "3"]


def test_a_figure_is_sourced_only_by_a_file_its_page_cites(tmp_path, capsys):
    root = _repo(tmp_path)
    docs.main(["--root", str(root)])
    page = root / "docs" / "page.md"
    (root / "docs" / "results" / "c.json").write_text(json.dumps({"figures": {"share": 0.4237, "speed": 1.168}}))
    page.write_text(page.read_text() + "pld reached 2.40 tokens per forward and 1.17× in 42.4 % of rounds.\n")
    # 2.40 is in a.json, which the table marker cites; c.json holds 1.17 and 42.4 % but the page does not cite it
    assert docs.unsourced(page, root) == ["1.17", "42.4"]
    assert docs.main(["--root", str(root), "--check"]) == 1
    err = capsys.readouterr().err
    assert "a figure no cited result file holds: docs/page.md: 1.17" in err and "1 block" not in err
    page.write_text(page.read_text() + "([data](results/c.json))\n")
    assert docs.unsourced(page, root) == []
    page.write_text(page.read_text().replace("1.17×", "1.18×"))  # a drifted figure: c.json says 1.168
    assert docs.unsourced(page, root) == ["1.18"]
    raw = root / "docs" / "results" / "gpu"
    raw.mkdir()
    (raw / "run.md").write_text("| 5.55 |\n")  # raw records under docs/results/ are data, not pages
    assert docs.check_figures(root) == ["docs/page.md: 1.18"]


def test_the_acceptance_plot_reads_the_newest_side_by_side_and_the_held_out_evals(tmp_path):
    root = _repo(tmp_path)
    results = root / "docs" / "results"
    out = root / "docs" / "img" / "acceptance_by_position.png"
    assert docs.plot_acceptance(root, out) is None and not out.exists()  # no side-by-side run: no plot
    methods = {"pld": {"acceptance_by_position": [0.3, 0.2]}, "eagle3:path=/x/final:mode=chain": {
        "acceptance_by_position": [0.4, 0.1, 0.05]}, "ar": {"tokens_per_forward": 1.0}}
    (results / "side_by_side_2026-11-28.json").write_text(json.dumps(
        {"date": "2026-11-28", "dtype": "fp32", "datasets": {"gsm8k": {"n_samples": 20, "methods": methods}}}))
    (results / "eagle3_smollm2_2026-11-28.json").write_text(json.dumps(
        {"steps": 120, "drafter_eval": {"kind": "eagle3", "overall": {"chain_acceptance": [0.37, 0.17]}}}))
    assert docs.plot_acceptance(root, out) == out and out.stat().st_size > 0
    assert method_label("eagle3:path=/x/final:mode=chain") == method_label("eagle3:path=zoo:eagle3:mode=chain") == \
        "eagle3 mode=chain"


def test_a_pinned_figure_is_its_fields_and_the_readme_pins_every_figure(tmp_path, capsys):
    """--check fails an invented figure (the README line of issue 71, which passed before because any equal number
    in any cited file counted), a drifted pinned figure and a pointer to nothing; a correct pinned figure passes."""
    root = _repo(tmp_path)
    docs.main(["--root", str(root), "--no-plot"])
    readme = root / "README.md"
    base = readme.read_text()
    assert docs.main(["--root", str(root), "--check"]) == 0
    # invented: 1.5 is in b.json (cited), yet the README must pin it to the field that holds it
    readme.write_text(base + "\npld runs at 1.50× `ar` ([data](docs/results/b.json)).\n")
    assert docs.main(["--root", str(root), "--check"]) == 1
    assert "README.md: 1.50 is not pinned" in capsys.readouterr().err
    pin = "[1.50×](docs/results/b.json#/leaderboard/0/speedup)"
    readme.write_text(base + f"\npld runs at {pin} `ar` on CNN/DM.\n")
    assert docs.check_pins(root) == [] and docs.main(["--root", str(root), "--check"]) == 0
    # drifted: the field holds 1.5
    readme.write_text(base + "\npld runs at [1.52×](docs/results/b.json#/leaderboard/0/speedup) `ar`.\n")
    assert docs.check_pins(root) == ["README.md: [1.52×](docs/results/b.json#/leaderboard/0/speedup): says 1.52, "
                                     "but the field holds 1.5"]
    # pinned to another field that holds another number (the GPU entry's 2.0)
    readme.write_text(base + "\npld runs at [1.50×](docs/results/b.json#/leaderboard/1/speedup) `ar`.\n")
    assert "says 1.50, but the field holds 2.0" in docs.check_pins(root)[0]
    for ptr, why in (("/leaderboard/7/speedup", "no item '7' (a list of 2)"), ("/board", "no key 'board'")):
        readme.write_text(base + f"\npld runs at [1.50×](docs/results/b.json#{ptr}) `ar`.\n")
        assert docs.check_pins(root) == [f"README.md: [1.50×](docs/results/b.json#{ptr}): the pointer {ptr} "
                                         f"resolves to nothing in docs/results/b.json ({why})"]
    # elsewhere a pinned figure is checked the same way; an unpinned one needs only a cited file
    readme.write_text(base)
    page = root / "docs" / "page.md"
    page.write_text(page.read_text() + "\n[2.45](results/a.json#/leaderboard/0/tokens_per_forward) per forward.\n")
    assert docs.check_pins(root) == ["docs/page.md: [2.45](results/a.json#/leaderboard/0/tokens_per_forward): "
                                     "says 2.45, but the field holds 2.4"]
