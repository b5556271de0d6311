"""The goodput search's settings (the flags of `rapidserve bench --goodput-search`: search_flags.py): what each
means, their checks (every error names its flag), and the rules read off them: the search's ceiling and limits,
which probes lie above the closed-loop peak and how many arrivals they send. The search itself: goodput.py (pure)
and search.py (its probes)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from rapidserve.benchmark.goodput import (
    DEFAULT_ITL_BOUNDS_MS,
    DEFAULT_SHARES,
    MAX_RATE,
    OWN_PEAK,
    SHARED_PEAK,
    START_X8,
    Ceiling,
    Target,
    bound_key,
    round_rate,
    targets,
)
from rapidserve.benchmark.sustain import DEFAULT_MAX_PROBE_ARRIVALS, cap_problem, probe_arrivals


@dataclass(frozen=True)
class SearchConfig:
    """How the rate is searched (the flags of `rapidserve bench --goodput-search`)."""

    itl_bounds_ms: tuple[float, ...] = DEFAULT_ITL_BOUNDS_MS
    shares: tuple[float, ...] = DEFAULT_SHARES
    start_rate: float | None = None  # None: start_fraction x the closed-loop peak, measured first
    start_fraction: float = 0.5
    min_rate: float | None = None  # None: start / 4
    max_rate: float | None = None  # None: the closed-loop peak (with a given start rate: start x 8)
    tolerance: float = 0.05  # stop when hi <= lo x (1 + tolerance)
    max_probes: int = 12  # Poisson probes per search (the closed-loop peak not counted)
    discard: int = 16  # warm-up arrivals of each probe left out of its counts
    budget_s: float | None = None  # the search stops (unfinished) rather than start a probe that would end later
    # the bounds whose brackets the search closes (None in it: unbounded); None: every bound. The others are
    # scored at each probe all the same, and reported NOT_SEARCHED.
    only_bounds: tuple[float | None, ...] | None = None
    # probes above the server's own closed-loop peak count this many times the requests of the others (their warm-up
    # the ramp rule's, as any probe's); None: 1, as long as the others (sustain.py says why longer)
    above_peak_factor: float | None = None
    # no probe sends more arrivals (warm-up and counted): one that needs more to reach steady state fails (sustain.py)
    max_probe_arrivals: int = DEFAULT_MAX_PROBE_ARRIVALS
    # after the search, one probe at this rate (unless it probed it): TTFT at one rate for every system (search.py)
    ttft_rate: float | None = None
    # a trace's arrivals per probe, its first requests (None: the whole window, as before 2026-11-30); the window
    # (the trace's --num-prompts / --duration-s) is then the cap from which warm-ups and probes above the peak draw
    trace_probe: int | None = None
    # where an earlier search of the same system and workload put each target's frontier: (bound, share, lo, hi),
    # either end None where not known (bench/compare.py --search-start-from); goodput.next_step says how it is used
    # (None: no earlier search, and a report's settings match one from before this field)
    hints: tuple[tuple[float | None, float, float | None, float | None], ...] | None = None

    def hint(self, t: Target) -> tuple[float | None, float | None] | None:
        """The earlier (lo, hi) of target `t`, None where there is none."""
        return next(((lo, hi) for b, q, lo, hi in self.hints or () if b == t.itl_bound_ms and q == t.share), None)

    def check(self, probe_requests: int | None = None, trace: bool = False, window: int | None = None) -> None:
        """ValueError naming the flag when a setting cannot work. `probe_requests`: a probe's arrivals (--num-prompts;
        None: not known yet). `trace`: a trace workload, whose probes are `trace_probe` arrivals (else
        `probe_requests`: its whole window) and whose cap is its window (`window`: its requests, at most; None: not
        known yet; `trace_window_problem`), not --search-max-probe-arrivals."""
        if not self.shares or any(not 0 < q <= 1 for q in self.shares):
            raise ValueError(f"--search-shares {self.shares}: each share must be in (0, 1], e.g. 0.9,0.99")
        if any(not (b > 0 and math.isfinite(b)) for b in self.itl_bounds_ms):
            raise ValueError(f"--search-itl-bounds-ms {self.itl_bounds_ms}: bounds are positive milliseconds")
        if not 0 < self.tolerance < 1:
            raise ValueError(f"--search-tolerance {self.tolerance}: give a fraction in (0, 1), e.g. 0.05")
        if not 0 < self.start_fraction <= 4:
            raise ValueError(f"--search-start-fraction {self.start_fraction}: give a fraction of the peak in (0, 4]")
        if self.max_probes < 1:
            raise ValueError("--search-max-probes must be >= 1")
        for name, v in (("start-rate", self.start_rate), ("min-rate", self.min_rate), ("max-rate", self.max_rate),
                        ("ttft-rate", self.ttft_rate)):
            if v is not None and not (v > 0 and math.isfinite(v)):
                raise ValueError(f"--search-{name} {v}: give a positive finite rate (requests/s)")
        lo, hi = self.min_rate or 0.0, self.max_rate or math.inf
        if lo > hi or (self.start_rate is not None and not lo <= self.start_rate <= hi):
            raise ValueError(f"--search-min-rate {self.min_rate} <= --search-start-rate {self.start_rate} <= "
                             f"--search-max-rate {self.max_rate} must hold")
        if self.only_bounds is not None:
            known = self.bounds()
            bad = [b for b in self.only_bounds if b not in known]
            if not self.only_bounds or bad:
                raise ValueError(f"--search-only-bounds {_bounds_text(self.only_bounds)}: give one or more of the "
                                 f"bounds searched ({_bounds_text(known)}; add a bound to --search-itl-bounds-ms)")
        for b, q, lo, hi in self.hints or ():
            if (lo is not None and not (lo > 0 and math.isfinite(lo))) or (hi is not None and not (
                    hi > 0 and math.isfinite(hi))) or (lo is not None and hi is not None and lo >= hi):
                raise ValueError(f"--search-start-from: the earlier bracket [{lo}, {hi}) at {bound_key(b)}, share "
                                 f"{q:g} is no bracket (each end a positive rate, lo below hi)")
        f = self.above_peak_factor
        if f is not None and not (f >= 1 and math.isfinite(f)):
            raise ValueError(f"--search-above-peak-factor {f:g}: give a factor >= 1 of the counted requests (1: probes "
                             "above the peak as long as the others), e.g. 4")
        if f not in (None, 1.0) and self.start_rate is not None:
            raise ValueError("--search-above-peak-factor lengthens the probes above the closed-loop peak, which "
                             "--search-start-rate skips measuring: drop one of them")
        if self.trace_probe is not None and self.trace_probe < 1:
            raise ValueError(f"--search-trace-probe {self.trace_probe}: give a positive number of arrivals")
        n, flag = ((self.trace_probe, "--search-trace-probe") if trace and self.trace_probe is not None
                   else (probe_requests, "--num-prompts"))
        if n is not None and self.discard >= n:
            raise ValueError(f"--search-discard {self.discard} leaves nothing of {flag} {n} "
                             "to count: discard fewer warm-up arrivals or send more")
        if trace:
            if n is not None and window is not None:
                trace_window_problem(n, window, self)
            return
        problem = cap_problem(self.max_probe_arrivals, n, self.discard, f)
        if problem is not None:
            raise ValueError(problem)

    def ceiling(self, start: float, peak: float | None = None, shared_peak: float | None = None) -> Ceiling:
        """The highest rate a search from `start` may probe, and where it came from: --search-max-rate if given
        (MAX_RATE); else the closed-loop `peak` (OWN_PEAK), or `shared_peak` where that is higher (SHARED_PEAK:
        bench/compare.py's --search-shared-ceiling, the highest closed-loop peak among the comparison's systems so
        far); without a peak, start x 8 (START_X8); never below `start`.

        By default nothing is probed past the server's own peak: a probe is a finite run, and above the rate the
        server sustains its queue grows for only `n` arrivals and may not yet break the TTFT rule, so a pass there
        says nothing the server can keep up (AT_MAX: ">= peak"). A ceiling above it is asked for (a server with an ITL
        SLO sustains more under Poisson arrivals than in the closed-loop burst); its probes above the peak are
        longer (`arrivals`) and fail where their backlog grew (`passes`, sustain.py)."""
        if self.max_rate is not None:
            hi, source = self.max_rate, MAX_RATE
        elif peak is None:
            hi, source = round_rate(start * 8.0), START_X8
        elif shared_peak is not None and round_rate(shared_peak) > round_rate(peak):
            hi, source = round_rate(shared_peak), SHARED_PEAK
        else:
            hi, source = round_rate(peak), OWN_PEAK
        return Ceiling(max(hi, start), source)

    def limits(self, start: float, peak: float | None = None, shared_peak: float | None = None) -> tuple[float, float]:
        """(min rate, max rate) for a search from `start`: the given min rate, else start / 4; the `ceiling`."""
        lo = self.min_rate if self.min_rate is not None else round_rate(start / 4.0)
        return min(lo, start), self.ceiling(start, peak, shared_peak).rate

    def waypoint(self, max_rate: float, peak: float | None) -> float | None:
        """The closed-loop peak (rounded) where the ceiling `max_rate` lies above it (`next_step`'s waypoint), else
        None."""
        return round_rate(peak) if peak is not None and max_rate > round_rate(peak) else None

    @staticmethod
    def above_peak(rate: float, peak: float | None) -> bool:
        """Whether `rate` lies above the closed-loop peak (rounded, as a ceiling at the peak would probe it)."""
        return peak is not None and rate > round_rate(peak)

    def arrivals(self, rate: float, n: int, peak: float | None) -> int:
        """A probe's arrivals at `rate` before the ramp rule: n, or above the peak the discard then above_peak_factor
        x the n - discard counted (sustain.probe_arrivals)."""
        return probe_arrivals(n, self.discard, self.above_peak_factor) if self.above_peak(rate, peak) else n

    def wanted(self, rate: float, n: int, peak: float | None) -> int:
        """The arrivals a probe at `rate` means to count: n - discard, or above the peak above_peak_factor x that."""
        return self.arrivals(rate, n, peak) - self.discard

    def bounds(self) -> list[float | None]:
        """Every bound a probe is scored at: None (unbounded) and the ITL bounds."""
        return [None, *self.itl_bounds_ms]

    def searched(self) -> list[Target]:
        """The targets the search drives its probes by: those of `only_bounds`, else every one (`targets`)."""
        return targets(self.itl_bounds_ms, self.shares, self.only_bounds)


def trace_window_problem(n: int, window: int, scfg: SearchConfig) -> None:
    """ValueError where a trace's window cannot hold a probe of n arrivals (above the peak: its longer probe)."""
    need = probe_arrivals(n, scfg.discard, scfg.above_peak_factor)
    if need > window:
        what = (f"--search-trace-probe {n}" if scfg.trace_probe is not None else f"the window's {n}") + (
            f" with --search-above-peak-factor {scfg.above_peak_factor:g}" if need > n else "")
        raise ValueError(f"a probe of {what} needs {need} arrivals, and the trace window holds {window}: give the "
                         "trace a larger window (--num-prompts or --duration-s), or a smaller --search-trace-probe")


def _bounds_text(bounds: Iterable[float | None]) -> str:
    return ",".join(bound_key(b) for b in bounds) or "(none)"
