"""`bench/compare.py --search-start-from REPORT.json[,...]`: start each goodput search where an earlier one ended.

A goodput search from scratch starts at half its server's closed-loop peak and doubles up from there; where the
frontier lies 2-3x above that peak (a closed loop of --num-prompts requests at once is concurrency-bound, and the
searches above it are judged by their backlog), six probes leave most brackets open (bench/results/h200x2_1130f/).
An earlier report of the same system on the same workload says where each target's frontier was; the search then
probes that bracket's ends first (rapidserve/benchmark/goodput.py `next_step`'s hint) and bisects from there.
Nothing else changes: the closed-loop peak is still measured (the probes above it are still judged by their
backlog), and a hint that no longer holds (the frontier moved between sessions) costs what it costs, no more.

`--search-peak-from-prior` (with --search-start-from) also reuses the closed-loop peak the same earlier search recorded
(its "search"'s "peak_request_throughput") and its closed-loop median E2E ("peak_lifetime_s", the first probe's
lifetime estimate; a report without it: none, the first probe estimates its own as with --search-start-rate), so the
search runs no closed loop (35-40 s a system on Mooncake's 64 prompts of 11K tokens at once): `load_searches`' peaks,
`peak_for`. A repeated report's (--search-repeats) peak is the median of its repetitions', and so is its lifetime. A
peak measured in another session, even on a machine of the same kind, may be 10-25% off this server's today, and it
sets the search's start, its ceiling (by default) and which probes count as above the peak (judged by their TTFT
backlog): the search's result records where it came from ("peak_reused_from", "peak_measured_in": where an earlier
search had reused it in turn, the report that measured it). Where the reports have no search of that system on that
workload, or it recorded no peak (it started from --search-start-rate), the closed loop runs as without the flag and
the log says why (the result's "peak_not_reused").

Pure (tested on CPU): the reports are read into {(system label, workload title): hints}, each hint (bound, share,
lo, hi) with the earlier entry's ends as rapidserve/benchmark/results.py's entries hold them (`lo` None where
nothing passed; `hi` None where the ceiling passed); entries not searched are left out. A repeated report's medians
give their own ends. Their peaks: {(system label, workload title): PriorPeak} for every earlier search, a later
report's replacing an earlier one's, as the hints are.
"""

from __future__ import annotations

import datetime
import json
import math
import shlex
import statistics
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from rapidserve.benchmark.goodput import NOT_SEARCHED, bound_key
from rapidserve.benchmark.search_run import KnownPeak
from rapidserve.jsonfile import DuplicateKeyError, load_unique
from rapidserve.redaction import redact_command

Hint = tuple[float | None, float, float | None, float | None]  # (bound ms or None: unbounded, share, lo, hi)
Hints = dict[tuple[str, str], tuple[Hint, ...]]
PEAK_FLAG = "--search-peak-from-prior"
# ead0549 (2026-11-30 12:32 UTC): from then on a multi-turn search records its closed-loop peak in conversations/s,
# the unit of its rates; a report created before it recorded the run's requests (turns) per second, num_turns x that
# (bench/results/h200x2_1130e/multiturn.json: 35.3 "req/s" for 5.9 conversations/s)
TURNS_PEAK_BEFORE = datetime.datetime(2026, 11, 30, 12, 32, 12, tzinfo=datetime.timezone.utc)


# what the report a peak is reused from must share with this run (compare.py's report header): the server the peak was
# measured on (the model's shape, --serve-args: TP, max model length, GPU memory), which the system's label and the
# workload's title do not name, and the workload's flags (`workload_flags`: a trace's title names its file only, not
# its window, start or arrivals)
SETUP = ("model", "serve_args", "workload")


def workload_flags(bench_args: str | None, argv: Iterable[str]) -> str:
    """A workload's flags as compare.py's report header writes them ("workloads"[i]["flags"]), and prints them:
    without their secrets (`--api-key K` for the benchmark's client)."""
    return redact_command([*shlex.split(bench_args or ""), *argv])


class PriorPeak(NamedTuple):
    """An earlier search's closed-loop peak: the report it was read from, and the peak (None: that search recorded
    none, e.g. it started from --search-start-rate), and that report's SETUP values (None: it records none)."""

    source: str
    peak: KnownPeak | None
    setup: Mapping[str, Any] | None = None


Peaks = dict[tuple[str, str], PriorPeak]


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


def turns_per_peak(f: Mapping[str, Any], created: Any) -> int:
    """What a multi-turn frontier's recorded peak is to be divided by: its num_turns where its report was created
    before the peak was recorded in conversations/s (TURNS_PEAK_BEFORE), else 1."""
    reps = f.get("repeats")
    first = reps[0] if isinstance(reps, list) and reps and isinstance(reps[0], Mapping) else {}
    w = f.get("workload") or first.get("workload") or {}
    if not isinstance(w, Mapping) or w.get("name") != "multiturn" or not isinstance(created, str):
        return 1
    try:
        when = datetime.datetime.fromisoformat(created)
        turns = int(w.get("num_turns") or 1)
    except (TypeError, ValueError):
        return 1
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(turns, 1) if when < TURNS_PEAK_BEFORE else 1


