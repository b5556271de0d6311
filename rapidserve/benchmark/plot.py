"""Plots of sweeps against offered load, and of goodput frontiers, one line per system (matplotlib, Agg backend).

`plot_sweeps(results, path)` takes results (dicts as `run_benchmark` returns them, or paths of the
JSON files `rapidserve bench` wrote; one per system and workload) and draws one row per workload
with three panels: output token throughput, p99 inter-token latency and p99 TTFT, each against the
offered request rate, one line per system label. A rate of inf is drawn right of the largest finite
rate and labelled "inf".
Optional horizontal lines (`itl_bounds_ms`) mark ITL bounds (e.g. 50 and 100 ms).

`plot_frontier(results, path)` takes goodput search results of one workload (goodput_report.py) and draws
goodput (requests/s) against the ITL bound, unbounded at the right: a colour per system label, a line
style per share (solid: the lowest share). An entry whose search did not finish is drawn hollow; one not
searched (outside its search's only_bounds) is not drawn. The labels in `emphasis` (bench/compare.py's composite
row: the default policy) are drawn black and thicker, above the rest. An entry that is the median over repeated
searches (bench/compare.py --search-repeats: its "repeats" has their "min" and "max") gets an error bar from the least
to the greatest repetition's goodput. With
`attainment`, a second panel draws the first result's attainment curves: the share of requests meeting
each bound at each probed rate, the shares as dashed lines.

matplotlib is optional (`pip install rapidserve[bench]`): callers check `have_matplotlib()` and say
PLOT_NEEDS instead of drawing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.benchmark.goodput import UNFINISHED, bound_key
from rapidserve.benchmark.results import (
    bound_label,
    entry,
    frontier_points,
    load_result,
    search_bounds,
    search_shares,
    workload_title,
)

PLOT_NEEDS = "the plot needs matplotlib: pip install rapidserve[bench]"
LINE_STYLES: tuple[str, ...] = ("-", "--", ":", "-.")

PANELS: tuple[tuple[str, str], ...] = (("output tokens/s", "output_throughput"), ("p99 ITL (ms)", "itl_ms"),
                                       ("p99 TTFT (ms)", "ttft_ms"))


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def x_positions(rates: Sequence[float]) -> dict[float, float]:
    """Where each rate goes on the (log2) x axis: itself, and inf at twice the largest finite rate."""
    finite = [r for r in rates if math.isfinite(r)]
    inf_at = 2.0 * max(finite) if finite else 1.0
    return {r: (r if math.isfinite(r) else inf_at) for r in rates}


def _value(summary: Mapping[str, Any], key: str) -> float | None:
    v = summary.get(key)
    if isinstance(v, Mapping):
        v = v.get("p99")
    return float(v) if isinstance(v, (int, float)) else None


def plot_sweeps(sources: Sequence[Mapping[str, Any] | str], path: str, title: str | None = None,
                itl_bounds_ms: Sequence[float] = ()) -> str:
    """Draw `sources` (result dicts, or paths of result JSON files) into the PNG at `path`; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = [load_result(r) if isinstance(r, str) else r for r in sources]
    workloads: list[str] = []
    for r in results:
        w = workload_title(r.get("workload", {}))
        if w not in workloads:
            workloads.append(w)
    labels: list[str] = []
    for r in results:
        if str(r.get("label")) not in labels:
            labels.append(str(r.get("label")))
    colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}

    rows = max(1, len(workloads))
    fig, axes = plt.subplots(rows, len(PANELS), figsize=(5.2 * len(PANELS), 3.6 * rows), squeeze=False)
    for row, w in enumerate(workloads):
        # each workload's own rates on its x axis (workloads swept at different rates would crowd one shared axis)
        all_rates = sorted({float(run["rate"]) for r in results if workload_title(r.get("workload", {})) == w
                            for run in r.get("runs", [])})
        xpos = x_positions(all_rates)
        for col, (ylabel, key) in enumerate(PANELS):
            ax = axes[row][col]
            for r in results:
                if workload_title(r.get("workload", {})) != w:
                    continue
                pts = [(xpos[float(run["rate"])], _value(run["summary"], key)) for run in r.get("runs", [])]
                pts = sorted((x, y) for x, y in pts if y is not None)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[str(r.get("label"))],
                            label=str(r.get("label")))
            if key == "itl_ms":
                for b in itl_bounds_ms:
                    ax.axhline(b, color="grey", linestyle="--", linewidth=0.8)
            if all_rates:
                ax.set_xscale("log", base=2)
                ax.set_xticks([xpos[x] for x in all_rates])
                ax.set_xticklabels(["inf" if math.isinf(x) else f"{x:g}" for x in all_rates])
                ax.minorticks_off()
            ax.set_xlabel("offered load (requests/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(w, fontsize=9)
            ax.grid(True, alpha=0.3)
            if col == 0 and row == 0 and labels:
                ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _bound_x(b: float | None) -> float:
    return math.inf if b is None else float(b)


def plot_frontier(results: Sequence[Mapping[str, Any]], path: str, title: str | None = None,
                  attainment: bool = False, emphasis: Sequence[str] = ()) -> str:
    """Draw the goodput frontier of each search result (one workload) into the PNG at `path`; return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bounds: list[float | None] = []
    for r in results:
        bounds += [b for b in search_bounds(r) if b not in bounds]
    xs = x_positions([_bound_x(b) for b in bounds])
    shares = sorted({q for r in results for q in search_shares(r)})
    cols = 2 if attainment and results else 1
    fig, axes = plt.subplots(1, cols, figsize=(6.0 * cols, 4.2), squeeze=False)
    ax = axes[0][0]
    labels = [x for x in dict.fromkeys(str(r.get("label")) for r in results) if x not in emphasis]
    for r in results:
        bold = str(r.get("label")) in emphasis
        color = "black" if bold else f"C{labels.index(str(r.get('label'))) % 10}"
        for k, q in enumerate(shares):
            pts = [(b, g) for b, g in frontier_points(r, q, bounds) if g is not None]
            if not pts:
                continue
            done = [(entry(r, b, q) or {}).get("status") != UNFINISHED for b, _ in pts]
            xv = [xs[_bound_x(b)] for b, _ in pts]
            ax.plot(xv, [g for _, g in pts], color=color, linestyle=LINE_STYLES[k % len(LINE_STYLES)],
                    label=f"{r.get('label')}, {q:.0%}", linewidth=2.6 if bold else 1.5, zorder=4 if bold else 2)
            ax.scatter(xv, [g for _, g in pts], color=[color if d else "white" for d in done], edgecolors=color,
                       zorder=5 if bold else 3)
            spread = _spread(r, q, pts)
            if spread is not None:
                ax.errorbar(xv, [g for _, g in pts], yerr=spread, fmt="none", ecolor=color, capsize=3,
                            linewidth=1.0, zorder=2)
    ax.set_xscale("log", base=2)
    ax.set_xticks([xs[_bound_x(b)] for b in bounds])
    ax.set_xticklabels([bound_label(b).replace(" ms", "") for b in bounds])
    ax.minorticks_off()
    ax.set_xlabel("per-request p95 ITL bound (ms)")
    ax.set_ylabel("goodput (requests/s)")
    ax.set_ylim(bottom=0)
    repeated = any(_spread(r, q, frontier_points(r, q, bounds)) is not None for r in results for q in shares)
    ax.set_title("goodput at each bound (hollow: the search did not settle it)" + (
        "\nmedians over repeated searches, bars: their min-max" if repeated else ""), fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    if cols == 2:
        _plot_attainment(axes[0][1], results[0], shares)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _spread(result: Mapping[str, Any], share: float,
            pts: Sequence[tuple[float | None, float | None]]) -> list[list[float]] | None:
    """Error bars (below, above) for the points of a frontier whose entries are medians over repeated searches (their
    "repeats": {"min", "max"}, bench/compare_repeats.py); None where none is."""
    below, above, any_spread = [], [], False
    for b, g in pts:
        r = (entry(result, b, share) or {}).get("repeats")
        if g is None or not isinstance(r, Mapping):
            below.append(0.0)
            above.append(0.0)
            continue
        any_spread = True
        below.append(max(0.0, g - float(r["min"])))
        above.append(max(0.0, float(r["max"]) - g))
    return [below, above] if any_spread else None


def _plot_attainment(ax: Any, result: Mapping[str, Any], shares: Sequence[float]) -> None:
    probes = sorted(result.get("probes", []), key=lambda p: float(p["rate"]))
    for i, b in enumerate(search_bounds(result)):
        pts = [(float(p["rate"]), p["attainment"].get(bound_key(b))) for p in probes]
        pts = [(x, y) for x, y in pts if y is not None]
        if pts:
            ax.plot([x for x, _ in pts], [100 * y for _, y in pts], marker="o", color=f"C{i % 10}",
                    label=bound_label(b))
    for q in shares:
        ax.axhline(100 * q, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("Poisson rate (requests/s)")
    ax.set_ylabel("requests meeting TTFT rule and bound (%)")
    ax.set_title(f"attainment: {result.get('label')}", fontsize=9)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
