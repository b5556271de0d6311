"""`rapidserve bench --goodput-search`'s flags: adding them to a parser, checking what goes with them, and
the SearchConfig they make (bench/compare.py adds them to its own parser too)."""

from __future__ import annotations

import argparse

from rapidserve.benchmark.flags import (
    bounds_arg,
    factor_arg,
    nonneg_int,
    only_bounds_arg,
    positive_float,
    positive_int,
    shares_arg,
)
from rapidserve.benchmark.goodput import DEFAULT_ITL_BOUNDS_MS, DEFAULT_SHARES
from rapidserve.benchmark.search_config import SearchConfig

SEARCH_NUM_PROMPTS = 80  # arrivals per probe unless --num-prompts says (16 discarded as warm-up: 64 counted)
# (flag, SearchConfig field)
SEARCH_FLAGS: tuple[tuple[str, str], ...] = (
    ("--search-itl-bounds-ms", "itl_bounds_ms"), ("--search-shares", "shares"), ("--search-start-rate", "start_rate"),
    ("--search-start-fraction", "start_fraction"), ("--search-min-rate", "min_rate"),
    ("--search-max-rate", "max_rate"), ("--search-tolerance", "tolerance"), ("--search-max-probes", "max_probes"),
    ("--search-discard", "discard"), ("--search-only-bounds", "only_bounds"),
    ("--search-above-peak-factor", "above_peak_factor"), ("--search-max-probe-arrivals", "max_probe_arrivals"),
    ("--search-ttft-rate", "ttft_rate"), ("--search-trace-probe", "trace_probe"))


