"""`bench/compare.py --continue-from PATH`: a comparison too long for one run (one GPU call) continues an earlier
run's report. Pure helpers, tested on CPU (tests/test_bench_compare.py).

The earlier report (<name>.json) must describe the same comparison: the same model, --serve-args, workloads (titles
and bench flags), rates, prompts per rate, arrivals, seed, ITL bounds and --peak-fractions, and the same mode (a sweep
or --goodput-search) with the same search settings (--search-repeats among them: a report of medians over N
repetitions continues only with N) but those of SEARCH_EXTENT (how far and from where a search looked: its probes,
budget, limits and bounds searched); anything else is refused with what differs. A goodput search's
report carries its systems' frontiers on as a sweep's carries its rows. Where the searches started
(--search-start-from's brackets) and whether their closed-loop peaks were reused (--search-peak-from-prior) are not
matched (the report's top-level "search_start_from" and "search_peak_from_prior", not its `search` settings): they
change how a search starts, not what it measures, and each frontier's own `search` records them.
Its systems that produced rows are kept as they are (their rows and sweeps come first in
the new report, and each keeps the file it ran in under "report"); its systems that did not run (skipped, not
started, interrupted) may run now under the same label, and their old entries are dropped. The earlier run's
reference peaks set this run's --peak-fractions rates, and its vLLM baseline stays the baseline, unless this run
names one of the earlier systems instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rapidserve.jsonfile import DuplicateKeyError, load_unique

MATCH = ("model", "serve_args", "workloads", "itl_bounds_ms", "rates", "per_rate", "arrival", "seed", "peak_fractions")
# Also matched, absent from reports older than them (read as None there): the mode and the search's settings.
MATCH_NEWER = ("mode", "search")
# Search settings that bound only how far and from where a search looks (its number of probes, its budget, its
# limits, the bounds it searches, the fraction of the peak it starts at), not what a probe measures nor how exact a
# settled cell is: reports that differ in them still compare (a bracket from 8 probes and one from 10 are brackets of
# one frontier; a cell outside the limits says so), so they are not matched. Matched still: start_rate (given, it
# skips the closed-loop peak, so no probe is judged above the peak and the ceiling is 8 x the start) and tolerance (a
# converged cell is read as exact, to its report's tolerance).
SEARCH_EXTENT = ("start_fraction", "min_rate", "max_rate", "max_probes", "budget_s", "only_bounds", "hints")


def load_prior(path: str, now: Mapping[str, Any]) -> dict[str, Any]:
    """The earlier report at `path`, checked against this run's `now` (its values of MATCH, as compare.py writes
    them into a report). ValueError naming the file and what is wrong."""
    try:
        prior = load_unique(path)
    except DuplicateKeyError as e:
        raise ValueError(f"--continue-from {e}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"--continue-from {path}: cannot read it as JSON ({e}); give the <name>.json an earlier "
                         "compare.py run wrote") from None
    need = ("rows", "sweeps", "systems", "peaks", *MATCH)
    missing = [k for k in need if not isinstance(prior, dict) or k not in prior]
    if missing:
        raise ValueError(f"--continue-from {path}: not a compare.py report (no {', '.join(missing)})")
    prior.setdefault("frontiers", [])  # a sweep's report has none
    shapes = (("systems", ("label", "flags", "status")), ("workloads", ("title", "flags")),
              ("rows", ("system", "workload")), ("sweeps", ("label", "title", "runs")),
              ("frontiers", ("label", "title", "search", "goodput")))
    for key, fields in shapes:
        bad = [i for i, x in enumerate(prior[key]) if not isinstance(x, dict) or any(f not in x for f in fields)]
        if not isinstance(prior[key], list) or bad:
            raise ValueError(f"--continue-from {path}: `{key}` must be a list of objects with {', '.join(fields)}"
                             f" (entry {bad[0] if bad else '?'} is not)")
    if not isinstance(prior["peaks"], dict):
        raise ValueError(f"--continue-from {path}: `peaks` must be an object (workload title -> req/s)")
    was_n, want_n = search_repeats(prior), search_repeats(now)
    if was_n != want_n:
        raise ValueError(f"--continue-from {path} ran each search {was_n} time(s) (--search-repeats {was_n}); this run "
                         f"{want_n}: its cells are medians over another number of repetitions (or none), and a ratio "
                         f"between the two would mix them: give --search-repeats {was_n}, or start a new report")
    for k in (*MATCH, *MATCH_NEWER):
        was, want = (prior.get(k, "sweep" if k == "mode" else None), now.get(k, "sweep" if k == "mode" else None))
        if k == "search":
            was, want = _measured(was), _measured(want)
        if _norm(was) != _norm(want):
            if isinstance(was, dict) and isinstance(want, dict):  # name the settings that differ, not the whole dict
                a, b = _norm(was), _norm(want)
                diff = "; ".join(f"{f}: {was.get(f)!r} there, {want.get(f)!r} here" for f in sorted({*a, *b})
                                 if a.get(f) != b.get(f))
                raise ValueError(f"--continue-from {path} ran with other {k} settings ({diff}): give the same, or the "
                                 "two runs do not compare")
            raise ValueError(f"--continue-from {path} ran with {k} = {was!r}; this run has {want!r}: give "
                             "the same, or the two runs do not compare")
    return prior


def _measured(search: Any) -> Any:
    """A report's search settings less SEARCH_EXTENT: those that change what a probe measures."""
    return {k: v for k, v in search.items() if k not in SEARCH_EXTENT} if isinstance(search, Mapping) else search


