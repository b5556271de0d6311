"""Goodput as the serving papers define it, and the pure steps of searching for it (no I/O, no clock).

Definitions (goodput as DistServe and DuetServe measure it):
- TTFT rule: a request's TTFT <= max(1 s, 1 s per 1000 prompt tokens) (`ttft_limit_s`).
- ITL bound B (ms): the p95 of the request's own inter-token gaps is <= B (`p95_itl_s`); a request
  with fewer than 2 output tokens has no gap and meets any bound. B = None: no ITL bound (the
  TTFT rule alone: "unbounded").
- A request attains B when it completed, met the TTFT rule and met B (`attains`); a failed
  request never does.
- A probe is one run of Poisson arrivals at one rate. Its warm-up (the ramp rule, sustain.py: the larger of
  `discard` arrivals, a multiturn run's conversations, and those within 1.25 request lifetimes) is left out of its
  counts, and so is any later arrival released before the lifetime the probe measured; its attainment at B is
  attaining / counted requests. A probe left with too few counted arrivals (short: the server had not reached
  its steady state) is run once more with a longer warm-up, and fails every target if still short.
- A probe passes the target (B, q) when its attainment at B is >= q (`passes`).
- goodput(B, q): the highest probed rate that passes (B, q) below the lowest probed rate that
  fails it (`bracket`'s lo; a pass above a failure is noise and not counted). Tighter bounds and
  higher shares pass at fewer rates, so goodput never rises as B shrinks or q grows.
- A failure below a pass contradicts it: one of the two is a short probe's noise (on an H200, 2026-11-30, one
  48-arrival probe at 17.8 req/s failed p95-ITL 50 ms while three longer ones at 20.9-24 passed, and set the
  bracket). The search then probes the failing rate once more (`contradicted`) and pools the two probes' requests
  (`pooled`): the rate is judged on twice the requests, and the bracket is taken from the pooled probe.

The search (`next_step`, driven by rapidserve/benchmark/search.py): from a start rate, double while
the target passes (up to a max rate, the search's ceiling: by default the closed-loop peak, see
`SearchConfig.ceiling`; a ceiling above the peak is reached through the peak itself, `next_step`'s waypoint) and
halve while it fails (down to a min rate), then bisect the bracket [lo, hi) until hi <= lo x (1 +
tolerance). Every probe is cached by rate and serves every target, so one search gives goodput at
every bound and share. It runs coarse to fine: every target first to COARSE_TOLERANCE, then each to
the tolerance asked, so a search cut short by its budget still brackets every bound.

A search for some bounds only (`SearchConfig.only_bounds`, e.g. a policy run with its ITL SLO set to one
bound B, which only B's goodput is asked of) drives its probes by those bounds' targets alone and stops
once their brackets close; every probe is still scored at every bound, and the other bounds' entries say
NOT_SEARCHED (their brackets are whatever those probes happened to show, not a search's answer).

Above the peak (a ceiling above the server's own closed-loop peak: --search-max-rate, or bench/compare.py's
--search-shared-ceiling): a probe at a rate above the peak counts --search-above-peak-factor x the requests, and fails
every target where its TTFT backlog grew (sustain.py says why and how: `Probe.backlog`).

This is not `rapidserve bench --goodput`: that one reports, at each offered rate of a sweep, the
completed requests per second meeting per-request bounds (its itl is the request's largest gap).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rapidserve.benchmark.stats import RequestRecord, percentile
from rapidserve.benchmark.sustain import (
    DEFAULT_MAX_PROBE_ARRIVALS,
    Backlog,
    ProbePlan,
    Ramp,
    arrival_key,
    arrivals_of,
    backlog_trend,
    cap_problem,
    probe_arrivals,
    steady_keys,
)

DEFAULT_ITL_BOUNDS_MS: tuple[float, ...] = (25.0, 50.0, 100.0, 200.0)
DEFAULT_SHARES: tuple[float, ...] = (0.9, 0.99)
UNBOUNDED = "unbounded"
# Search outcomes per target
CONVERGED, BELOW_MIN, AT_MAX, UNFINISHED = "converged", "below_min_rate", "at_max_rate", "unfinished"
NOT_SEARCHED = "not_searched"  # a bound outside SearchConfig.only_bounds: scored, never searched
COARSE_TOLERANCE = 0.25  # the first pass over every target
# Where a search's ceiling (its max rate) came from (`SearchConfig.ceiling`)
OWN_PEAK, MAX_RATE, SHARED_PEAK, START_X8 = "own_peak", "max_rate", "shared_peak", "start_x8"
CEILING_WORDS = {OWN_PEAK: "the closed-loop peak", MAX_RATE: "--search-max-rate",
                 SHARED_PEAK: "the comparison's highest closed-loop peak so far", START_X8: "the start rate x 8"}


# ---------------------------------------------------------------- per request


def ttft_limit_s(prompt_tokens: int) -> float:
    """The TTFT rule's limit: 1 s per 1000 prompt tokens, at least 1 s."""
    return max(1.0, prompt_tokens / 1000.0)


