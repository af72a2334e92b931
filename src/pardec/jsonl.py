"""JSON Lines, the format of every incremental artifact (results, trajectories) and of local datasets.

Writers append whole lines and fsync, so a kill can only leave a last line without its newline; readers
treat that line as not written (and, with ``repair``, cut it off before the writer appends again). A
malformed line anywhere else is an error naming the file and the line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)


def read_jsonl(path: str | Path, error: type[Exception] = ValueError, repair: bool = False,
               missing_ok: bool = False) -> list[dict]:
    """Records of ``path``. ``error`` is raised for a missing file (unless ``missing_ok``) or a malformed line."""
    p = Path(path)
    if not p.is_file():
        if missing_ok:
            return []
        raise error(f"file {p} does not exist")
    data = p.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if data[end:].strip() and _is_json(data[end:]) and not repair:
            end = len(data)  # a hand-written file whose last line simply lacks its newline
        else:
            log.warning("%s: ignoring a truncated last line (%d bytes) left by an interrupted writer", p,
                        len(data) - end)
            if repair:
                with p.open("r+b") as f:
                    f.truncate(end)
    rows = []
    for i, line in enumerate(data[:end].decode("utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise error(f"{p}, line {i}: malformed JSON ({e.msg})") from None
    return rows


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