def frontier_peak(f: Mapping[str, Any], source: str, created: Any = None) -> KnownPeak | None:
    """The closed-loop peak and lifetime an earlier frontier's search recorded (a repeated one's: the medians of its
    repetitions'), None where it recorded no peak; ValueError naming `source` where a recorded value is no number.
    `created`: the report's; a multi-turn peak recorded before TURNS_PEAK_BEFORE (in turns/s) is given in
    conversations/s, the unit of the rates."""
    reps = f.get("repeats")
    runs = [r.get("search") or {} for r in (reps if isinstance(reps, list) else [f]) if isinstance(r, Mapping)]
    try:
        peaks = [float(s["peak_request_throughput"]) for s in runs if s.get("peak_request_throughput") is not None]
        lives = [float(s["peak_lifetime_s"]) for s in runs if s.get("peak_lifetime_s") is not None]
    except (TypeError, ValueError) as err:
        raise ValueError(f"--search-start-from {source}: {f.get('label')} on {f.get('title')}: a closed-loop peak or "
                         f"lifetime that is no number ({err})") from None
    peaks = [p for p in peaks if p > 0 and math.isfinite(p)]
    lives = [x for x in lives if x > 0 and math.isfinite(x)]
    if not peaks:
        return None
    measured = next((str(s["peak_measured_in"]) for s in runs if s.get("peak_measured_in")), source)
    sizes = {s.get("probe_requests") for s in runs if isinstance(s.get("probe_requests"), int)}
    return KnownPeak(statistics.median(peaks) / turns_per_peak(f, created), statistics.median(lives) if lives else None,
                     source, measured, sizes.pop() if len(sizes) == 1 else None)


def report_peaks(report: Mapping[str, Any], source: str) -> Peaks:
    """{(label, title): PriorPeak} of every frontier of one report (report_hints has checked its shape)."""
    flags = {str(w.get("title")): w.get("flags") for w in report.get("workloads") or [] if isinstance(w, Mapping)}

    def setup(title: str) -> dict[str, Any] | None:
        here = {k: report[k] for k in SETUP if k in report}
        if flags.get(title) is not None:
            here["workload"] = flags[title]
        return here or None

    return {(str(f["label"]), str(f["title"])):
            PriorPeak(source, frontier_peak(f, source, report.get("created")), setup(str(f["title"])))
            for f in report["frontiers"]}


def read_report(path: str) -> dict[str, Any]:
    """The JSON object at `path`; ValueError naming the file that cannot be read."""
    try:
        report = load_unique(path)
    except OSError as e:
        raise ValueError(f"--search-start-from {path}: {e.strerror or e}") from None
    except DuplicateKeyError as e:
        raise ValueError(f"--search-start-from {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--search-start-from {path}: not JSON ({e})") from None
    if not isinstance(report, dict):
        raise ValueError(f"--search-start-from {path}: not a compare.py goodput-search report (no frontiers)")
    return report


def load_searches(paths: Iterable[str]) -> tuple[Hints, Peaks]:
    """The hints and the closed-loop peaks of every report in `paths`, each a later report's replacing an earlier
    one's for the same system and workload; ValueError naming the file that cannot be read."""
    hints: Hints = {}
    peaks: Peaks = {}
    for path in paths:
        report = read_report(path)
        hints.update(report_hints(report, path))
        peaks.update(report_peaks(report, path))
    return hints, peaks


def load_hints(paths: Iterable[str]) -> Hints:
    """The hints of every report in `paths` (load_searches')."""
    return load_searches(paths)[0]


def peak_for(peaks: Peaks, label: str, title: str,
             setup: Mapping[str, Any] | None = None) -> tuple[KnownPeak | None, str]:
    """(the peak a search of `label` on workload `title` reuses, None where there is none; what the log says: where
    it came from, or why the closed loop runs). `setup`: this run's SETUP values; a peak from a report with others
    (another model or --serve-args: another server) is not reused."""
    prior = peaks.get((label, title))
    if prior is None:
        return None, (f"no earlier search of {label} on {title} in --search-start-from's reports: its closed-loop "
                      f"peak is measured ({PEAK_FLAG} has none to reuse)")
    if prior.peak is None:
        return None, (f"its earlier search in {prior.source} recorded no closed-loop peak (--search-start-rate): its "
                      f"closed-loop peak is measured ({PEAK_FLAG} has none to reuse)")
    there, here = prior.setup or {}, setup or {}
    differ = [k for k in SETUP if k in there and k in here and there[k] != here[k]]
    if differ:
        return None, (f"its earlier search in {prior.source} ran with another "
                      + "; ".join(f"{k} ({there[k]!r} there, {here[k]!r} here)" for k in differ)
                      + f": its closed-loop peak is measured ({PEAK_FLAG} reuses a peak of the same server only)")
    return prior.peak, f"closed-loop peak {prior.peak.describe()}: no closed loop runs"


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
