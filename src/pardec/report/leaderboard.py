"""The best-of leaderboard (``<!-- leaderboard -->`` in a page, :mod:`pardec.report.docs`): one row per method, a
column per host class, each cell the fastest exact entry among every result file's ``"leaderboard"`` list; since
the table of one measured run (:mod:`pardec.report.table`) is the README's leaderboard, it renders
docs/leaderboard_history.md."""

from __future__ import annotations

import json
from pathlib import Path

from pardec.report.markdown import DocsError, _rel, markdown_table

HOST_CLASSES = {"cpu-fp32": "CPU, fp32", "cpu-fast": "CPU, fastest mode (bf16 prepacked / int8)", "gpu": "GPU"}
# the leaderboard's row order: the reference and transformers' peers first, then pardec's methods as the README lists
METHOD_ORDER = ("hf_generate", "hf_pld", "hf_assisted", "jacobi", "cllm", "lookahead", "pld", "sps", "ouroboros",
                "spectr", "mjsd", "mjgd", "bild", "medusa", "medusa_typical", "firp", "sdsat", "eagle", "eagle3", "dflash")
LEADERBOARD_KEYS = ("method", "host_class", "mode", "dataset", "speedup", "exact_match_rate", "tokens_per_forward",
                    "host")


def leaderboard_entries(docs: Path) -> list[dict]:
    """Every result file's leaderboard entries, each with its file and date."""
    out = []
    for path in sorted(docs.glob("**/*.json")):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DocsError(f"{path}: not JSON ({e})") from e
        if not isinstance(data, dict):
            continue
        for i, e in enumerate(data.get("leaderboard") or []):
            missing = [k for k in LEADERBOARD_KEYS if k not in e]
            if missing:
                raise DocsError(f"{path}: leaderboard entry {i} lacks {', '.join(missing)}")
            if e["host_class"] not in HOST_CLASSES:
                raise DocsError(f"{path}: leaderboard entry {i}: host_class {e['host_class']!r}; "
                                f"valid choices: {', '.join(HOST_CLASSES)}")
            out.append({**e, "file": path, "date": e.get("date") or data.get("date") or "",
                        "transcribed": bool(data.get("transcribed"))})
    return out


def _exact(e: dict) -> bool:
    """Whether an entry's outputs equalled ``ar``'s (or the run did not count them: lossy methods)."""
    return e["exact_match_rate"] is None or e["exact_match_rate"] >= 0.999


def best_entries(entries: list[dict], exact_only: bool = True) -> dict[tuple[str, str], dict]:
    """Per (method, host class): the highest speedup (ties: the newest date); with ``exact_only``, among the entries
    whose outputs equalled ``ar``'s (or were not counted), falling back to all when none did."""
    best: dict[tuple[str, str], dict] = {}
    for e in entries:
        key = (e["method"], e["host_class"])
        rank = ((_exact(e) or not exact_only), e["speedup"], e["date"])
        if key not in best or rank > ((_exact(best[key]) or not exact_only), best[key]["speedup"], best[key]["date"]):
            best[key] = e
    return best


def _num(x, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def leaderboard_cell(e: dict, md_file: Path, faster: dict | None = None) -> str:
    """An entry as a cell; ``faster``: a faster entry whose outputs left ``ar``'s, named after it."""
    mode = "" if e["host_class"] == "cpu-fp32" else f"{e['mode']}, "
    mark = ", transcribed" if e.get("transcribed") else ""  # its raw runs are gone: a copy, not a measurement
    cell = (f"{e['speedup']:.2f}× ({mode}{e['dataset']}; EM {_num(e['exact_match_rate'], '.2f')}, "
            f"{_num(e['tokens_per_forward'], '.2f')} tok/fwd{mark}) [↗]({_rel(e['file'], md_file)})")
    if faster is not None and faster is not e and faster["speedup"] > e["speedup"]:
        cell += (f"; not exact: {faster['speedup']:.2f}× ({faster['mode']}, EM "
                 f"{_num(faster['exact_match_rate'], '.2f')}) [↗]({_rel(faster['file'], md_file)})")
    return cell


def render_leaderboard(md_file: Path, docs: Path) -> str:
    entries = leaderboard_entries(docs)
    best, fastest = best_entries(entries), best_entries(entries, exact_only=False)
    methods = sorted({m for m, _ in best}, key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m))
    rows = [[f"`{m}`", *(leaderboard_cell(best[(m, h)], md_file, fastest[(m, h)]) if (m, h) in best else "—"
                         for h in HOST_CLASSES)] for m in methods]
    return markdown_table(["method", *HOST_CLASSES.values()], rows) + "\n"


def plot_leaderboard(root: Path, out: Path) -> Path:
    """The CPU fp32 column of the leaderboard as a plot: each method's speed against ``ar`` over its tokens per target
    forward (methods without a tokens-per-forward figure are left out), written to ``out``."""
    import matplotlib  # heavy: matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # heavy: matplotlib

    from pardec.report.plots import save_figure  # heavy: matplotlib

    best = best_entries(leaderboard_entries(root / "docs"))
    points = sorted((e["tokens_per_forward"], e["speedup"], m) for (m, h), e in best.items()
                    if h == "cpu-fp32" and e["tokens_per_forward"] is not None)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    for x, y, m in points:
        ax.scatter([x], [y], s=18)
        ax.annotate(m, (x, y), textcoords="offset points", xytext=(4, 3), fontsize=8)
    ax.set_xlabel("tokens per target forward")
    ax.set_ylabel("speed against ar (same run)")
    ax.set_title("Leaderboard, CPU fp32 (2 cores, SmolLM2-135M): each method's fastest exact run, from its own run",
                 fontsize=9)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, out, [ax])
    return out
