"""Plots of sweeps against offered load, one line per system (matplotlib, Agg backend).

`plot_sweeps(results, path)` takes results (dicts as `run_benchmark` returns them, or paths of the
JSON files `rapidserve bench` wrote; one per system and workload) and draws one row per workload
with three panels: output token throughput, p99 inter-token latency and p99 TTFT, each against the
offered request rate, one line per system label. A rate of inf is drawn right of the largest finite
rate and labelled "inf".
Optional horizontal lines (`itl_bounds_ms`) mark ITL bounds (e.g. 50 and 100 ms).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.benchmark.results import load_result, workload_title

PANELS: tuple[tuple[str, str], ...] = (("output tokens/s", "output_throughput"), ("p99 ITL (ms)", "itl_ms"),
                                       ("p99 TTFT (ms)", "ttft_ms"))


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
