"""Poisson rates set from a reference system's measured peak (`bench/compare.py --peak-fractions`).

The issue tables ask for figures "at 75% of vLLM's peak rate": the reference system (vLLM, run first)
runs its closed sweep (rate inf) first; its completed requests per second there is its peak on that
workload, and every system then runs Poisson arrivals at the given fractions of it, the reference
included. Pure helpers, tested on CPU (tests/test_bench_compare.py).

The goodput search's shared ceiling (`--goodput-search --search-shared-ceiling`, `highest_peak`): each system's
search measures its own closed-loop peak first, and by default stops there; with the shared ceiling it may go up to
the highest closed-loop peak of the workload's searches so far in the comparison (an earlier report's too, with
--continue-from), so that a system whose closed-loop peak understates what it sustains (an ITL SLO: its burst's
decode batch is full) is searched as far as the others, and its cells compare with theirs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def fractions_arg(text: str) -> tuple[float, ...]:
    """'0.25,0.5,0.75' -> (0.25, 0.5, 0.75): fractions in (0, 2], each once, ascending."""
    out: list[float] = []
    for part in text.split(","):
        try:
            v = float(part)
        except ValueError:
            raise ValueError(f"{part!r} is not a number: give fractions of the peak in (0, 2], "
                             "e.g. 0.25,0.5,0.75,0.9") from None
        if not 0 < v <= 2 or v in out:
            raise ValueError(f"{part!r}: each fraction must be in (0, 2] and given once, e.g. 0.25,0.5,0.75,0.9")
        out.append(v)
    return tuple(sorted(out))


def closed_peak(result: dict[str, Any]) -> float | None:
    """Arrivals per second a bench result's closed run (rate inf) completed, in the unit of its rates: completed
    requests per second, over a multi-turn workload's turns (its arrivals are conversations); None without one (or
    when it completed nothing)."""
    spec = (result.get("config") or {}).get("workload_spec") or {}
    turns = int(spec.get("num_turns") or 1) if spec.get("name") == "multiturn" else 1
    for run in result.get("runs", []):
        if run.get("rate") in ("inf", math.inf):
            s = run.get("summary", {})
            rps = float(s.get("request_throughput") or 0.0)
            return rps / turns if rps > 0 and s.get("completed", 0) > 0 else None
    return None


def fraction_rates(peak: float | None, fractions: Sequence[float], existing: Sequence[float]) -> tuple[float, ...]:
    """The rates `fractions` x `peak` (req/s, two decimals), without those already in `existing`."""
    if peak is None or peak <= 0:
        return ()
    have = {round(r, 2) for r in existing if math.isfinite(r)}
    out = sorted({round(f * peak, 2) for f in fractions} - have)
    return tuple(r for r in out if r > 0)


def rate_of(run: dict[str, Any]) -> float:
    """A run's offered rate as a number (a report writes the closed run's as "inf")."""
    r = run.get("rate")
    return math.inf if r in ("inf", math.inf) else float(r)  # type: ignore[arg-type]


def merge_results(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One bench result from two sweeps of the same system and workload (runs ordered by rate, inf last)."""
    merged = dict(first)
    merged["runs"] = sorted([*first.get("runs", []), *second.get("runs", [])], key=rate_of)
    merged["skipped_rates"] = [*first.get("skipped_rates", []), *second.get("skipped_rates", [])]
    cfg = dict(first.get("config", {}))
    cfg["rates"] = [*cfg.get("rates", []), *second.get("config", {}).get("rates", [])]
    merged["config"] = cfg
    return merged



def highest_peak(searches: Sequence[Mapping[str, Any]], title: str) -> tuple[float, str] | None:
    """The highest closed-loop peak (req/s) among the goodput searches of workload `title` (search results or a
    report's frontiers: their "search"'s "peak_request_throughput"), and whose it is (the first to reach it); None
    where none measured one."""
    best: tuple[float, str] | None = None
    for f in searches:
        peak = (f.get("search") or {}).get("peak_request_throughput")
        if f.get("title") == title and peak is not None and (best is None or float(peak) > best[0]):
            best = (float(peak), str(f.get("label")))
    return best
