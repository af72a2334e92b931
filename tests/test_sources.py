"""Every Python source of the package, scripts and entry points compiles without a warning: an invalid escape
sequence in a docstring is a DeprecationWarning on Python 3.11 (this machine) but a SyntaxWarning printed at every
import on 3.12 (the GPU image's Python), and an error in a later Python."""

import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for d in ("src", "scripts", "tests") for p in (ROOT / d).rglob("*.py"))


def _warns(path: Path) -> str | None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            compile(path.read_text(encoding="utf-8"), str(path), "exec")
        except (SyntaxError, Warning) as e:
            return f"{path}: {e}"
    return None


def test_every_source_compiles_without_warnings():
    assert len(SOURCES) > 50
    bad = [w for w in map(_warns, SOURCES) if w]
    assert not bad, "\n".join(bad)


def test_an_invalid_escape_is_caught(tmp_path):
    f = tmp_path / "bad.py"
    f.write_text('"""a :meth:`sync`\\ s"""\n')
    assert "invalid escape sequence" in _warns(f)
