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
  higher shares pass at fewer rates, so goodput never rises as B shrinks or q grows. Where a pass above the
  failure survives its re-probe (below), the attainment is not monotone in rate, and the entry says so
  (`passes_above`: the highest passing rate above the bracket, the goodput by "the highest rate that passes"
  alone): on an H200, 2026-12-01, vLLM on Qwen3-30B-A3B at p95-ITL 100 ms passed 10.1 req/s in two searches and
  failed 7.57 in two probes, so its bracket [6.94, 7.57) hid a goodput of at least 10.1 by the papers' reading.
- A failure below a pass contradicts it: one of the two is a short probe's noise (on an H200, 2026-11-30, one
  48-arrival probe at 17.8 req/s failed p95-ITL 50 ms while three longer ones at 20.9-24 passed, and set the
  bracket). The search then probes the failing rate once more (`contradicted`) and pools the two probes' requests
  (`pooled`): the rate is judged on twice the requests, and the bracket is taken from the pooled probe.

The search (`next_step`, driven by rapidserve/benchmark/search.py): from a start rate, double while
the target passes (up to a max rate, the search's ceiling: by default the closed-loop peak, see
`SearchConfig.ceiling`; a ceiling above the peak is reached through the peak itself, `next_step`'s waypoint) and
halve while it fails (down to a min rate), then bisect the bracket [lo, hi) until hi <= lo x (1 +
tolerance). Every probe is cached by rate and serves every target, so one search gives goodput at
every bound and share. It runs coarse to fine: every target first to COARSE_TOLERANCE, then every one to
the tolerance asked, each probe going to the target whose bracket is widest (`widest_first`), so a search cut
short by its probes or its budget still brackets every bound, about as closely.

A search for some bounds only (`SearchConfig.only_bounds`, e.g. a policy run with its ITL SLO set to one
bound B, which only B's goodput is asked of) drives its probes by those bounds' targets alone and stops
once their brackets close; every probe is still scored at every bound, and the other bounds' entries say
NOT_SEARCHED (their brackets are whatever those probes happened to show, not a search's answer).

Above the peak (a ceiling above the server's own closed-loop peak: --search-max-rate, or bench/compare.py's
--search-shared-ceiling): a probe at a rate above the peak counts --search-above-peak-factor x the requests, and fails
every target where its TTFT backlog grew (sustain.py says why, backlog.py how: `Probe.backlog`).

The search's settings, their checks and the rules read off them (ceiling, limits, probes above the peak):
`SearchConfig`, rapidserve/benchmark/search_config.py.

This is not `rapidserve bench --goodput`: that one reports, at each offered rate of a sweep, the
completed requests per second meeting per-request bounds (its itl is the request's largest gap).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from rapidserve.benchmark.backlog import Backlog, backlog_trend
from rapidserve.benchmark.stats import RequestRecord, percentile
from rapidserve.benchmark.sustain import (
    ProbePlan,
    Ramp,
    arrival_key,
    arrivals_of,
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
    their TTFT backlog trend (backlog.backlog_trend, in arrival order). With the `plan` it was sent by, the counted
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


def misses_allowed(share: float, counted: int) -> int:
    """How many of a probe's `counted` requests may miss a target at `share` and the probe still pass (`passes`)."""
    return max(0, counted - math.ceil(share * counted - 1e-9))


def share_note(share: float, counted: Sequence[int]) -> str | None:
    """A caveat for a share too strict for the probes' counts (`counted`: each probe's counted requests), or None:
    where even the largest probe allows no miss, one request over the bound or the TTFT rule fails the probe, so
    the share reads "every request" and rests on the slowest one (e.g. 99% of 32)."""
    real = [n for n in counted if n > 0]
    if not real or share >= 1 or max(misses_allowed(share, n) for n in real) > 0:
        return None
    need = math.ceil(1 / (1 - share) - 1e-9)
    span = f"{min(real)}" if min(real) == max(real) else f"{min(real)}-{max(real)}"
    return (f"with {span} requests counted a probe, {share:.0%} allows no miss: one request over the bound or the "
            f"TTFT rule fails the probe (a probe counting >= {need} would allow one)")


def targets(bounds_ms: Sequence[float], shares: Sequence[float],
            only: Sequence[float | None] | None = None) -> list[Target]:
    """Every (bound, share), loosest first: unbounded, then the bounds from the largest down; at each
    bound the shares from the lowest up (the order a search breaks ties of bracket width in: `widest_first`). With
    `only`, the targets of those bounds alone (None in it: unbounded), in the same order."""
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


def bracket_width(b: Bracket, min_rate: float, max_rate: float) -> float:
    """How far a target is from settled: log(hi / lo), an end not yet found taken at the search's limit (no pass:
    `min_rate`; no failure: `max_rate`). A bracket of [0, 8.49) is as wide as the search's whole range below 8.49,
    which is what a report's ratio range then spans. Pure."""
    lo = b.lo if b.lo is not None else min_rate
    hi = b.hi if b.hi is not None else max_rate
    return math.log(hi / lo) if 0 < lo < hi else 0.0


def widest_first(brackets: Sequence[tuple[Target, Bracket]], min_rate: float, max_rate: float) -> list[Target]:
    """The targets in the order a search refines them: the widest bracket first (`bracket_width`), ties in the given
    order (loosest first). A search cut short by its probes or its budget so leaves its brackets about equally wide,
    rather than the loosest target settled and a tight one still [0, x) (2 x H200, 2026-11-30: vLLM's 50-ms
    bracket on 4096:64 stayed [0, 8.49) while all seven probes went to its unbounded one). Pure."""
    order = sorted(range(len(brackets)), key=lambda i: (-bracket_width(brackets[i][1], min_rate, max_rate), i))
    return [brackets[i][0] for i in order]


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
              growth: float = 2.0, waypoint: float | None = None,
              hint: tuple[float | None, float | None] | None = None) -> Step:
    """The next rate to probe for one target, or why its search is over.

    Nothing probed: `start`. Everything passed: lo x growth (at most max_rate; done, AT_MAX, once
    max_rate passed), and no further than `waypoint` while lo is below it; a step that lands within the tolerance
    below the waypoint or the ceiling probes that rate instead (a probe at 31.4 then one at the peak, 31.5, is one
    probe too many). Everything failed: hi / growth
    (at least min_rate; done, BELOW_MIN, once min_rate failed). Both: done (CONVERGED) when hi <= lo x
    (1 + tolerance), else the midpoint.

    The waypoint is the closed-loop peak where the ceiling lies above it: the search makes the probes it would
    make with the peak as its ceiling (short ones) before any above it (long ones), so a search cut short by its
    budget still has the answer a search capped at the peak would give.

    `hint` (lo, hi): where an earlier search of this target put its frontier (`--search-start-from`; either end None:
    not known). The first probe is at its lo (else its hi / growth), within [min_rate, max_rate]; while everything
    passed, the next is its hi where that lies above the highest pass (instead of lo x growth); while everything
    failed, its lo where that lies below the lowest failure (instead of hi / growth); between a pass and a failure,
    an earlier end that lies inside (beyond the tolerance of both) before the midpoint. So two probes re-establish a
    bracket the earlier search took several to find (the probes are shared: a target after the first starts from
    theirs), and bisection goes on from there. Where the hint is wrong, the search
    moves on as without it."""
    lo, hi = b
    hint_lo, hint_hi = hint if hint is not None else (None, None)
    if lo is None and hi is None:
        first = hint_lo if hint_lo is not None else round_rate(hint_hi / growth) if hint_hi is not None else None
        return Step(start if first is None else min(max(first, min_rate), max_rate), "")
    if hi is None:
        assert lo is not None
        if lo >= max_rate:
            return Step(None, AT_MAX)
        up = min(hint_hi if hint_hi is not None and hint_hi > lo else round_rate(lo * growth), max_rate)
        if waypoint is not None and lo < waypoint:
            up = min(up, waypoint)
            if waypoint <= up * (1.0 + tolerance):  # within the tolerance of the waypoint: probe the waypoint itself
                up = waypoint
        if max_rate <= up * (1.0 + tolerance):  # within the tolerance of the ceiling: probe the ceiling itself
            up = max_rate
        return Step(up, "")
    if lo is None:
        if hi <= min_rate:
            return Step(None, BELOW_MIN)
        down = hint_lo if hint_lo is not None and hint_lo < hi else round_rate(hi / growth)
        return Step(max(down, min_rate), "")
    if hi <= lo * (1.0 + tolerance):
        return Step(None, CONVERGED)
    inside = [x for x in (hint_hi, hint_lo) if x is not None and lo * (1.0 + tolerance) < x < hi / (1.0 + tolerance)]
    if inside:  # an earlier end within the bracket (the upper first): it splits the bracket where the frontier was
        return Step(inside[0], "")
    mid = round_rate((lo + hi) / 2.0)
    return Step(mid, "") if lo < mid < hi else Step(None, CONVERGED)  # rounding closed it


def fits(now: float, deadline: float | None, rate: float, n: int, drain_s: float) -> bool:
    """Whether a probe of n Poisson arrivals at `rate` (their expected span n / rate, then the last
    probe's drain) ends before `deadline` (None: no deadline)."""
    return deadline is None or now + n / rate + drain_s <= deadline


def passes_above(probes: Iterable[Probe], t: Target) -> float | None:
    """The highest probed rate above t's bracket (above its lowest failing rate) that passes t, or None: where the
    attainment was not monotone in rate (module docstring). Pure."""
    ps = list(probes)
    hi = bracket(ps, t).hi
    above = [p.rate for p in ps if hi is not None and p.rate > hi and passes(p, t)]
    return max(above) if above else None


def fails_above(probes: Iterable[Probe], t: Target) -> float | None:
    """Where t passed above its bracket (`passes_above`): the lowest probed rate above that pass that fails t (None:
    none probed), so that the highest passing rate, the goodput by "the highest rate that passes" alone, lies in
    [passes_above, fails_above). None where nothing passed above the bracket. Pure."""
    ps = list(probes)
    top = passes_above(ps, t)
    fails = [p.rate for p in ps if top is not None and p.rate > top and not passes(p, t)]
    return min(fails) if fails else None


def goodput_entry(probes: Iterable[Probe], t: Target, status: str) -> dict[str, Any]:
    """One target's result: goodput (lo, 0 when nothing passed), the bracket [lo, hi), how its search ended, and
    `passes_above` / `fails_above` (a passing rate above the bracket and the failure above it, or None: where the
    attainment was not monotone in rate; the ratios read [passes_above, fails_above), compare_repeats.entry_bounds)."""
    ps = list(probes)
    lo, hi = bracket(ps, t)
    return {"itl_bound_ms": t.itl_bound_ms, "share": t.share, "goodput": lo if lo is not None else 0.0,
            "lo": lo, "hi": hi, "status": status, "passes_above": passes_above(ps, t),
            "fails_above": fails_above(ps, t)}
