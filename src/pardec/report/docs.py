"""The tables of README.md and docs/, generated from the result files under docs/ (small JSON).

    python -m pardec.report docs            # rewrite every marked block in README.md and docs/**/*.md
    python -m pardec.report docs --check    # write nothing; exit 1 naming each block that differs, each figure
                                            # in prose that no file its page cites holds, and each figure pinned
                                            # to a field that does not hold it (pardec.report.pins; the README's
                                            # figures must all be pinned)

Writing also plots the leaderboard's CPU fp32 column (speed against tokens per forward) into
``docs/img/leaderboard_cpu_fp32.png`` and the drafters' acceptance by draft position (in decoding and held out) into
``docs/img/acceptance_by_position.png`` (``--no-plot``: tables only).

A markdown file marks a generated block with a pair of comments; what lies between them is replaced:

* ``<!-- table: results/<file>.json#<name> -->`` ... ``<!-- /table -->``: the table ``<name>`` of that result file
  (the path is relative to ``docs/``). A file's tables are its ``"tables"`` key (``{"<name>": {"columns": [...],
  "rows": [[cell, ...], ...]}}``, cells as strings), or a table a render function makes from its structured fields
  (:data:`RENDERERS`, keyed by the file's name).
* ``<!-- config: conf/<group>/<name>.yaml -->`` ... ``<!-- /config -->``: that config file, whole, as a yaml block (a
  page quotes a method's defaults and their citations without a copy that could drift from the file);
* ``<!-- results-index -->`` ... ``<!-- /results-index -->``: every result file, grouped by topic, with its title,
  date and whether it was transcribed (docs/README.md);
* ``<!-- batch-crossover -->`` ... ``<!-- /batch-crossover -->``: every published batch run and each method's
  crossover batch size (:mod:`pardec.report.batch`, docs/batch.md);
* ``<!-- leaderboard -->`` ... ``<!-- /leaderboard -->``: one row per method, a column per host class (CPU fp32, CPU
  fastest mode, GPU), each cell the entry with the highest speedup against ``ar`` among every result file's
  ``"leaderboard"`` list whose outputs equalled ``ar``'s (exact-match rate 1, or not counted: lossy methods; all
  entries when none did; ties: the newest date), linked to its file, followed by a faster entry that was not exact
  where there is one; "—" where none was measured. A cell from a transcribed file says so.

A leaderboard entry: ``{"method", "host_class": "cpu-fp32" | "cpu-fast" | "gpu", "mode", "dataset", "speedup",
"exact_match_rate", "tokens_per_forward", "host"}`` (``exact_match_rate`` and ``tokens_per_forward`` may be null).

Transcribed result files (figures whose raw runs are gone) carry ``"transcribed": true`` and name their source.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pardec.report.batch import CROSSOVER, render_crossover
from pardec.report.leaderboard import plot_leaderboard, render_leaderboard
from pardec.report.markdown import DocsError, _rel, markdown_table, method_label
from pardec.report.pins import holds, pin_problems
from pardec.report.table import benchmark_tables
from pardec.zoo import ZooError, entries
from pardec.zoo.__main__ import headline, stored_form

REPO = Path(__file__).resolve().parents[3]

TABLE = re.compile(r"(<!-- table: (?P<ref>[^ ]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)
CONFIG = re.compile(r"(<!-- config: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- /config -->)", re.S)
LEADER = re.compile(r"(<!-- leaderboard -->\n)(?P<body>.*?)(<!-- /leaderboard -->)", re.S)
ZOO = re.compile(r"(<!-- zoo: (?P<zoo>[^ ]+) -->\n)(?P<body>.*?)(<!-- /zoo -->)", re.S)
INDEX = re.compile(r"(<!-- results-index -->\n)(?P<body>.*?)(<!-- /results-index -->)", re.S)


@dataclass
class Block:
    file: Path      # the markdown file
    label: str      # "README.md: table results/x.json#t1" (what --check names)
    old: str
    new: str


# --- render functions for the measured files' own shapes ------------------------------------------------------------

def _table_result(data: dict) -> dict[str, dict]:
    return benchmark_tables(data)


#: a result file whose name starts with the key gets the tables its function makes of its fields
RENDERERS: dict[str, Callable[[dict], dict[str, dict]]] = {"table_": _table_result}  # python -m pardec.bench table


def tables_of(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    tables = dict(data.get("tables") or {})
    for prefix, fn in RENDERERS.items():
        if path.name.startswith(prefix):
            tables.update(fn(data))
    return tables


def render_table(ref: str, md_file: Path, docs: Path) -> str:
    if "#" not in ref:
        raise DocsError(f"{md_file}: table marker {ref!r} must be <file>.json#<table name>")
    rel, name = ref.split("#", 1)
    path = docs / rel
    if not path.is_file():
        valid = sorted(p.relative_to(docs).as_posix() for p in docs.glob("**/*.json"))
        raise DocsError(f"{md_file}: result file {rel!r} (in marker {ref!r}) does not exist under {docs}; "
                        f"valid choices: {', '.join(valid) or '(none)'}")
    tables = tables_of(path)
    if name not in tables:
        raise DocsError(f"{md_file}: table {name!r} (in marker {ref!r}) is not in {rel}; "
                        f"valid choices: {', '.join(sorted(tables)) or '(none)'}")
    t = tables[name]
    return markdown_table(t["columns"], t["rows"]) + f"\n\n<sub>Data: [{rel}]({_rel(path, md_file)})</sub>\n"


def render_config(rel: str, md_file: Path, root: Path) -> str:
    path = root / rel
    if not path.is_file():
        folder = path.parent
        valid = sorted(p.relative_to(root).as_posix() for p in folder.glob("*.yaml")) if folder.is_dir() else []
        raise DocsError(f"{md_file}: config file {rel!r} does not exist under {root}; "
                        f"valid choices: {', '.join(valid) or '(none in ' + folder.as_posix() + ')'}")
    return f"```yaml\n# {rel}\n{path.read_text().rstrip()}\n```\n"


def render_zoo(zoo: str, md_file: Path, root: Path) -> str:
    """The kept drafters of ``zoo/<zoo>/``, one row each from its manifest: how a run reads it, what is stored and its
    size, what training cost on which host, and the held-out figure its recipe reports, overall, per held-out set and
    for the stored form where that is not the trained one."""
    try:  # how a run reads each artifact now (its recipe's reads; a manifest keeps the reads of its build)
        reads = {name: e.reads for name, e in entries(zoo).items()}
    except ZooError:
        reads = {}
    folder = root / "zoo" / zoo
    rows = []
    for f in sorted(folder.glob("*/manifest.json")) if folder.is_dir() else []:
        m = json.loads(f.read_text())
        m["reads"] = reads.get(m["name"]) or m["reads"]
        metrics = m.get("metrics") or {}
        per = "; ".join(f"{ds}: {headline(v)}" for ds, v in (metrics.get("per_dataset") or {}).items())
        stored = (m.get("metrics_stored") or {}).get("metrics")
        key = m["reads"]["key"] if "." in m["reads"]["key"] else f"method.{m['reads']['key']}"
        role = key.split(".")[0]
        local = f"{role}=local " if role in ("model", "draft") else ""  # a model or draft read from a directory
        stages = "; then ".join(f"{b['name']}: " + ", ".join(f"{k} {v['wall_s'] / 60:.1f}" for k, v in
                                                           b["stages"].items()) for b in m.get("bases", []))
        stages += ("; then " if stages else "") + ", ".join(f"{k} {v['wall_s'] / 60:.1f}" for k, v in m["stages"].items())
        rows.append([f"[{m['name']}]({_rel(f, md_file)})", f"`{m['reads']['method']}`: `{local}{key}=zoo:{m['name']}`",
                     f"{stored_form(m['store'])}; {sum(v['bytes'] for v in m['files'].values()) / 1e6:.1f} MB",
                     f"{stages} ({m['host']['cpu']}, {m['host']['cores']} cores)", headline(metrics), per or "-",
                     headline(stored) if stored else "(as trained)", m["date"][:10]])
    if not rows:
        return f"(nothing kept in zoo/{zoo} yet: `make zoo`)\n"
    return markdown_table(["artifact", "read as", "stored", "training, min per stage (host)", "held out",
                           "per held-out set", "stored form, held out", "date"], rows) + "\n"


def render_index(md_file: Path, docs: Path) -> str:
    """Every result file under ``docs/results/``, grouped by topic (its name's first word; a subfolder's name),
    newest first within one:
    what it holds (its title), its date, and whether it was transcribed (its raw runs gone)."""
    rows = []
    for f in sorted((docs / "results").glob("**/*.json")):
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise DocsError(f"{f}: not JSON ({e})") from None
        meta = data if isinstance(data, dict) else {}
        sub = f.parent.relative_to(docs / "results").as_posix()  # raw records in a folder of their own: its name
        rows.append((f.stem.split("_")[0] if sub == "." else sub, str(meta.get("date") or ""), f, meta))
    rows.sort(key=lambda r: r[2].name)
    rows.sort(key=lambda r: r[1] or "~", reverse=True)  # undated, then newest first; then by topic (stable sorts)
    rows.sort(key=lambda r: r[0])
    return markdown_table(["topic", "file", "what it holds", "date", "transcribed"],
                          [[topic, f"[{f.name}]({_rel(f, md_file)})",
                            str(m.get("title") or m.get("command") or "-").replace("|", "/")[:200],
                            date or "-", "yes" if m.get("transcribed") else "no"] for topic, date, f, m in rows]) + "\n"


def plot_acceptance(root: Path, out: Path) -> Path | None:
    """Acceptance by draft position, written to ``out``: left, in decoding (the newest ``side_by_side_*.json``, its
    first dataset: the share of verification rounds that accepted at least k drafts, per method); right, held out
    (every ``eagle3_smollm2*.json`` / ``dflash_smollm2*.json`` with a ``heads_eval``, the name those result files
    record a run's ``drafter_eval.json`` under: the chain acceptance by depth,
    teacher-forced). None when there is no side-by-side file."""
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    from pardec.report.plots import save_figure  # heavy: matplotlib

    results = root / "docs" / "results"
    sides = sorted(((d.get("date", ""), p.name, d) for p in results.glob("side_by_side_*.json")
                    for d in [json.loads(p.read_text())]), key=lambda t: t[:2])
    if not sides:
        return None
    side = sides[-1][2]
    dataset, figures = next(iter(side["datasets"].items()))
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for spec, m in figures["methods"].items():
        acc = m.get("acceptance_by_position")
        if acc:
            left.plot(range(1, len(acc) + 1), acc, marker="o", ms=3, label=method_label(spec))
    left.set_xlabel("draft position k")
    left.set_ylabel("share of rounds accepting >= k drafts")
    left.set_title(f"decoding, {dataset} ({side['date']}, {side['dtype']}, n = {figures['n_samples']})", fontsize=9)
    for path in sorted([*results.glob("eagle3_smollm2*.json"), *results.glob("dflash_smollm2*.json")]):
        data = json.loads(path.read_text())
        chain = ((data.get("heads_eval") or {}).get("overall") or {}).get("chain_acceptance")
        if chain:
            right.plot(range(1, len(chain) + 1), chain, marker="o", ms=3,
                       label=f"{data['heads_eval']['kind']}, {data.get('steps', '?')} steps ({path.stem})")
    right.set_xlabel("draft depth / block position")
    right.set_ylabel("held-out chain acceptance")
    right.set_title("held out, teacher-forced (GSM8K test + HumanEval completions)", fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out, [left, right], legend={"fontsize": 7})
    return out


# --- files -------------------------------------------------------------------------------------------------------------

def markdown_files(root: Path) -> list[Path]:
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    return files + sorted((root / "docs").glob("**/*.md"))


def blocks(md_file: Path, root: Path) -> list[Block]:
    docs = root / "docs"
    text = md_file.read_text()
    name = md_file.relative_to(root).as_posix()
    out = [Block(md_file, f"{name}: table {m['ref']}", m["body"], render_table(m["ref"], md_file, docs))
           for m in TABLE.finditer(text)]
    out += [Block(md_file, f"{name}: config {m['path']}", m["body"], render_config(m["path"], md_file, root))
            for m in CONFIG.finditer(text)]
    out += [Block(md_file, f"{name}: leaderboard", m["body"], render_leaderboard(md_file, docs))
            for m in LEADER.finditer(text)]
    out += [Block(md_file, f"{name}: zoo {m['zoo']}", m["body"], render_zoo(m["zoo"], md_file, root))
            for m in ZOO.finditer(text)]
    out += [Block(md_file, f"{name}: results index", m["body"], render_index(md_file, docs))
            for m in INDEX.finditer(text)]
    out += [Block(md_file, f"{name}: batch crossover", m["body"], render_crossover(md_file, docs))
            for m in CROSSOVER.finditer(text)]
    return out


def rewrite(md_file: Path, root: Path) -> bool:
    """Rewrite md_file's marked blocks; True when it changed."""
    docs = root / "docs"
    text = md_file.read_text()
    new = TABLE.sub(lambda m: m[1] + render_table(m["ref"], md_file, docs) + m[4], text)
    new = CONFIG.sub(lambda m: m[1] + render_config(m["path"], md_file, root) + m[4], new)
    new = LEADER.sub(lambda m: m[1] + render_leaderboard(md_file, docs) + m[3], new)
    new = ZOO.sub(lambda m: m[1] + render_zoo(m["zoo"], md_file, root) + m[4], new)
    new = INDEX.sub(lambda m: m[1] + render_index(md_file, docs) + m[3], new)
    new = CROSSOVER.sub(lambda m: m[1] + render_crossover(md_file, docs) + m[3], new)
    if new != text:
        md_file.write_text(new)
    return new != text


