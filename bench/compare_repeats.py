"""`bench/compare.py --goodput-search --search-repeats N`: each system's goodput search on each workload run N times,
and the report's medians over them with their spread (pure, tested on CPU).

One search's goodput is noise from one draw of Poisson arrivals (the same vLLM setting gave [30.9, 33.5) req/s one day
and [23.4, 25.9) the next), so with N > 1 every (system, workload) search runs N times against the same server, each
repetition with arrivals and prompts of its own (compare_args.repeat_salt: repetition k of every system meets the
same arrivals, and no two repetitions share a salt), and the report reads their median.

The median of a target (ITL bound, share) over the repetitions (`median_entry`). Each repetition's entry gives a lower
bound L and an upper bound U on its goodput (`entry_bounds`): a settled value (`converged`) L = U = the value; a
bracket `[lo, hi)*` (the search stopped first) L = lo (0 where nothing passed), U = hi (none: infinite); `>= X` (it
passed at its ceiling) L = X, U infinite; `< X` (it failed at its lowest rate) L = 0, U = X; one that passed above
its bracket too (goodput.passes_above: not monotone in rate) L = that rate, U = the lowest failure above it (none:
infinite), the papers' "highest rate that passes". The median is monotone in
every repetition's value, so the median of the true values lies in [median of the L, median of the U]. The entry's
`goodput` is the median of the L: the median over the lower bounds; a ratio to a median that did not settle is the
range [median L, median U] allows (compare_ratios.py `ratio_range`).

- every repetition converged: `converged`, the cell `31 (30.9–33.5, n=3)`: the median, then the least and the
  greatest repetition's value;
- every one `>= X`: `at_max_rate`, `>= 32 (31–33, n=3)` (the range of their X); every one `< X`: `below_min_rate`,
  `< 0.5 (0.25–1, n=3)` (the range of their X);
- otherwise (a bracket among them, or a mix of kinds): `unfinished` (a bound, never a value: a ratio taken from it is
  a range, marked `*`), the cell `[a, b]*` (the median lies in it: a the median of the L, b that of the U), `>= a*`
  where b is infinite, `a*` where the two agree (the settled repetitions pin the median), then the range of the
  repetitions' L (lower bounds where unsettled) and how many were unsettled: `[30, 32]* (20–35, n=3, 1 unsettled)`.

A repeated frontier (`repeated_record`) is a frontier record (compare_frontier.frontier_record) whose `goodput` holds
the median entries (each with "repeats": {"n", "goodput" (each repetition's L), "cells" (each one's own cell), "min",
"max", "unsettled"}), whose "repeats" holds every repetition's full record (probes included), and whose "search" holds
the settings the repetitions shared. An unrepeated frontier (N = 1) has no "repeats": its cells and report are as
without the flag.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rapidserve.benchmark.goodput import AT_MAX, BELOW_MIN, CONVERGED, NOT_SEARCHED, UNFINISHED
from rapidserve.benchmark.goodput_report import goodput_cell
from rapidserve.benchmark.report import fmt
from rapidserve.benchmark.results import bound_label, entry

REPEATS = "repeats"  # a repeated frontier's (and a median entry's) key; the report's `search` settings' too
REPEATS_LEGEND = (
    "Repetitions (`--search-repeats N`): every system's search on every workload ran N times against the same server, "
    "each repetition with its own Poisson arrivals and prompts (repetition k of every system the same ones). A cell is "
    "the median over the repetitions, then `(min–max, n=N)`: the least and the greatest repetition's goodput. A "
    "repetition that did not settle gives a lower bound (a bracket's lower end, `>= X`'s X, 0 for `< X`) and an "
    "upper one (the bracket's upper end, `< X`'s X, none for `>= X`), and the median lies between the median of the "
    "lower and that of the upper bounds: the cell says `[a, b]*` (`>= a*` without an upper bound, `a*` where the two "
    "agree), its range is of the lower bounds and `k unsettled` counts those repetitions; where every repetition is "
    "`>= X` (`< X`), the cell is `>=` (`<`) the median X and the range that of the X. Ratios divide the medians "
    "(where a repetition did not settle: the range the ratio of the medians lies in, marked `*`). Each "
    "repetition's own cells: the table after each share's.")


def searches(f: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """A frontier's (or a search result's) searches: its repetitions where it was repeated, else itself."""
    reps = f.get(REPEATS)
    return list(reps) if isinstance(reps, list) else [f]


def flatten(frontiers: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Every search of the frontiers (each repeated one's repetitions in its place)."""
    return [s for f in frontiers for s in searches(f)]


def entry_bounds(e: Mapping[str, Any]) -> tuple[float, float]:
    """(L, U): a repetition's goodput lies in [L, U] (see the module docstring; U may be infinite). Where a rate above
    the bracket passed as well (`passes_above`: the attainment was not monotone in rate), the goodput as the papers
    read it, the highest rate that passes, lies in [passes_above, fails_above] (infinite where nothing failed above
    it): those are the bounds, whatever the bracket below says."""
    above = e.get("passes_above")
    if above is not None:
        fails = e.get("fails_above")
        return float(above), math.inf if fails is None else float(fails)
    status, hi = e.get("status"), e.get("hi")
    low = float(e.get("goodput") or 0.0)
    up = math.inf if hi is None else float(hi)
    if status == CONVERGED:
        return low, low
    if status == AT_MAX:
        return low, math.inf
    if status == BELOW_MIN:
        return 0.0, up
    return low, up


