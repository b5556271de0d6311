"""`bench/compare.py --goodput-search`: one system's goodput searches on one workload against its running server, each
repetition (--search-repeats N) with its own salt, deadline and result file.

Repetition k of the search on workload number i (of W) salts its probes from compare_args.repeat_salt(i, k, W), so the
repetitions' arrivals and prompts differ from each other's and from every other workload's, while every system's
repetition k meets the same ones. Each repetition is a whole search
(`rapidserve.benchmark.search_run.run_goodput_search`: its closed-loop peak, then its probes, at most
--search-max-probes) against the same server (no restart between repetitions), and gets an even share of the time
left, as each search does without repetitions (compare_frontier.search_deadline): the searches still to run count
every repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_args import Workload, bench_config, repeat_salt  # noqa: E402
from compare_frontier import search_deadline, startup_reserve  # noqa: E402
from compare_peak import highest_peak  # noqa: E402
from compare_prior import peak_for, workload_flags  # noqa: E402
from compare_repeats import REPEATS, flatten  # noqa: E402
from compare_systems import System  # noqa: E402

from rapidserve.benchmark.cli import safe_name  # noqa: E402
from rapidserve.benchmark.goodput_report import write_search_outputs  # noqa: E402
from rapidserve.benchmark.results import bound_label  # noqa: E402
from rapidserve.benchmark.runner import say  # noqa: E402
from rapidserve.benchmark.search_config import SearchConfig  # noqa: E402
from rapidserve.benchmark.search_run import KnownPeak, run_goodput_search  # noqa: E402
from rapidserve.redaction import redact_args  # noqa: E402

# what a search (or a sweep) may raise that ends the workload's runs on that system, not the comparison
RUN_ERRORS = (ValueError, ConnectionError, OSError, aiohttp.ClientError, asyncio.TimeoutError)


def system_search(scfg: SearchConfig, system: System) -> SearchConfig:
    """The search settings of one system: --search-* with the system's own bounds (duet@B: B alone), checked.
    ValueError naming the system when its bounds are not among those searched."""
    if system.only_bounds is None:
        return scfg
    mine = dataclasses.replace(scfg, only_bounds=system.only_bounds)
    try:
        mine.check()
    except ValueError:
        raise ValueError(f"{system.label} is searched at {', '.join(bound_label(b) for b in system.only_bounds)}: "
                         "add it to --search-itl-bounds-ms") from None
    return mine


def search(a: argparse.Namespace, w: Workload, url: str, system: System, salt: int, deadline: float | None,
           peers: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:
    """One workload's goodput search against the server at `url`, its probes salted from `salt`. With
    --search-shared-ceiling its ceiling is at least the highest closed-loop peak among `peers` (the searches so far,
    each repetition of a repeated one); with --search-start-from it starts from this system's earlier brackets on
    this workload, and with --search-peak-from-prior from that search's closed-loop peak too (no closed loop; each
    repetition alike), where it recorded one (else the closed loop runs, the log and the result's
    "peak_not_reused" saying why)."""
    cfg = bench_config(a, w.argv, base_url=url, label=system.label)
    shared = highest_peak(flatten(peers), w.title) if getattr(a, "search_shared_ceiling", False) else None
    scfg = system_search(a.search, system)
    hints = getattr(a, "search_hints", {}).get((system.label, w.title))  # --search-start-from: compare_prior.py
    if hints:
        scfg = dataclasses.replace(scfg, hints=hints)
    known: KnownPeak | None = None
    why: str | None = None
    if getattr(a, "search_peak_from_prior", False):
        known, why = peak_for(getattr(a, "search_peaks", {}), system.label, w.title,
                              {"model": getattr(a, "model", None),
                               "serve_args": redact_args(getattr(a, "serve_args", None)),
                               "workload": workload_flags(getattr(a, "bench_args", None), w.argv)})
        if known is None:
            say(cfg, f"{system.label} on {w.title}: {why}")
    res = asyncio.run(run_goodput_search(dataclasses.replace(cfg, salt_base=salt), scfg, deadline=deadline,
                                         shared_peak=shared[0] if shared else None, known_peak=known))
    if shared is not None:
        res["search"]["shared_peak_system"] = shared[1]
    if why is not None and known is None:
        res["search"]["peak_not_reused"] = why
    return res


def repeats(a: argparse.Namespace) -> int:
    """--search-repeats' N (1 without the flag)."""
    return getattr(a, "search_repeats", None) or 1


def searches_left(n: int, workloads: int, workload: int, repetition: int, later: int) -> int:
    """The searches still to run, this one included: the rest of this workload's `n` repetitions, this system's later
    workloads' and every one of the `later` systems'."""
    return n * (workloads - workload + later * workloads) - repetition


def workload_searches(a: argparse.Namespace, system: System, url: str, w: Workload, wi: int, workloads: int,
                      deadline: float | None, later: Sequence[str], started: Mapping[str, float] | None,
                      results: list[dict[str, Any]], peers: Sequence[Mapping[str, Any]] = (),
                      clock: Callable[[], float] = time.monotonic) -> str | None:
    """The system's searches on workload `w` (number `wi` of `workloads`), --search-repeats of them, each written to
    <out>/compare_runs/ (`<name>__<label>__<workload>`, `__rep<k>` after it where N > 1) and joined to `results` as
    soon as it ends (so that a comparison cut short reports the repetitions that ran): the search's result, or where
    N > 1 {"label", "title", "workload", "repeats": each repetition's result}. `later`: the kinds of the systems still
    to run (their start-ups are reserved); `peers`: the searches before these (--search-shared-ceiling). The error
    that stopped them, else None (a repetition that fails keeps those before it)."""
    n, done, slot = repeats(a), list[dict[str, Any]](), len(results)
    stem = safe_name(f"{a.name}__{system.label}__{w.title}")
    for k in range(n):
        left, salt = searches_left(n, workloads, wi, k, len(later)), repeat_salt(wi, k, workloads)
        try:
            res = search(a, w, url, system, salt,
                         search_deadline(clock(), deadline, left, startup_reserve(later, started)), [*peers, *done])
        except RUN_ERRORS as e:
            return str(e) if n == 1 else f"repetition {k + 1} of {n}: {e}"
        res["title"] = w.title
        if n > 1:  # which repetition, and the salt its probes' arrivals and prompts were drawn from (probe i: + i)
            res.update(repeat=k + 1, salt_base=salt)
        name = stem if n == 1 else f"{stem}__rep{k + 1}"
        res["path"] = write_search_outputs(res, os.path.join(a.out, "compare_runs"), name, plot=False)[0]["json"]
        done.append(res)
        joined = res if n == 1 else {"label": system.label, "title": w.title, "workload": done[0]["workload"],
                                     REPEATS: list(done)}
        results[slot:] = [joined]
    return None