def add_search_args(p: argparse.ArgumentParser, budget: bool = True) -> None:
    """The goodput search's flags (bench/compare.py adds them too, without --budget-s: it has its own)."""
    g = p.add_argument_group("goodput search (the papers' goodput: rapidserve/benchmark/goodput.py)")
    g.add_argument("--goodput-search", action="store_true",
                   help="instead of a sweep, search the Poisson rate for goodput at each p95 ITL bound and share: "
                        "the highest rate at which that share of requests meet the bound and the TTFT rule "
                        "(TTFT <= max(1 s, 1 s per 1000 prompt tokens)); each probe counts --num-prompts "
                        f"(default {SEARCH_NUM_PROMPTS}) less --search-discard arrivals, after a warm-up of at least "
                        "--search-discard (--search-max-probe-arrivals says how long)")
    d = SearchConfig()
    g.add_argument("--search-itl-bounds-ms", type=bounds_arg, default=None, metavar="B1,B2,...",
                   help="per-request p95 ITL bounds, ms (unbounded is always searched too; default: "
                        + ",".join(f"{b:g}" for b in DEFAULT_ITL_BOUNDS_MS) + ")")
    g.add_argument("--search-shares", type=shares_arg, default=None, metavar="Q1,Q2,...",
                   help="shares of requests that must meet them (default: "
                        + ",".join(f"{q:g}" for q in DEFAULT_SHARES) + ")")
    g.add_argument("--search-start-rate", type=positive_float, default=None, metavar="REQ_PER_S",
                   help="the first rate probed (default: --search-start-fraction x the closed-loop peak, measured "
                        "first with --num-prompts requests at once)")
    g.add_argument("--search-start-fraction", type=positive_float, default=None,
                   help=f"of the closed-loop peak (default {d.start_fraction:g})")
    g.add_argument("--search-min-rate", type=positive_float, default=None,
                   help="the lowest rate probed; a bound that fails there is reported '< MIN' (default: start / 4)")
    g.add_argument("--search-max-rate", type=positive_float, default=None,
                   help="the highest rate probed; a bound that passes there is reported '>= MAX' (default: the "
                        "closed-loop peak, the most a finite probe can say is sustained; with --search-start-rate: "
                        "start x 8). Above the closed-loop peak the probes are judged by their TTFT backlog too, and "
                        "--search-above-peak-factor makes them longer")
    g.add_argument("--search-tolerance", type=positive_float, default=None,
                   help=f"stop bisecting when the failing rate <= the passing one x (1 + this) (default "
                        f"{d.tolerance:g})")
    g.add_argument("--search-max-probes", type=positive_int, default=None,
                   help=f"Poisson probes at most, over every bound and share (default {d.max_probes})")
    g.add_argument("--search-discard", type=nonneg_int, default=None,
                   help=f"each probe's first arrivals (multiturn: conversations) left out as warm-up, at least "
                        f"(more where the requests live longer: --search-max-probe-arrivals) (default {d.discard})")
    g.add_argument("--search-only-bounds", type=only_bounds_arg, default=None, metavar="B|unbounded,...",
                   help="search these bounds only (of --search-itl-bounds-ms, or unbounded) and stop once their "
                        "brackets close, e.g. for a server whose ITL SLO is one bound; every probe is still scored at "
                        "every bound, the others reported not searched (default: every bound)")
    g.add_argument("--search-above-peak-factor", type=factor_arg, default=None, metavar="F",
                   help="probes at rates above the server's own closed-loop peak (there are some only where the "
                        "ceiling lies above it: --search-max-rate, or bench/compare.py's --search-shared-ceiling) "
                        "count F x the requests of the others, their warm-up discard unchanged, because a longer "
                        "probe is what makes an overload visible; every probe above the peak also fails where its "
                        "TTFT backlog grew (rapidserve/benchmark/sustain.py) (default 1: as long as the others)")
    g.add_argument("--search-max-probe-arrivals", type=positive_int, default=None, metavar="N",
                   help="no probe sends more arrivals than this, its warm-up included. Each probe's warm-up is the "
                        "larger of --search-discard arrivals and those within 1.25 request lifetimes (estimated from "
                        "the probes so far; the ramp rule: rapidserve/benchmark/sustain.py), so that the requests it "
                        "counts meet the server at its steady load; one that would need more than N to get there "
                        f"fails every target, reported as capped (default {d.max_probe_arrivals})")
    g.add_argument("--search-ttft-rate", type=positive_float, default=None, metavar="REQ_PER_S",
                   help="after the search, one more probe at this Poisson rate (unless the search probed it), for "
                        "TTFT at one rate: give every system of a comparison the same rate, e.g. 0.75 x vLLM "
                        "default's closed-loop peak (bench/compare.py reports the TTFT of each system's probe there)")
    g.add_argument("--search-trace-probe", type=positive_int, default=None, metavar="N",
                   help="a trace workload: each probe sends the window's first N requests (N - --search-discard "
                        "counted), and the window (the trace's --num-prompts or --duration-s) is the most a probe "
                        "may send: warm-ups the ramp rule lengthens and probes above the peak "
                        "(--search-above-peak-factor) take further requests from it. A probe above the peak that "
                        "the window cuts short of the arrivals it means to count fails (default: every probe is the "
                        "whole window)")
    if budget:
        g.add_argument("--budget-s", type=positive_float, default=None,
                       help="no probe starts that would end after this many seconds: the search stops and reports "
                            "each unsettled bound's bracket so far, marked unfinished")


def search_from_args(a: argparse.Namespace, shared_ceiling: bool = False) -> SearchConfig:
    """SearchConfig from the flags given (the rest: its defaults); ValueError when they cannot work. `shared_ceiling`:
    bench/compare.py's --search-shared-ceiling was given (a ceiling above a system's own peak without
    --search-max-rate)."""
    given = {field: getattr(a, flag[2:].replace("-", "_")) for flag, field in SEARCH_FLAGS}
    cfg = SearchConfig(**{k: v for k, v in given.items() if v is not None},
                       budget_s=getattr(a, "budget_s", None))
    trace = getattr(a, "workload", None) == "trace"  # bench/compare.py: each workload's own (compare_args.py)
    cfg.check(a.num_prompts, trace=trace, window=a.num_prompts if trace else None)
    if cfg.above_peak_factor not in (None, 1.0) and cfg.max_rate is None and not shared_ceiling:
        raise ValueError(f"--search-above-peak-factor {cfg.above_peak_factor:g} lengthens the probes above the "
                         "closed-loop peak, and with the peak as the ceiling there are none: give a ceiling above it, "
                         "--search-max-rate R" + (" or --search-shared-ceiling" if hasattr(a, "search_shared_ceiling")
                                                  else " (bench/compare.py: or --search-shared-ceiling)"))
    return cfg


