"""The tables of a ``python -m pardec.bench table`` result (``table.json``; published as
``docs/results/table_<date>.json``): one per benchmark (every method's cell) and ``speed``, the leaderboard (a row
per method, a column per benchmark: speed against ``ar`` with its 95% interval, and the task metric where the method
changes the outputs). ``pardec.report docs`` renders them from a marker ``<!-- table: results/table_<date>.json#speed
-->`` (:data:`pardec.report.docs.RENDERERS`)."""

from __future__ import annotations

COLUMNS = ["method", "× ar (95% CI)", "median", "tok/fwd", "EM", "metric", "ended", "loops", "busy"]


def _num(x, fmt: str = ".2f") -> str:
    return "–" if x is None else format(x, fmt)


def speed(c: dict) -> str:
    ci = c.get("speedup_ci95")
    return f"{_num(c['speedup_mean'])} ({_num(ci[0])}–{_num(ci[1])})" if ci else _num(c["speedup_mean"])


def benchmark_tables(table: dict) -> dict[str, dict]:
    """``{<benchmark>: {columns, rows}, "speed": {columns, rows}}`` of a table result."""
    out = {}
    benches = table.get("benchmarks") or {}
    for bench, b in benches.items():
        cols = [*COLUMNS[:5], b.get("metric") or "metric", *COLUMNS[6:]]
        rows = [[label, speed(c), _num(c["speedup_median"]), _num(c["tokens_per_forward"]),
                 _num(c["exact_match_rate"]) + (" ⚠" if c.get("flagged") else ""), _num(c["metric"], ".3f"),
                 _num(c["ended_share"]), _num(c["loop_share"]), str(c["busy"])] for label, c in b["methods"].items()]
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
            if c.get("exactness") not in ("tokens", "distribution") and c.get("metric") is not None:
                cell += f"; {b.get('metric')} {_num(c['metric'], '.3f')}"
            if c.get("busy"):
                cell += f" (busy {c['busy']})"
            row.append(cell)
        rows.append(row)
    out["speed"] = {"columns": ["method", *benches], "rows": rows}
    return out


def markdown(table: dict) -> str:
    from pardec.report.markdown import markdown_table

    host = table.get("host") or {}
    lines = [f"Host: {host.get('cpu')} ({table['dtype']}, {table['n']} prompts, {table['max_new_tokens']} new tokens "
             f"per turn), commit {table['commit']}, {table['date']}.", ""]
    for name, t in benchmark_tables(table).items():
        lines += [f"### {name}", "", markdown_table(t["columns"], t["rows"]), ""]
    return "\n".join(lines)
