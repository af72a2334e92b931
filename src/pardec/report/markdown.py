"""The one markdown table renderer of pardec's reports (and of the generated docs tables)."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[object]], centered: bool = False) -> str:
    """A markdown table of ``rows`` under ``columns`` (cells as ``str(cell)``), no trailing newline; ``centered``:
    every column after the first centred."""
    rule = "|" + "|".join(["---"] + [":-:" if centered else "---"] * (len(columns) - 1)) + "|"
    lines = ["| " + " | ".join(columns) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)