def p95_itl_s(itl_s: Sequence[float]) -> float | None:
    """The p95 of one request's inter-token gaps (None: no gap, fewer than 2 output tokens)."""
    return percentile(itl_s, 95) if itl_s else None


def attains(r: RequestRecord, itl_bound_ms: float | None) -> bool:
    """Completed, TTFT within the rule, and (with a bound) its gaps' p95 within it."""
    if not r.success or math.isnan(r.ttft_s) or r.ttft_s > ttft_limit_s(r.prompt_tokens):
        return False
    p95 = p95_itl_s(r.itl_s)
    return itl_bound_ms is None or p95 is None or p95 * 1e3 <= itl_bound_ms


def ttft_usage(r: RequestRecord) -> float:
    """TTFT over the request's TTFT limit (<= 1: within the rule); inf for a request that failed (no first token)."""
    if not r.success or math.isnan(r.ttft_s):
        return math.inf
    return r.ttft_s / ttft_limit_s(r.prompt_tokens)


def counted(records: Iterable[RequestRecord], discard: int) -> list[RequestRecord]:
    """The records after the warm-up: arrivals (conversations) numbered `discard` and later."""
    return [r for r in records if arrival_key(r) >= discard]


def bound_key(itl_bound_ms: float | None) -> str:
    """A bound as a JSON key: '25', '100', ... or 'unbounded'."""
    return UNBOUNDED if itl_bound_ms is None else f"{itl_bound_ms:g}"


# ---------------------------------------------------------------- probes and targets


@dataclass(frozen=True)
class Target:
    itl_bound_ms: float | None  # None: the TTFT rule alone
    share: float  # q: the share of requests that must attain

    def describe(self) -> str:
        b = "no ITL bound" if self.itl_bound_ms is None else f"p95 ITL <= {self.itl_bound_ms:g} ms"
        return f"{b}, {self.share:.0%} of requests"


@dataclass(frozen=True)
class Probe:
    """One measured rate: how many requests were counted and how many attained each bound; above the server's own
    closed-loop peak, its TTFT backlog trend (None: not above it, or too few requests to judge); its warm-up and
    whether it reached steady state (sustain.Ramp; None: counted by the discard alone)."""

    rate: float
    n: int
    attained: Mapping[str, int] = field(default_factory=dict)  # bound_key -> requests
    above_peak: bool = False
    backlog: Backlog | None = None
    ramp: Ramp | None = None

    def attainment(self, itl_bound_ms: float | None) -> float:
        return self.attained.get(bound_key(itl_bound_ms), 0) / self.n if self.n else 0.0

    @property
    def backlog_grew(self) -> bool:
        return self.backlog is not None and self.backlog.grew

    @property
    def unsteady(self) -> bool:
        """Too few arrivals after its lifetime to judge (sustain.Ramp.short): it fails every target."""
        return self.ramp is not None and self.ramp.short


