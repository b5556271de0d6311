"""The frontier report's TTFT table (`bench/compare.py --goodput-search --search-ttft-rate R`): every system's TTFT at
one Poisson rate, side by side, and each one's TTFT p50 over vLLM default's (issue 37: "TTFT p50 at 0.75 of vLLM
default's peak <= vLLM's"; give R = 0.75 x that peak, e.g. from an earlier report's closed-loop peak).

Each search ends with a probe at R (rapidserve/benchmark/search.py; none where the search probed R itself, whose
probe then serves): its summary's TTFT p50 and p99, its p99 inter-token latency and the request throughput it
completed. A repeated search (--search-repeats) gives the median of its repetitions' figures. Pure (tested on CPU).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from compare_repeats import searches

from rapidserve.benchmark.goodput import round_rate

FIGURES = (("ttft_p50_ms", "ttft_ms", "median"), ("ttft_p99_ms", "ttft_ms", "p99"), ("itl_p99_ms", "itl_ms", "p99"))
VLLM_DEFAULT = "vllm"  # bench/compare_systems.py's label of vLLM at its defaults


def ttft_rate(f: Mapping[str, Any]) -> float | None:
    """The --search-ttft-rate a frontier's (first) search ran with, rounded as its probes' rates are; None: none."""
    r = ((searches(f)[0].get("search") or {}).get("settings") or {}).get("ttft_rate")
    return None if r is None else round_rate(float(r))


def at_rate(search: Mapping[str, Any], rate: float) -> Mapping[str, Any] | None:
    """The summary of a search's latest probe at `rate` (the TTFT probe, or the search's own there); None: none."""
    hits = [p for p in search.get("probes") or [] if p.get("rate") is not None and round_rate(p["rate"]) == rate]
    return hits[-1].get("summary") if hits else None


def ttft_row(f: Mapping[str, Any]) -> dict[str, Any] | None:
    """A frontier's TTFT figures at its --search-ttft-rate (the median over its repetitions' probes there): {"system",
    "rate", "n", "ttft_p50_ms", "ttft_p99_ms", "itl_p99_ms", "request_throughput"}; None without such a probe."""
    rate = ttft_rate(f)
    if rate is None:
        return None
    summaries = [s for s in (at_rate(x, rate) for x in searches(f)) if s is not None]
    if not summaries:
        return None
    row: dict[str, Any] = {"system": f["label"], "rate": rate, "n": len(summaries)}
    for key, metric, stat in FIGURES:
        vals = [float(s[metric][stat]) for s in summaries if (s.get(metric) or {}).get(stat) is not None]
        row[key] = statistics.median(vals) if vals else None
    tput = [float(s["request_throughput"]) for s in summaries if s.get("request_throughput") is not None]
    row["request_throughput"] = statistics.median(tput) if tput else None
    return row


def ttft_lines(frontiers: Sequence[Mapping[str, Any]], vllm: set[str]) -> list[str]:
    """One workload's TTFT table (its frontiers), with each row's TTFT p50 over vLLM default's where it ran (else the
    first vLLM setting's); [] where no search had a TTFT rate."""
    rows = [r for r in (ttft_row(f) for f in frontiers) if r is not None]
    if not rows:
        return []
    ref_label = VLLM_DEFAULT if any(r["system"] == VLLM_DEFAULT for r in rows) else \
        next((r["system"] for r in rows if r["system"] in vllm), None)
    ref = next((r for r in rows if r["system"] == ref_label), None)
    rates = sorted({r["rate"] for r in rows})
    head = f"TTFT at {' / '.join(f'{x:g}' for x in rates)} req/s (--search-ttft-rate: one probe a search there"
    lines = ["", head + (f"; the last column over `{ref_label}`'s TTFT p50" if ref is not None else "") + "):", "",
             "| system | rate | TTFT p50 ms | TTFT p99 ms | p99 ITL ms | completed req/s | TTFT p50 / vLLM's |",
             "|---|---|---|---|---|---|---|"]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    for r in rows:
        same = ref is not None and ref["rate"] == r["rate"] and ref["ttft_p50_ms"] and r["ttft_p50_ms"] is not None
        ratio = f"{r['ttft_p50_ms'] / ref['ttft_p50_ms']:.2f}x" if same and ref is not None else "-"
        n = "" if r["n"] == 1 else f" (median of {r['n']})"
        tput = "-" if r["request_throughput"] is None else f"{r['request_throughput']:.3g}"
        lines.append(f"| {r['system']}{n} | {r['rate']:g} | {ms(r['ttft_p50_ms'])} | {ms(r['ttft_p99_ms'])} | "
                     f"{ms(r['itl_p99_ms'])} | {tput} | {ratio} |")
    return lines
