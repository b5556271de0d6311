"""`bench/compare.py --search-start-from REPORT.json[,...]`: start each goodput search where an earlier one ended.

A goodput search from scratch starts at half its server's closed-loop peak and doubles up from there; where the
frontier lies 2-3x above that peak (a closed loop of --num-prompts requests at once is concurrency-bound, and the
searches above it are judged by their backlog), six probes leave most brackets open (bench/results/h200x2_1130f/).
An earlier report of the same system on the same workload says where each target's frontier was; the search then
probes that bracket's ends first (rapidserve/benchmark/goodput.py `next_step`'s hint) and bisects from there.
Nothing else changes: the closed-loop peak is still measured (the probes above it are still judged by their
backlog), and a hint that no longer holds (the frontier moved between sessions) costs what it costs, no more.

Pure (tested on CPU): the reports are read into {(system label, workload title): hints}, each hint (bound, share,
lo, hi) with the earlier entry's ends as rapidserve/benchmark/results.py's entries hold them (`lo` None where
nothing passed; `hi` None where the ceiling passed); entries not searched are left out. A repeated report's medians
give their own ends.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any

from rapidserve.benchmark.goodput import NOT_SEARCHED, bound_key

Hint = tuple[float | None, float, float | None, float | None]  # (bound ms or None: unbounded, share, lo, hi)
Hints = dict[tuple[str, str], tuple[Hint, ...]]


def entry_hint(e: Mapping[str, Any]) -> Hint | None:
    """An earlier goodput entry as a hint, None where it was not searched or says nothing (no end known)."""
    if e.get("status") == NOT_SEARCHED:
        return None
    lo = e.get("lo")
    lo = float(lo) if lo is not None and float(lo) > 0 else None
    hi = float(e["hi"]) if e.get("hi") is not None else None
    if lo is not None and hi is not None and lo >= hi:
        hi = None  # no bracket (a hand-edited or odd entry): its lower end alone
    if lo is None and hi is None:
        return None
    bound = None if e.get("itl_bound_ms") is None else float(e["itl_bound_ms"])
    return bound, float(e["share"]), lo, hi


def report_hints(report: Mapping[str, Any], source: str) -> Hints:
    """{(label, title): hints} of one compare.py goodput-search report (its "frontiers"); ValueError naming `source`
    when it is none."""
    frontiers = report.get("frontiers")
    if not isinstance(frontiers, list):
        raise ValueError(f"--search-start-from {source}: not a compare.py goodput-search report (no frontiers)")
    out: Hints = {}
    for f in frontiers:
        try:
            key = (str(f["label"]), str(f["title"]))
            hints = tuple(h for h in (entry_hint(e) for e in f["goodput"]) if h is not None)
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"--search-start-from {source}: a frontier without a label, title or goodput entries "
                             f"({type(err).__name__}: {err})") from None
        if hints:
            out[key] = hints
    return out


def load_hints(paths: Iterable[str]) -> Hints:
    """The hints of every report in `paths`, a later report's replacing an earlier one's for the same system and
    workload; ValueError naming the file that cannot be read."""
    out: Hints = {}
    for path in paths:
        try:
            with open(path) as f:
                report = json.load(f)
        except OSError as e:
            raise ValueError(f"--search-start-from {path}: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"--search-start-from {path}: not JSON ({e})") from None
        if not isinstance(report, dict):
            raise ValueError(f"--search-start-from {path}: not a compare.py goodput-search report (no frontiers)")
        out.update(report_hints(report, path))
    return out


def paths_arg(text: str) -> tuple[str, ...]:
    """--search-start-from's value: comma-separated report paths, none empty."""
    paths = tuple(p.strip() for p in text.split(","))
    if not all(paths):
        raise ValueError(f"--search-start-from {text!r}: give report paths, comma-separated")
    return paths


def hints_text(hints: Iterable[Hint]) -> str:
    """'unbounded @0.9 [9.97, 12), 50 @0.9 [3.41, ?)': each hint's bound, share and ends (? where not known)."""
    def end(x: float | None) -> str:
        return "?" if x is None else f"{x:g}"

    return ", ".join(f"{bound_key(b)} @{q:g} [{end(lo)}, {end(hi)})" for b, q, lo, hi in hints)
