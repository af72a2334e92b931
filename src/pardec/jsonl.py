"""JSON Lines, the format of every incremental artifact (results, trajectories) and of local datasets, and the
JSON files beside them.

pardec's own logs are written by appending whole lines and fsyncing, so a kill can only leave a last line without
its newline: their readers (``torn_ok=True``) treat that line as not written (and, with ``repair``, cut it off
before the writer appends again). Everything else, a user's dataset or training source above all, is read
strictly: a malformed line anywhere, the last one included, is an error naming the file and the line (1-based,
blank lines counted), and so is a byte that is not UTF-8. :class:`Rows` keep each record's line for later messages
(:func:`record_at`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


class Rows(list):
    """A file's records, with ``lines[i]`` the 1-based line of record ``i``."""

    def __init__(self, rows=(), lines=()):
        super().__init__(rows)
        self.lines = list(lines)


def record_at(rows, i: int, path) -> str:
    """``<path>, line <n>`` of record ``i`` of ``rows`` (:class:`Rows` read from a file), else ``<path>, record
    <i + 1>`` (rows from the hub or a JSON list)."""
    lines = getattr(rows, "lines", None)
    return f"{path}, line {lines[i]}" if lines and i < len(lines) else f"{path}, record {i + 1}"


def _decode(data: bytes, p: Path, error: type[Exception]) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise error(f"{p}, line {line}: not UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8") from None


def read_jsonl(path: str | Path, error: type[Exception] = ValueError, repair: bool = False,
               missing_ok: bool = False, torn_ok: bool = False) -> Rows:
    """Records of ``path`` (module docstring). ``error`` is raised for a missing file (unless ``missing_ok``), a
    malformed line or a byte that is not UTF-8; ``torn_ok``: pardec's own append-only log, whose unparseable last
    line without a newline was cut by a kill (warned and skipped, or cut off with ``repair``)."""
    p = Path(path)
    if not p.is_file():
        if missing_ok:
            return Rows()
        raise error(f"file {p} does not exist")
    data = p.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if not torn_ok or (data[end:].strip() and _is_json(data[end:]) and not repair):
            end = len(data)  # a hand-written file whose last line lacks its newline: read (and checked) as any line
        else:
            log.warning("%s: ignoring a truncated last line (%d bytes) left by an interrupted writer", p,
                        len(data) - end)
            if repair:
                with p.open("r+b") as f:
                    f.truncate(end)
    rows, lines = [], []
    for i, line in enumerate(_decode(data[:end], p, error).splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise error(f"{p}, line {i}: malformed JSON ({e.msg}, column {e.colno})") from None
        lines.append(i)
    return Rows(rows, lines)


def read_json(path: str | Path, error: type[Exception] = ValueError, what: str = "") -> object:
    """One JSON file (``run.json``, a stage's meta file, a dataset's JSON list): an ``error`` naming the file, and
    the line and column, for malformed JSON or a byte that is not UTF-8 (``what``: what the file is, prefixed)."""
    p = Path(path)
    head = f"{what} " if what else ""
    text = _decode(p.read_bytes(), p, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"{head}{p}, line {e.lineno} column {e.colno}: malformed JSON ({e.msg})") from None


def _is_json(raw: bytes) -> bool:
    try:
        json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return True


def append_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """Append one line per record, then flush and fsync: what returns is on disk."""
    with Path(path).open("a", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """``records`` as JSONL at ``path``, atomically (a temporary file renamed over it): a kill leaves the old file or
    the new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":"), allow_nan=False) + "\n")
    tmp.replace(path)


def read_versioned(path: str | Path, fmt: str, version: int, error: type[Exception], where: str,
                   hint: str = "") -> dict:
    """A JSON file that names its ``format`` and ``version`` (drafter.json, a zoo manifest): one ``error`` line
    starting with ``where`` for invalid JSON or another format or version (``hint``: what to do, appended)."""
    f = Path(path)
    tail = f"; {hint}" if hint else ""
    try:
        data = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{where}: {f} is not valid JSON ({e}){tail}") from None
    if data.get("format") != fmt or data.get("version") != version:
        raise error(f"{where}: {f} has format {data.get('format')!r} version {data.get('version')!r}; expected "
                    f"{fmt!r} version {version}{tail}")
    return data