def search_repeats(report: Mapping[str, Any]) -> int:
    """How many times a report's searches ran each (--search-repeats; 1 where its search settings do not say)."""
    search = report.get("search")
    return int(search.get("repeats") or 1) if isinstance(search, Mapping) else 1


def _norm(v: Any) -> Any:
    """JSON's view of a value (tuples as lists, ints as floats), so a report read back compares with this run's; an
    object's null fields left out (a search setting added later, at its default None, matches a report without it)."""
    if isinstance(v, (list, tuple)):
        return [_norm(x) for x in v]
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items() if x is not None}
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return v
    return float(v)


def ran(prior: Mapping[str, Any]) -> set[str]:
    """Labels of the earlier systems that produced rows (a sweep) or frontiers (a goodput search)."""
    return {r["system"] for r in prior["rows"]} | {f["label"] for f in prior.get("frontiers", [])}


def carried_systems(prior: Mapping[str, Any], path: str, now: Sequence[str]) -> list[dict[str, Any]]:
    """The earlier systems' entries for the new report: each keeps the report it ran in ("report"; the first one
    when carried on again); one that produced no rows is dropped when a system of this run has its label.
    ValueError when a system of this run already produced rows there."""
    again = sorted(set(now) & ran(prior))
    if again:
        raise ValueError(f"{', '.join(again)} already ran in --continue-from {path}; a system runs once in a report "
                         "(give it another label with --system LABEL=...)")
    return [{**i, "report": i.get("report", path)} for i in prior["systems"] if i["label"] not in now]


def choose_reference(prior: Mapping[str, Any], given: str | None, now: Sequence[str]) -> tuple[str | None, bool]:
    """(the --peak-fractions reference, whether its peaks come from the earlier report). The earlier report's
    peaks are used when it has any and `given` is none or its own reference; a reference of this run needs a
    report without peaks. ValueError otherwise."""
    if prior.get("peaks"):
        ref = prior.get("peak_reference")
        if given is not None and given != ref:
            raise ValueError(f"--peak-reference {given!r}: the earlier report's rates came from {ref!r}'s peaks, and "
                             "its rows were run at them; drop --peak-reference (or start a new report)")
        return ref, True
    ref = given or (now[0] if now else None)
    if ref not in now:
        why = " (the earlier report has no peaks)" if prior else ""
        raise ValueError(f"--peak-reference {ref!r} is none of the systems: {list(now)}{why}")
    return ref, False


def choose_baseline(prior: Mapping[str, Any] | None, given: str | None, now: Sequence[str],
                    fallback: str | None) -> str | None:
    """The vs-vLLM baseline: `given` when it names an earlier system that ran; with none given, the earlier
    report's; else `fallback` (compare.py's choice among this run's systems). ValueError when `given` names no
    system of either run."""
    if prior is None:
        return fallback
    if given is not None and given in ran(prior):
        return given
    if given is not None and given not in now:
        raise ValueError(f"--vllm-baseline {given!r} is none of the systems of this run {list(now)} or of the earlier "
                         f"report {sorted(ran(prior))}")
    if given is None and prior.get("vllm_baseline"):
        return prior["vllm_baseline"]
    return fallback
