"""A result dict (a sweep's, or a goodput search's) as the reports and the plots read it: loading its
JSON, naming its workload, a search's goodput entries.

`trace_line` says in one line what a trace replay sent (the runner logs it, the report writes it).
Below `report` and `goodput_report` (which write results, their markdown and their plots) and `plot`
(which draws them), so none imports another's helpers.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.benchmark.goodput import NOT_SEARCHED, UNBOUNDED
from rapidserve.jsonfile import load_unique


def workload_title(workload: Mapping[str, Any]) -> str:
    """'fixed 4096:64', 'multiturn 1024:128 x4 (+128/turn)', or the trace's name."""
    name = str(workload.get("name", "?"))
    if name == "fixed":
        return f"fixed {workload.get('input_len')}:{workload.get('output_len')}"
    if name == "multiturn":
        return (f"multiturn {workload.get('input_len')}:{workload.get('output_len')} x{workload.get('num_turns')} "
                f"(+{workload.get('turn_input_len')}/turn)")
    if name == "trace":
        return f"trace {os.path.basename(str(workload.get('trace', '?')))}"
    return name


def trace_line(t: dict[str, Any]) -> str:
    """One line about a replay (`Replay.describe()`, the result's "trace"): file, window, counts,
    ideal hit rate."""
    start, end = t["window_s"]
    window = f"[{start:g}, {end:g}) s" if end is not None else f"{start:g} s to the end"
    hits = f"ideal prefix-cache hit rate {100 * t['ideal_hit_rate']:.1f}% ({t['block_size']}-token blocks"
    if "ideal_hit_rate_hash_blocks" in t:
        hits += f"; {100 * t['ideal_hit_rate_hash_blocks']:.1f}% in {t['hash_block_tokens']}-token hash blocks"
    else:
        hits += ": no hash ids in the trace, so every prompt is random tokens of its own"
    return (f"trace {t['file']} ({t['format']}), window {window} of trace time (lines {t['first_line']}-"
            f"{t['last_line']}), {t['arrivals']} arrivals: {t['replayed']} replayed of {t['in_window']} in the "
            f"window, {t['clipped']} clipped, {t['skipped']} skipped, {t['beyond_num_prompts']} past "
            f"--num-prompts; {hits})")


def load_result(path: str) -> dict[str, Any]:
    """A result JSON file as `rapidserve bench` wrote it (non-finite numbers are null there); OSError where it
    cannot be read, ValueError where it is not JSON or writes a key twice in one object (naming the file)."""
    return load_unique(path)  # type: ignore[no-any-return]


# ---------------------------------------------------------------- a goodput search's result (goodput_report.py)


def bound_label(itl_bound_ms: float | None) -> str:
    """'25 ms', ... or 'unbounded'."""
    return UNBOUNDED if itl_bound_ms is None else f"{itl_bound_ms:g} ms"


def entry(result: Mapping[str, Any], itl_bound_ms: float | None, share: float) -> dict[str, Any] | None:
    """A search result's goodput entry for (bound, share), if it has one."""
    want = None if itl_bound_ms is None else float(itl_bound_ms)
    for e in result.get("goodput", []):
        b = None if e["itl_bound_ms"] is None else float(e["itl_bound_ms"])
        if b == want and abs(float(e["share"]) - share) < 1e-9:
            return dict(e)
    return None


def search_bounds(result: Mapping[str, Any]) -> list[float | None]:
    """The bounds a search result was scored at, tightest first and unbounded last (the frontier's x order)."""
    return [*sorted(float(b) for b in result["search"]["settings"]["itl_bounds_ms"]), None]


def search_shares(result: Mapping[str, Any]) -> list[float]:
    return sorted(float(q) for q in result["search"]["settings"]["shares"])


def frontier_points(result: Mapping[str, Any], share: float,
                    bounds: Sequence[float | None] | None = None) -> list[tuple[float | None, float | None]]:
    """(bound, goodput) along the bounds (default: the result's) for one share (None where not searched: no entry,
    or one of a bound outside the search's only_bounds)."""
    out: list[tuple[float | None, float | None]] = []
    for b in bounds if bounds is not None else search_bounds(result):
        e = entry(result, b, share)
        out.append((b, None if e is None or e["status"] == NOT_SEARCHED else float(e["goodput"])))
    return out
