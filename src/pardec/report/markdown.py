"""The one markdown table renderer of pardec's reports (and of the generated docs tables), a page's relative links,
and the error a page's generated block raises."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

MISSING = "–"  # a cell with no value (None)


class DocsError(ValueError):
    """A marked block that cannot be rendered: names the bad value and the valid choices."""


def _rel(target: Path, md_file: Path) -> str:
    return Path(os.path.relpath(target, md_file.parent)).as_posix()


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]], centered: bool = False) -> str:
    """A markdown table of ``rows`` under ``columns`` (cells as ``str(cell)``, ``None`` as MISSING), no trailing newline; ``centered``:
    every column after the first centred."""
    rule = "|" + "|".join(["---"] + [":-:" if centered else "---"] * (len(columns) - 1)) + "|"
    lines = ["| " + " | ".join(columns) + " |", rule]
    lines += ["| " + " | ".join(MISSING if c is None else str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def method_label(spec: str) -> str:
    """A bench method spec without its drafter paths, for a label: ``eagle3:path=zoo:eagle3:mode=chain`` ->
    ``eagle3 mode=chain`` (parameters split as :func:`pardec.evaluation.spec.split_method` splits them)."""
    from pardec.evaluation.spec import split_method  # heavy: hydra, omegaconf

    name, *params = split_method(spec)
    return " ".join([name, *(p for p in params if p.split("=")[0] not in ("path", "draft"))])