def check_search_flags(a: argparse.Namespace) -> None:
    """ValueError naming the flags that do not go with the choice: the search flags without --goodput-search;
    with it, the sweep's load flags (the search picks the rates), the sweep table's statistics (--percentile-metrics,
    --metric-percentiles), fixed arrivals, and a trace replayed at its timestamps (the search needs --trace-arrivals
    poisson)."""
    searched = [flag for flag, _ in SEARCH_FLAGS if getattr(a, flag[2:].replace("-", "_")) is not None]
    if getattr(a, "budget_s", None) is not None:
        searched.append("--budget-s")
    if not a.goodput_search:
        if searched:
            raise ValueError(f"{', '.join(searched)} only apply with --goodput-search")
        return
    table = [flag for flag in ("--percentile-metrics", "--metric-percentiles")
             if getattr(a, flag[2:].replace("-", "_"), None) is not None]
    if table:
        raise ValueError(f"{', '.join(table)} choose the statistics of a sweep run's table (and --save-result's); a "
                         "goodput search prints its goodput table instead: drop them")
    window = a.duration_s if a.workload != "trace" else None  # a trace's --duration-s is its window: allowed
    sweep = [flag for flag, v in (("--request-rate", a.request_rate), ("--time-scale", a.time_scale),
                                  ("--duration-s", window)) if v is not None]
    if sweep:
        raise ValueError(f"{', '.join(sweep)} set a sweep's load; --goodput-search picks the rates itself (each probe "
                         "sends --num-prompts Poisson arrivals)")
    check_search_workload(a)


def check_search_workload(a: argparse.Namespace) -> None:
    """ValueError when the workload's bench flags cannot be searched: fixed or gamma (--burstiness) arrivals, a
    trace replayed at its own timestamps, or a trace with longer probes above the peak or a probe cap (its window
    is its count)."""
    if a.arrival == "fixed":
        raise ValueError("--goodput-search measures Poisson arrivals: drop --arrival fixed")
    if getattr(a, "burstiness", None) not in (None, 1.0):
        raise ValueError("--goodput-search measures Poisson arrivals: drop --burstiness (gamma arrivals)")
    if a.workload == "trace" and a.trace_arrivals != "poisson":
        raise ValueError("--goodput-search replays a trace's lengths at Poisson arrivals: add --trace-arrivals poisson")
    probe = getattr(a, "search_trace_probe", None)
    if probe is not None and a.workload != "trace":
        raise ValueError("--search-trace-probe sets a trace's arrivals per probe; for this workload --num-prompts "
                         "does: drop --search-trace-probe")
    if a.workload == "trace" and probe is None and getattr(a, "search_above_peak_factor", None) not in (None, 1.0):
        raise ValueError("--search-above-peak-factor sends more arrivals, but each probe replays the trace's whole "
                         "window: give --search-trace-probe N (a probe's arrivals) below the window's requests "
                         "(--num-prompts), or drop the factor")
    if a.workload == "trace" and getattr(a, "search_max_probe_arrivals", None) is not None:
        raise ValueError("--search-max-probe-arrivals caps a probe's arrivals, but a trace's window is its cap: "
                         "drop the flag, and give the window with --num-prompts or --duration-s (and a probe's "
                         "arrivals with --search-trace-probe)")