def check(root: Path = REPO) -> list[str]:
    """The labels of every marked block under root whose text differs from what its result file renders."""
    return [b.label for f in markdown_files(root) for b in blocks(f, root) if b.old != b.new]


# --- figures quoted in prose ------------------------------------------------------------------------------------------
# A page's prose may quote a figure only when a result file the page cites holds it: a link to docs/results/** (a
# table marker counts) or a quoted config. "A figure": a decimal (0.651, 1.17), a number with thousands separators
# (1,381) or an integer with x / % (3x, 40 %), outside code, links' targets and generated blocks; versions (2.13.0),
# arXiv ids and a paper's section, table, figure or equation numbers (§3.4, Table 3.2) are not figures. It matches
# a number of a cited file at the figure's own precision (a share also as a percentage).

_SKIP = re.compile(r"```.*?```|<!--.*?-->|`[^`\n]*`|\]\([^)]*\)|<sub>Data:.*?</sub>|(?:arXiv|arxiv\.org/abs/)\s*\d+\.\d+"
                   r"|(?:§|\b(?:[Ss]ection|[Ss]ec\.|Table|Tab\.|Eq\.|Fig\.|Figure|App\.|Appendix|Theorem|Definition|"
                   r"Algorithm)\s?)[A-Z]?\d+(?:\.\d+)*", re.S)
