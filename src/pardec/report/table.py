"""The tables of a ``python -m pardec.bench table`` result (``table.json``; published as
``docs/results/table_<date>.json``): one per benchmark (every method's cell, with its paired speed against the
run's fastest transformers peer where the run has peers) and ``speed``, the leaderboard (a row
per method, a column per benchmark: speed against ``ar`` with its 95% interval, and the task metric where the outputs
are not the base model's ``ar``'s: a lossy method, or a fine-tuned model (``@``); on a judged benchmark without its
judge, the answers' perplexity under the base model). ``pardec.report docs`` renders them from a marker
``<!-- table: results/table_<date>.json#speed -->`` (:data:`pardec.report.docs.RENDERERS`); :func:`plot_benchmarks`
draws a figure per benchmark."""

from __future__ import annotations

from pathlib import Path

from pardec.report.markdown import markdown_table

COLUMNS = ["method", "× ar (95% CI)", "median", "tok/fwd", "EM", "metric", "ended", "loops", "busy"]


def _num(x, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def _with_ci(mean, ci, fmt: str = ".2f") -> str:
    """``mean (low–high)``, or the mean alone without an interval."""
    return f"{_num(mean, fmt)} ({_num(ci[0], fmt)}–{_num(ci[1], fmt)})" if ci else _num(mean, fmt)


def speed(c: dict) -> str:
    return _with_ci(c["speedup_mean"], c.get("speedup_ci95"))


def against_peer(v: dict | None) -> str:
    """A method's paired speed against the run's fastest transformers peer (``vs_peer``): mean (interval)."""
    return _with_ci(v["mean"], v.get("ci95")) if v else "–"


def against_ar(q: dict | None) -> str:
    """A lossy or fine-tuned method's task metric minus the base ``ar``'s, prompt by prompt: mean (interval), ⚠ when
    the interval lies wholly beyond the method's stated tolerance (``quality``)."""
    return _with_ci(q["mean_diff"], q.get("ci95"), "+.3f") + (" ⚠" if q.get("flagged") else "") if q else "–"


def benchmark_tables(table: dict) -> dict[str, dict]:
    """``{<benchmark>: {columns, rows}, "speed": {columns, rows}}`` of a table result."""
    out = {}
    benches = table.get("benchmarks") or {}
    for bench, b in benches.items():
        ppl = any(c.get("perplexity") is not None for c in b["methods"].values())  # a judged task's proxy
        peer = next((c["vs_peer"]["peer"] for c in b["methods"].values() if c.get("vs_peer")), None)
        judged = any(c.get("quality") for c in b["methods"].values())
        metric = b.get("metric") or "metric"
        cols = [*COLUMNS[:3], *([f"× {peer} (95% CI)"] if peer else []), *COLUMNS[3:5], metric,
                *([f"Δ {metric} vs ar (95% CI)"] if judged else []), *(["ppl (base)"] if ppl else []), *COLUMNS[6:]]
        rows = [[label, speed(c), _num(c["speedup_median"]), *([against_peer(c.get("vs_peer"))] if peer else []),
                 _num(c["tokens_per_forward"]),
                 _num(c["exact_match_rate"]) + (" ⚠" if c.get("flagged") else ""), _num(c["metric"], ".3f"),
                 *([against_ar(c.get("quality"))] if judged else []),
                 *([_num(c.get("perplexity"))] if ppl else []), _num(c["ended_share"]), _num(c["loop_share"]),
                 str(c["busy"])] for label, c in b["methods"].items()]
        out[bench] = {"columns": cols, "rows": rows}
    methods = list(dict.fromkeys(m for b in benches.values() for m in b["methods"]))
    rows = []
    for m in methods:
        row = [m]
        for b in benches.values():
            c = b["methods"].get(m)
            if c is None:
                row.append("—")
                continue
            cell = speed(c) + (" ⚠ EM " + _num(c["exact_match_rate"]) if c.get("flagged") else "")
            # quality where the outputs are not ar's: a lossy method, or any method on a fine-tuned model (@)
            changes = c.get("exactness") not in ("tokens", "distribution") or "@" in m
            if changes and c.get("metric") is not None:
                cell += f"; {b.get('metric')} {_num(c['metric'], '.3f')}" + (" ⚠" if (c.get("quality") or {}).get(
                    "flagged") else "")
            elif changes and c.get("perplexity") is not None:
                cell += f"; ppl {_num(c['perplexity'])}"
            if c.get("busy"):
                cell += f" (busy {c['busy']})"
            row.append(cell)
        rows.append(row)
    out["speed"] = {"columns": ["method", *benches], "rows": rows}
    return out


def markdown(table: dict) -> str:
    host = table.get("host") or {}
    pending = f" Not finished yet: {', '.join(table['pending'])}." if table.get("pending") else ""
    lines = [f"Host: {host.get('cpu')} ({table['dtype']}, {table['n']} prompts, {table['max_new_tokens']} new tokens "
             f"per turn), commit {table['commit']}, {table['date']}.{pending}", ""]
    for name, t in benchmark_tables(table).items():
        lines += [f"### {name}", "", markdown_table(t["columns"], t["rows"]), ""]
    return "\n".join(lines)


#: marker per exactness (what a method guarantees); a lossless cell below EM 1.00 gets a red edge
MARKERS = {"tokens": "o", "distribution": "s", "approximate": "^"}


def plot_benchmarks(table: dict, out: Path) -> dict[str, list[str]]:
    """One figure per benchmark, ``<out>/<benchmark>.png``: speed against ``ar`` (mean, 95% interval as a bar) over
    tokens per target forward, a point per method, numbered, with the numbers' methods in a legend beside the axes
    (no label can cover another); the marker's shape is the method's exactness and its colour the task metric
    (a colour bar); a lossless method below EM 1.00 has a red edge. The caption names host, dtype, prompts, date and
    commit. Returns each benchmark's legend entries in order."""
    from matplotlib.lines import Line2D  # heavy: matplotlib

    from pardec.report.plots import plt, save_figure  # (plots chooses the Agg backend; heavy: matplotlib)

    out.mkdir(parents=True, exist_ok=True)
    host = (table.get("host") or {}).get("cpu")
    caption = (f"{host}, {table['dtype']}, {table['n']} prompts, {table['max_new_tokens']} new tokens per turn, "
               f"{table['date']}, commit {str(table['commit'])[:9]}")
    legends = {}
    for bench, b in (table.get("benchmarks") or {}).items():
        cells = [(label, c) for label, c in b["methods"].items()
                 if c.get("speedup_mean") is not None and c.get("tokens_per_forward") is not None]
        metrics = [c["metric"] for _, c in cells if c.get("metric") is not None]
        norm = plt.Normalize(min(metrics), max(metrics)) if metrics and min(metrics) < max(metrics) else None
        cmap = plt.get_cmap("viridis")
        fig, ax = plt.subplots(figsize=(9, 5.5))
        entries = []
        for i, (label, c) in enumerate(cells, 1):
            x, y, ci = c["tokens_per_forward"], c["speedup_mean"], c.get("speedup_ci95")
            if ci:
                ax.errorbar(x, y, yerr=[[y - ci[0]], [ci[1] - y]], color="0.6", linewidth=1, capsize=2, zorder=1)
            color = cmap(norm(c["metric"])) if norm is not None and c.get("metric") is not None else "0.4"
            ax.scatter(x, y, s=60, marker=MARKERS.get(c.get("exactness"), "D"), color=color, zorder=2,
                       edgecolors="red" if c.get("flagged") else "black", linewidths=1.5 if c.get("flagged") else 0.5)
            ax.annotate(str(i), (x, y), xytext=(5, 3), textcoords="offset points", fontsize="small")
            entries.append(f"{i} {label}")
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel("tokens per target forward")
        ax.set_ylabel("speed against ar (×, mean and 95% interval)")
        ax.set_title(f"{bench}: every decoder in one run")
        if norm is not None:
            fig.colorbar(plt.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label=b.get("metric") or "metric",
                         location="left", pad=0.12)
        shapes = [Line2D([], [], marker=m, linestyle="", color="0.4", label=k) for k, m in MARKERS.items()]
        numbers = [Line2D([], [], linestyle="", label=e) for e in entries]
        ax.legend(handles=shapes + numbers, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  handlelength=1, ncol=1 if len(entries) <= 24 else 2)
        fig.text(0.01, 0.005, caption, fontsize="x-small", color="0.3")
        save_figure(fig, out / f"{bench}.png")
        legends[bench] = entries
    return legends