def median_entry(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The median over the repetitions' entries of one target (see the module docstring). ValueError when there are
    none."""
    if not entries:
        raise ValueError("no repetition to take a median of")
    first = entries[0]
    if any(e.get("status") == NOT_SEARCHED for e in entries):
        return dict(first)
    lows, ups = zip(*(entry_bounds(e) for e in entries), strict=True)
    statuses = {e.get("status") for e in entries}
    low, up = statistics.median(lows), statistics.median(ups)
    values = lows
    if statuses == {CONVERGED}:
        status, lo, hi = CONVERGED, low, statistics.median(float(e.get("hi") or e["goodput"]) for e in entries)
    elif statuses == {AT_MAX}:
        status, lo, hi = AT_MAX, low, None
    elif statuses == {BELOW_MIN}:
        status, lo, hi, values = BELOW_MIN, None, up, ups
    else:
        status, lo, hi = UNFINISHED, low, (None if math.isinf(up) else up)
    return {"itl_bound_ms": first["itl_bound_ms"], "share": first["share"], "goodput": low, "lo": lo, "hi": hi,
            "status": status,
            REPEATS: {"n": len(entries), "goodput": list(lows), "cells": [goodput_cell(e) for e in entries],
                      "min": min(values), "max": max(values),
                      "unsettled": sum(e.get("status") != CONVERGED for e in entries)}}


def median_cell(e: Mapping[str, Any]) -> str:
    """A median entry's cell (see the module docstring)."""
    r, status = e[REPEATS], e.get("status")
    if status == CONVERGED:
        head = fmt(e["goodput"], ".3g")
    elif status == AT_MAX:
        head = f">= {fmt(e['goodput'], '.3g')}"
    elif status == BELOW_MIN:
        head = f"< {fmt(e['hi'], '.3g')}"
    elif e.get("hi") is None:
        head = f">= {fmt(e['goodput'], '.3g')}*"
    elif fmt(e["hi"], ".3g") == fmt(e["goodput"], ".3g"):
        head = f"{fmt(e['goodput'], '.3g')}*"
    else:
        head = f"[{fmt(e['goodput'], '.3g')}, {fmt(e['hi'], '.3g')}]*"
    unsettled = f", {r['unsettled']} unsettled" if status == UNFINISHED and r["unsettled"] else ""
    return f"{head} ({fmt(r['min'], '.3g')}–{fmt(r['max'], '.3g')}, n={r['n']}{unsettled})"


def cell(e: Mapping[str, Any] | None) -> str:
    """A frontier's cell: a median's (`median_cell`) where the entry is one, else the search's own (goodput_cell)."""
    if e is None or e.get("status") == NOT_SEARCHED or REPEATS not in e:
        return goodput_cell(e)
    return median_cell(e)


def repeated_record(label: str, title: str, reps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The frontier record of one system's repetitions on one workload (each a frontier record), in the order they ran:
    its median entries, every repetition kept under "repeats"."""
    first = reps[0]
    goodput = []
    for e in first["goodput"]:
        b, q = e["itl_bound_ms"], float(e["share"])
        goodput.append(median_entry([x for x in (entry(r, b, q) for r in reps) if x is not None]))
    stopped = [f"repetition {k + 1}: {r['stopped']}" for k, r in enumerate(reps) if not r["finished"]]
    return {"label": label, "title": title, "workload": first.get("workload"), "path": None,
            "search": {"settings": first["search"]["settings"], REPEATS: len(reps)}, "goodput": goodput,
            "finished": not stopped, "stopped": "; ".join(stopped) or None, "probes": [], REPEATS: list(reps)}


def repeats_note(f: Mapping[str, Any]) -> str:
    """A repeated frontier's note in its `search` cell: how many repetitions (each one's own cell: the table below)."""
    return f"median of {len(searches(f))} repetitions (each below)"


def repeats_table(rows: Sequence[Mapping[str, Any]], bounds: Sequence[float | None], share: float,
                  search_cell: Callable[[Mapping[str, Any]], str]) -> list[str]:
    """The repeated frontiers' repetitions at `share`: a row each, its own cells (one search's: goodput_cell) and how
    its search ran (`search_cell`); [] where none was repeated."""
    repeated = [f for f in rows if isinstance(f.get(REPEATS), list)]
    if not repeated:
        return []
    head = ["system", "repetition", *(bound_label(b) for b in bounds), "search"]
    lines = ["", f"Each repetition ({share:.0%} of requests; the cells above are their medians):", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for f in repeated:
        for k, r in enumerate(f[REPEATS]):
            lines.append(f"| {f['label']} | {k + 1} | " + " | ".join(goodput_cell(entry(r, b, share)) for b in bounds)
                         + f" | {search_cell(r)} |")
    return lines


def repeats_of(frontiers: Sequence[Mapping[str, Any]]) -> bool:
    """Whether any frontier was repeated."""
    return any(isinstance(f.get(REPEATS), list) for f in frontiers)