_FIGURE = re.compile(r"(?<![\w.\-/#=])(\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+\.\d+|\d+(?=\s?[×%]))(?![\w.]*\d)")
_CITED = re.compile(r"(?:\]\(|<!-- (?:table|config): )([^)\s#]*?(?:results/[^)\s#]+|conf/[^)\s#]+\.yaml|"
                    r"zoo/[^)\s#]+/manifest\.json))")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _prose(text: str) -> str:
    for pattern in (TABLE, CONFIG, LEADER, ZOO, INDEX):
        text = pattern.sub("", text)
    return _SKIP.sub(" ", text)


def prose_figures(text: str) -> list[str]:
    """The figures a page's prose quotes (see above), as written."""
    return [m[1] for m in _FIGURE.finditer(_prose(text))]


def _numbers(x, out: set[float]) -> set[float]:
    if isinstance(x, dict):
        for v in x.values():
            _numbers(v, out)
    elif isinstance(x, list):
        for v in x:
            _numbers(v, out)
    elif isinstance(x, (int, float)) and not isinstance(x, bool):
        out.add(float(x))
    elif isinstance(x, str):
        out.update(float(n) for n in _NUMBER.findall(x.replace(",", "")))
    return out


def cited_files(md_file: Path, root: Path) -> list[Path]:
    """The result files (under docs/results/), zoo manifests and config files (under conf/) a page cites."""
    docs, out = root / "docs", []
    for m in _CITED.finditer(md_file.read_text()):
        ref = m[1]
        for base in (md_file.parent, docs, root):
            p = (base / ref).resolve()
            if p.is_file():
                out.append(p)
                break
    return sorted(set(out))