def measure_probe(rate: float, records: Sequence[RequestRecord], bounds_ms: Sequence[float | None],
                  discard: int, above_peak: bool = False, plan: ProbePlan | None = None) -> Probe:
    """A probe from one run's records: the counted ones, and those attaining each of `bounds_ms`; `above_peak`: also
    their TTFT backlog trend (sustain.backlog_trend, in arrival order). With the `plan` it was sent by, the counted
    ones are the ramp rule's (sustain.steady_keys), else those after the `discard` first arrivals."""
    ramp = None
    if plan is None:
        kept = counted(records, discard)
    else:
        keys, ramp = steady_keys(arrivals_of(records), plan)
        kept = [r for r in records if arrival_key(r) in keys]
    backlog = None
    if above_peak:
        backlog = backlog_trend([ttft_usage(r) for r in sorted(kept, key=lambda r: (r.scheduled_s, r.index))])
    return Probe(rate, len(kept), {bound_key(b): sum(attains(r, b) for r in kept) for b in bounds_ms},
                 above_peak, backlog, ramp)


def pooled(a: Probe, b: Probe) -> Probe:
    """Two probes of one rate as one (module docstring): their counted requests and attaining requests summed;
    above the peak, a backlog that grew only where both grew (the repeat's trend where the first's grew, else the
    first's). A short probe (`unsteady`) counted nothing at steady state: the other alone stands (the later where
    both are short)."""
    if a.unsteady or b.unsteady:
        return a if b.unsteady and not a.unsteady else b
    keys = set(a.attained) | set(b.attained)
    return Probe(a.rate, a.n + b.n, {k: a.attained.get(k, 0) + b.attained.get(k, 0) for k in keys},
                 a.above_peak or b.above_peak, b.backlog if a.backlog_grew else a.backlog, b.ramp)


def passes(p: Probe, t: Target) -> bool:
    """At least a share t.share of the counted requests attained t's bound (a probe counting none fails), the probe
    reached steady state (not `unsteady`), and (above the peak) its backlog did not grow: a load the server did not
    sustain fails every target, however many of a short probe's requests attained."""
    return (p.n > 0 and not p.backlog_grew and not p.unsteady
            and p.attained.get(bound_key(t.itl_bound_ms), 0) >= t.share * p.n - 1e-9)


def targets(bounds_ms: Sequence[float], shares: Sequence[float],
            only: Sequence[float | None] | None = None) -> list[Target]:
    """Every (bound, share), loosest first: unbounded, then the bounds from the largest down; at each
    bound the shares from the lowest up (a looser target's probes bracket the next one's). With `only`,
    the targets of those bounds alone (None in it: unbounded), in the same order."""
    out: list[Target] = []
    for b in [None, *sorted(bounds_ms, reverse=True)]:
        if only is None or b in only:
            out += [Target(b, q) for q in sorted(shares)]
    return out


# ---------------------------------------------------------------- the search's steps


class Bracket(NamedTuple):
    lo: float | None  # the highest passing rate below hi (None: none)
    hi: float | None  # the lowest failing rate (None: none failed)


def bracket(probes: Iterable[Probe], t: Target) -> Bracket:
    """Where t's frontier lies among the probes: [lo, hi)."""
    ps = list(probes)
    fails = [p.rate for p in ps if not passes(p, t)]
    hi = min(fails) if fails else None
    oks = [p.rate for p in ps if passes(p, t) and (hi is None or p.rate < hi)]
    return Bracket(max(oks) if oks else None, hi)


def contradicted(probes: Iterable[Probe], t: Target, made: Mapping[float, int]) -> float | None:
    """The rate to probe again for `t` (module docstring): its bracket's hi, the lowest rate failing t, when a higher
    probed rate passes t and hi was probed once only (`made`: probes run per rate); None otherwise. Pure."""
    ps = list(probes)
    hi = bracket(ps, t).hi
    if hi is None or made.get(hi, 0) != 1:
        return None
    return hi if any(p.rate > hi and passes(p, t) for p in ps) else None


class Ceiling(NamedTuple):
    rate: float  # the highest rate a search may probe (its max rate)
    source: str  # where it came from: OWN_PEAK, MAX_RATE, SHARED_PEAK or START_X8


class Step(NamedTuple):
    rate: float | None  # the next rate to probe; None: this target is done
    status: str  # with rate None: CONVERGED, BELOW_MIN or AT_MAX


