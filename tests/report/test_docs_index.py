"""docs/README.md is the map of the documentation: every page under docs/ is linked from it (a new page that is not
fails here), the README points at it, and its results index lists every result file (generated)."""

from __future__ import annotations

import re

from pardec import REPO_ROOT
from pardec.report.docs import render_index

DOCS = REPO_ROOT / "docs"


def test_every_page_is_on_the_map_and_the_readme_points_at_it():
    index = (DOCS / "README.md").read_text()
    linked = {(DOCS / m).resolve() for m in re.findall(r"\]\(([^)#\s]+\.md)\)", index)}
    pages = {p.resolve() for p in DOCS.glob("**/*.md") if p.name != "README.md" or p.parent != DOCS}
    pages = {p for p in pages if "results" not in p.relative_to(DOCS.resolve()).parts}
    assert sorted(str(p.relative_to(DOCS.resolve())) for p in pages - linked) == []
    assert "docs/README.md" in (REPO_ROOT / "README.md").read_text()


def test_the_results_index_lists_every_result_file_once(tmp_path):
    (tmp_path / "results" / "gpu").mkdir(parents=True)
    (tmp_path / "results" / "cpu_b.json").write_text('{"title": "B", "date": "2026-11-20", "transcribed": true}')
    (tmp_path / "results" / "cpu_a.json").write_text('{"title": "A | x", "date": "2026-11-28"}')
    (tmp_path / "results" / "gpu" / "raw.json").write_text('{"command": "python -m pardec.bench gpu-speed"}')
    md = tmp_path / "README.md"
    rows = [r for r in render_index(md, tmp_path).splitlines()[2:] if r]
    assert rows == ["| cpu | [cpu_a.json](results/cpu_a.json) | A / x | 2026-11-28 | no |",
                    "| cpu | [cpu_b.json](results/cpu_b.json) | B | 2026-11-20 | yes |",
                    "| gpu | [raw.json](results/gpu/raw.json) | python -m pardec.bench gpu-speed | - | no |"]
