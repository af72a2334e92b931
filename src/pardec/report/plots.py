"""The report's figures: one way to save a figure (:func:`save_figure`, shared by every report), and the plots of
``python -m pardec.report runs`` (speedup by method, accepted-length histograms, speedup against tokens per
forward). Their ``rows`` are :class:`pardec.report.runs.Row` (the report's table rows; runs imports this module)."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)


def _color(i: int, n: int) -> Any:
    """Distinct colours for up to 20 series (tab10, or tab20 beyond 10)."""
    return plt.get_cmap("tab10" if n <= 10 else "tab20")(i % (10 if n <= 10 else 20))


def save_figure(fig: Any, path: Path, axes: Sequence[Any] = (), legend: dict | None = None) -> None:
    """The one way a report saves a figure: a light grid and (``legend``: its keyword arguments) a legend on each of
    ``axes`` that has labelled series, a tight layout, PNG at 120 dpi, the figure closed."""
    for ax in axes:
        ax.grid(alpha=0.3)
        if legend is not None and ax.get_legend_handles_labels()[0]:
            ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _finish(fig: Any, ax: Any, path: Path, has_data: bool) -> None:
    """Legend outside the axes (or a "no data" note), then save and close."""
    if not has_data:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    else:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _grouped_bars(ax: Any, series: dict[str, dict[Any, tuple[float, float | None]]], xs: list[Any]) -> None:
    """One bar per series at each x (an x a series lacks leaves a gap), with error bars where given."""
    width = 0.8 / max(1, len(series))
    for i, (label, values) in enumerate(series.items()):
        at = [j for j, x in enumerate(xs) if x in values]
        errs = [values[xs[j]][1] or 0.0 for j in at]
        offsets = [j - 0.4 + width * (i + 0.5) for j in at]
        heights = [values[xs[j]][0] for j in at]
        color = _color(i, len(series))
        ax.bar(offsets, heights, width, yerr=errs if any(errs) else None, capsize=2, label=label, color=color)
    ax.set_xticks(range(len(xs)), [str(x) for x in xs])


def plot_speedup(rows: Sequence[Any], path: Path) -> None:
    """Grouped bars: speedup per method per dataset (baseline as a line at 1×), std as error bars."""
    series = {
        r.label: {ds: (c.speedup, c.speedup_std) for ds, c in r.cells.items() if c.speedup is not None}
        for r in rows
        if not r.is_baseline
    }
    datasets = sorted({ds for values in series.values() for ds in values})
    fig, ax = plt.subplots(figsize=(min(16.0, 4.0 + 0.25 * len(datasets) * len(series)), 4.5))
    _grouped_bars(ax, series, datasets)
    if datasets:
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_ylabel("speedup over baseline (×)")
    ax.set_title("Speedup per dataset")
    _finish(fig, ax, path, has_data=bool(datasets))


def plot_accepted_hist(runs: Sequence[dict[str, Any]], rows: Sequence[Any], path: Path,
                       group: Callable[[dict[str, Any]], tuple]) -> None:
    """Fraction of target forwards committing k tokens, one series per method row (summed over datasets; ``group``:
    a run's row key)."""
    labels = {r.key: r.label for r in rows if not r.is_baseline}
    hists: dict[str, Counter[int]] = defaultdict(Counter)
    for run in runs:
        key = group(run)
        if key in labels and run["accepted_histogram"] and run["method"] != run.get("baseline"):
            hists[labels[key]].update(run["accepted_histogram"])
    series = {
        label: {k: (n / total, None) for k, n in hist.items()}
        for label, hist in hists.items()
        if (total := sum(hist.values())) > 0
    }
    ks = sorted({k for values in series.values() for k in values})
    fig, ax = plt.subplots(figsize=(min(16.0, 4.0 + 0.2 * len(ks) * len(series)), 4.5))
    _grouped_bars(ax, series, ks)
    ax.set_xlabel("tokens committed per target forward")
    ax.set_ylabel("fraction of forwards")
    ax.set_title("Accepted tokens per target forward")
    _finish(fig, ax, path, has_data=bool(series))


def plot_speedup_vs_tpf(runs: Sequence[dict[str, Any]], path: Path) -> None:
    """Scatter of speedup against tokens per target forward, one labelled point per run."""
    points = [
        (r["tokens_per_forward"], r["speedup"], str(r["method"]), str(r["dataset"]))
        for r in runs
        if r.get("tokens_per_forward") is not None and r.get("speedup") is not None
    ]
    methods = list(dict.fromkeys(m for _, _, m, _ in points))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, method in enumerate(methods):
        xs, ys, datasets = zip(*[(x, y, ds) for x, y, m, ds in points if m == method])
        ax.scatter(xs, ys, color=_color(i, len(methods)), label=method)
        for x, y, ds in zip(xs, ys, datasets):
            ax.annotate(
                f"{method}/{ds}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize="x-small"
            )
    if points:
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("tokens per target forward")
    ax.set_ylabel("speedup over baseline (×)")
    ax.set_title("Speedup vs tokens per forward")
    _finish(fig, ax, path, has_data=bool(points))
