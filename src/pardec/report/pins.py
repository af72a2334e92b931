"""Figures pinned to the field that holds them, for ``python -m pardec.report docs --check``.

A pinned figure is a markdown link whose text quotes the figure and whose target is a result file with a JSON
pointer (RFC 6901) to one field: ``[1.92×](docs/results/cpu_cost_avx2.json#/tables/table1/rows/3/2)``. The check
resolves the pointer and compares every figure of the link's text with the numbers of that field alone (at the
figure's precision, a share also as a percentage): a pointer that resolves to nothing fails, and so does a figure
the field does not hold (an invented or a drifted one).

On a **strict** page (:data:`STRICT_PAGES`: the README, the front door) every figure of the prose must be pinned;
elsewhere an unpinned figure needs only to be in a file its page cites (``pardec.report.docs.unsourced``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

#: pages whose every prose figure must be pinned to its field (paths relative to the repository root)
STRICT_PAGES = ("README.md",)
PINNED = re.compile(r"\[(?P<text>[^\]\n]*)\]\((?P<file>[^)\s#]+\.json)#(?P<pointer>/[^)\s]*)\)")


class PointerError(KeyError):
    pass


def resolve(data, pointer: str):
    """The value at JSON ``pointer`` (``/a/0/b``; ``~1`` is ``/``, ``~0`` is ``~``) of ``data``."""
    node = data
    for raw in pointer.split("/")[1:]:
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise PointerError(f"no item {key!r} (a list of {len(node)})")
            node = node[int(key)]
        elif isinstance(node, dict):
            if key not in node:
                raise PointerError(f"no key {key!r}")
            node = node[key]
        else:
            raise PointerError(f"{key!r} below a {type(node).__name__}")
    return node


def holds(fig: str, numbers: set[float]) -> bool:
    """Whether ``numbers`` hold the figure as written (at its precision; a share also as a percentage)."""
    v = float(fig.replace(",", ""))
    places = len(fig.split(".")[1]) if "." in fig else 0
    tol = 0.5 * 10 ** -places + 1e-9
    return any(abs(x - v) <= tol or abs(100 * x - v) <= tol for x in numbers)


def _target(ref: str, md_file: Path, root: Path) -> Path | None:
    for base in (md_file.parent, root / "docs", root):
        p = (base / ref).resolve()
        if p.is_file():
            return p
    return None


def pin_problems(md_file: Path, root: Path, figures, numbers) -> list[str]:
    """What fails among ``md_file``'s pinned figures, and on a strict page its unpinned ones (``figures(text)``: the
    prose figures of a text; ``numbers(value)``: the numbers a field holds), one line each naming the page."""
    page = md_file.relative_to(root).as_posix()
    text = md_file.read_text()
    out = []
    for m in PINNED.finditer(text):
        link = m[0]
        path = _target(m["file"], md_file, root)
        if path is None:
            out.append(f"{page}: {link}: no file {m['file']}")
            continue
        try:
            value = resolve(json.loads(path.read_text()), m["pointer"])
        except PointerError as e:
            out.append(f"{page}: {link}: the pointer {m['pointer']} resolves to nothing in {m['file']} ({e.args[0]})")
            continue
        held = numbers(value)
        for fig in figures(m["text"]):
            if not holds(fig, held):
                out.append(f"{page}: {link}: says {fig}, but the field holds {json.dumps(value)[:80]}")
    if page in STRICT_PAGES:
        for fig in figures(PINNED.sub(" ", text)):
            out.append(f"{page}: {fig} is not pinned: link it to the field that holds it "
                       f"([{fig}](docs/results/<file>.json#/<pointer>))")
    return out