def _file_numbers(path: Path) -> set[float]:
    text = path.read_text()
    if path.suffix == ".json":
        return _numbers(json.loads(text), set())
    return _numbers(text, set())


def unsourced(md_file: Path, root: Path) -> list[str]:
    """The figures of md_file's prose that no file it cites holds (at the figure's precision)."""
    numbers: set[float] = set()
    for p in cited_files(md_file, root):
        numbers |= _file_numbers(p)

    return [fig for fig in prose_figures(md_file.read_text()) if not holds(fig, numbers)]


def prose_pages(root: Path) -> list[Path]:
    """The pages whose prose is checked: README.md and docs/ less docs/results/ (raw records are data)."""
    results = root / "docs" / "results"
    return [f for f in markdown_files(root) if results not in f.parents]


def check_figures(root: Path = REPO) -> list[str]:
    """'<page>: <figure>' for every prose figure that no file its page cites holds."""
    return [f"{f.relative_to(root).as_posix()}: {fig}" for f in prose_pages(root) for fig in unsourced(f, root)]


def check_pins(root: Path = REPO) -> list[str]:
    """Every pinned figure that does not resolve to its field or that the field does not hold, and every unpinned
    figure of a strict page (:mod:`pardec.report.pins`)."""
    return [p for f in prose_pages(root) for p in pin_problems(f, root, prose_figures, lambda v: _numbers(v, set()))]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each block that differs and each figure in prose without a source")
    ap.add_argument("--no-plot", action="store_true", help="rewrite the tables only, not the plots in docs/img/")
    ap.add_argument("--root", type=Path, default=REPO, help="the repository root (README.md, docs/); default: %(default)s")
    a = ap.parse_args(argv)
    if not (a.root / "docs").is_dir():
        ap.error(f"--root {a.root}: no docs/ directory there")
    try:
        if a.check:
            stale, loose, pins = check(a.root), check_figures(a.root), check_pins(a.root)
            for label in stale:
                print(f"differs from its result file: {label}", file=sys.stderr)
            for label in loose:
                print(f"a figure no cited result file holds: {label}", file=sys.stderr)
            for problem in pins:
                print(f"a figure not held by its field: {problem}", file=sys.stderr)
            if stale:
                print(f"{len(stale)} block(s) out of date: run 'python -m pardec.report docs'", file=sys.stderr)
            if loose:
                print(f"{len(loose)} figure(s) in prose without a source: cite the result file that holds each "
                      f"(a link to docs/results/...), or add it to one", file=sys.stderr)
            if pins:
                print(f"{len(pins)} pinned or strict-page figure(s) fail: pin each to the field that holds it",
                      file=sys.stderr)
            if stale or loose or pins:
                return 1
            print("every marked block matches its result file, every figure in prose is in a file its page cites, "
                  "and every pinned figure is its field's")
            return 0
        changed = [f for f in markdown_files(a.root) if rewrite(f, a.root)]
        if not a.no_plot:
            changed.append(plot_leaderboard(a.root, a.root / "docs" / "img" / "leaderboard_cpu_fp32.png"))
            acceptance = plot_acceptance(a.root, a.root / "docs" / "img" / "acceptance_by_position.png")
            if acceptance is not None:
                changed.append(acceptance)
    except DocsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for f in changed:
        print(f"rewrote {f.relative_to(a.root)}")
    return 0