def round_rate(x: float) -> float:
    """A probed rate to 3 significant digits (readable, and the same rate on every system)."""
    return float(f"{x:.3g}")


def next_step(b: Bracket, start: float, min_rate: float, max_rate: float, tolerance: float,
              growth: float = 2.0, waypoint: float | None = None) -> Step:
    """The next rate to probe for one target, or why its search is over.

    Nothing probed: `start`. Everything passed: lo x growth (at most max_rate; done, AT_MAX, once
    max_rate passed), and no further than `waypoint` while lo is below it; a step that lands within the tolerance
    below the waypoint or the ceiling probes that rate instead (a probe at 31.4 then one at the peak, 31.5, is one
    probe too many). Everything failed: hi / growth
    (at least min_rate; done, BELOW_MIN, once min_rate failed). Both: done (CONVERGED) when hi <= lo x
    (1 + tolerance), else the midpoint.

    The waypoint is the closed-loop peak where the ceiling lies above it: the search makes the probes it would
    make with the peak as its ceiling (short ones) before any above it (long ones), so a search cut short by its
    budget still has the answer a search capped at the peak would give."""
    lo, hi = b
    if lo is None and hi is None:
        return Step(start, "")
    if hi is None:
        assert lo is not None
        if lo >= max_rate:
            return Step(None, AT_MAX)
        up = min(round_rate(lo * growth), max_rate)
        if waypoint is not None and lo < waypoint:
            up = min(up, waypoint)
            if waypoint <= up * (1.0 + tolerance):  # within the tolerance of the waypoint: probe the waypoint itself
                up = waypoint
        if max_rate <= up * (1.0 + tolerance):  # within the tolerance of the ceiling: probe the ceiling itself
            up = max_rate
        return Step(up, "")
    if lo is None:
        return Step(None, BELOW_MIN) if hi <= min_rate else Step(max(round_rate(hi / growth), min_rate), "")
    if hi <= lo * (1.0 + tolerance):
        return Step(None, CONVERGED)
    mid = round_rate((lo + hi) / 2.0)
    return Step(mid, "") if lo < mid < hi else Step(None, CONVERGED)  # rounding closed it


def fits(now: float, deadline: float | None, rate: float, n: int, drain_s: float) -> bool:
    """Whether a probe of n Poisson arrivals at `rate` (their expected span n / rate, then the last
    probe's drain) ends before `deadline` (None: no deadline)."""
    return deadline is None or now + n / rate + drain_s <= deadline


def goodput_entry(probes: Iterable[Probe], t: Target, status: str) -> dict[str, Any]:
    """One target's result: goodput (lo, 0 when nothing passed), the bracket [lo, hi) and how its search ended."""
    lo, hi = bracket(probes, t)
    return {"itl_bound_ms": t.itl_bound_ms, "share": t.share, "goodput": lo if lo is not None else 0.0,
            "lo": lo, "hi": hi, "status": status}


# ---------------------------------------------------------------- settings


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

    def check(self, probe_requests: int | None = None) -> None:
        """ValueError naming the flag when a setting cannot work."""
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
        for name, v in (("start-rate", self.start_rate), ("min-rate", self.min_rate), ("max-rate", self.max_rate)):
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
        f = self.above_peak_factor
        if f is not None and not (f >= 1 and math.isfinite(f)):
            raise ValueError(f"--search-above-peak-factor {f:g}: give a factor >= 1 of the counted requests (1: probes "
                             "above the peak as long as the others), e.g. 4")
        if f not in (None, 1.0) and self.start_rate is not None:
            raise ValueError("--search-above-peak-factor lengthens the probes above the closed-loop peak, which "
                             "--search-start-rate skips measuring: drop one of them")
        if probe_requests is not None and self.discard >= probe_requests:
            raise ValueError(f"--search-discard {self.discard} leaves nothing of --num-prompts {probe_requests} "
                             "to count: discard fewer warm-up arrivals or send more")
        problem = cap_problem(self.max_probe_arrivals, probe_requests, self.discard, f)
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


def _bounds_text(bounds: Iterable[float | None]) -> str:
    return ",".join(bound_key(b) for b in bounds) or "(none)"
