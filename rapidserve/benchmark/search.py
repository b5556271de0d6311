"""The goodput search (`rapidserve bench --goodput-search`): the loop over any measurement. Its run against a real
server is search_run.py's.

`search_frontier(measure, scfg, start, probe_requests)` asks `next_step` (goodput.py) for the next rate of the target
whose bracket is widest (`widest_first`: log hi / lo, an end not yet found at the search's limit; ties loosest first), a
contradicted target's re-probe before any, and probes the rates it names with `measure(rate, n, why)` (the records of
one Poisson run of n arrivals: the probe's warm-up, then the arrivals it counts, `probe_requests` less the discard, or
above the closed-loop `peak` `scfg.wanted`'s longer count, whose probes are also judged by their backlog trend; at most
`scfg.max_probe_arrivals`). The warm-up is the ramp rule's (sustain.py): it covers 1.25 request lifetimes, estimated
from the probes so far (`lifetime_s`: the closed-loop run's before any); a probe left with too few counted arrivals
after the lifetime it measured is run once more with a warm-up from that lifetime (each run a probe of its own, against
--search-max-probes and the budget), and fails every target if still short or capped. Every probe is cached by rate and
scored at every bound, so each target's bracket is read from every probe so far; a failure below a pass (one of them a
short probe's noise) has its rate probed once more and the two pooled (goodput.py's `contradicted`, `pooled`). Two
passes: every target to COARSE_TOLERANCE, then every target to the tolerance asked. With `scfg.only_bounds` the targets
are those bounds' alone (it stops once their brackets close); the other bounds' entries are `not_searched`. It stops
probing after `scfg.max_probes` probes, and leaves a target whose next probe would not end before the deadline (a low
rate's probe is long; another target's may still fit); the targets not settled then are marked `unfinished`, with their
bracket so far. The ceiling (`scfg.ceiling`) is the peak unless --search-max-rate or a comparison's shared peak
(`shared_peak`: bench/compare.py --search-shared-ceiling) lies above it; then the search reaches it through the peak
(`next_step`'s waypoint). With `scfg.ttft_rate` (--search-ttft-rate R) one more probe at R after the search, unless the
search probed R itself: its expected time is kept from the search's probes after its first (a search of no probe
settles nothing), where it fits the budget at all, and from none at R (that probe serves as the TTFT one). R is the same
rate on every system of a comparison, whose TTFT the report's TTFT table reads (issue 37: TTFT p50 at 0.75 of vLLM's
peak); it is not among the goodput probes (no bracket reads it).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rapidserve.benchmark.goodput import (
    COARSE_TOLERANCE,
    NOT_SEARCHED,
    UNFINISHED,
    Ceiling,
    Probe,
    Step,
    Target,
    bracket,
    contradicted,
    fits,
    goodput_entry,
    measure_probe,
    next_step,
    passes,
    pooled,
    round_rate,
    targets,
    widest_first,
)
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.benchmark.stats import RequestRecord
from rapidserve.benchmark.sustain import (
    RERUN,
    ProbePlan,
    lifetime_estimate,
    plan_probe,
    rerun_plan,
    short_next,
    with_then,
)

# (rate, arrivals, why) -> the run's records; why: "" (a new rate), AGAIN (a failure below a pass, probed once more)
# or RERUN (a short probe's second run, with a longer warm-up)
Measure = Callable[[float, int, str], Awaitable[Sequence[RequestRecord]]]
AGAIN = "again"
TTFT = "ttft"  # the probe at --search-ttft-rate, after the search: its TTFT is the report's, not a goodput probe


@dataclass
class Outcome:
    """A search's probes (in the order they ran), each target's goodput entry, and why probing stopped
    before every target was settled (None: every one was); where its max rate came from (`ceiling.source`) and each
    probe's arrivals (by rate)."""

    start: float
    min_rate: float
    max_rate: float
    probes: list[Probe]
    goodput: list[dict[str, Any]]
    stopped: str | None
    ceiling: Ceiling | None = None
    arrivals: dict[float, int] | None = None


async def search_frontier(measure: Measure, scfg: SearchConfig, start: float, probe_requests: int,
                          clock: Callable[[], float] = time.monotonic, deadline: float | None = None,
                          on_probe: Callable[[Probe], None] | None = None, peak: float | None = None,
                          shared_peak: float | None = None, lifetime_s: float | None = None,
                          cap: int | None = None) -> Outcome:
    """Search every target's goodput from `start` (requests/s), within `scfg.limits(start, peak, shared_peak)`; see
    the module docstring. `on_probe` is told each probe's scores as it ends (a short one: with what follows it,
    `Ramp.then`). `lifetime_s`: the closed-loop run's median E2E (the lifetime estimate before any probe); `cap`:
    the most arrivals a probe may send (default scfg.max_probe_arrivals; a trace: its window's)."""
    lo_rate, hi_rate = scfg.limits(start, peak, shared_peak)
    cap = scfg.max_probe_arrivals if cap is None else cap
    waypoint = scfg.waypoint(hi_rate, peak)
    arrivals: dict[float, int] = {}
    bounds = scfg.bounds()
    probes: dict[float, Probe] = {}  # by rate; a rate probed twice: the two pooled
    made: dict[float, int] = {}  # probes run per rate
    order: list[Probe] = []
    exhausted: str | None = None  # the probes are spent: nothing more is measured
    too_long: str | None = None  # a target's next probe would end after the deadline (a shorter one may still fit)
    drain = 0.0
    lifetimes: dict[float, float] = {}  # the lifetime each rate's latest probe measured (sustain.lifetime_estimate)

    async def run(plan: ProbePlan, why: str) -> tuple[Probe, Sequence[RequestRecord]]:
        nonlocal drain
        t0 = clock()
        records = await measure(plan.rate, plan.sent, why)
        drain = max(0.0, clock() - t0 - plan.sent / plan.rate)
        probe = measure_probe(plan.rate, records, bounds, scfg.discard, scfg.above_peak(plan.rate, peak), plan)
        made[plan.rate] = made.get(plan.rate, 0) + 1
        arrivals[plan.rate] = plan.sent
        if probe.ramp is not None and probe.ramp.lifetime_s is not None:
            lifetimes[plan.rate] = probe.ramp.lifetime_s
        return probe, records

    def told(probe: Probe) -> None:
        order.append(probe)
        if on_probe is not None:
            on_probe(probe)

    # coarse to fine: a bracket round every target before any is refined; from earlier brackets (`hints`), where the
    # brackets are already known, fine at once
    tolerances = [scfg.tolerance] if scfg.hints and all(scfg.hint(t) for t in scfg.searched()) else \
        sorted({max(scfg.tolerance, COARSE_TOLERANCE), scfg.tolerance}, reverse=True)
    ttft = round_rate(scfg.ttft_rate) if scfg.ttft_rate is not None else None

    def plan_at(rate: float) -> tuple[ProbePlan, float]:
        """A probe at `rate` as planned now, and its tail: after its last arrival a probe drains for about one
        lifetime."""
        life = lifetime_estimate(rate, lifetimes, lifetime_s)
        plan = plan_probe(rate, scfg.wanted(rate, probe_requests, peak), scfg.discard, life, cap,
                          above_peak=scfg.above_peak(rate, peak))
        return plan, max(drain, life or 0.0)

    def ttft_plan() -> tuple[ProbePlan, float] | None:
        """The TTFT probe still to run (none once the search probed its rate) and its expected seconds."""
        if ttft is None or ttft in probes:
            return None
        plan, tail = plan_at(ttft)
        return plan, plan.sent / ttft + tail

    def kept_s(rate: float) -> float:
        """The seconds kept before the budget's end from a search probe at `rate` for the TTFT probe (a comparison's
        TTFT table needs that probe on every system; 2 x H200, 2026-11-30: it was the one cut on the systems whose
        searches ran long): its expected time, while it is still to run and fits at all; none for a probe at its rate
        (that probe, or its re-run, serves as the TTFT probe), nor before the search has measured any rate (its
        first probe, re-run included, is never given up for the TTFT probe: a search of no probe settles nothing)."""
        pending = ttft_plan()
        if deadline is None or pending is None or not probes or rate == ttft or clock() + pending[1] > deadline:
            return 0.0
        return pending[1]

    def search_deadline(rate: float) -> float | None:
        """The deadline of a search probe at `rate`: the budget's end less `kept_s`."""
        return None if deadline is None else deadline - kept_s(rate)

    def next_probe(tolerance: float, skipped: set[Target]) -> tuple[Target, Step, bool] | None:
        """The next (target, step, whether it re-probes a contradiction): a contradicted target's first, else the
        widest bracket's (`widest_first`); None when every target not `skipped` is settled at this tolerance."""
        live = [t for t in scfg.searched() if t not in skipped]
        for t in live:
            again = contradicted(probes.values(), t, made)  # a failure below a pass: probed once more, pooled
            if again is not None:
                return t, Step(again, ""), True
        brackets = {t: bracket(probes.values(), t) for t in live}
        for t in widest_first(list(brackets.items()), lo_rate, hi_rate):
            step = next_step(brackets[t], start, lo_rate, hi_rate, tolerance, waypoint=waypoint, hint=scfg.hint(t))
            if step.rate is not None:
                return t, step, False
        return None

    for tolerance in tolerances:
        skipped: set[Target] = set()  # targets whose next probe would end after the deadline
        while exhausted is None:
            nxt = next_probe(tolerance, skipped)
            if nxt is None:
                break
            t, step, again = nxt
            assert step.rate is not None
            if len(order) >= scfg.max_probes:
                exhausted = f"{scfg.max_probes} probes made (--search-max-probes)"
                break
            plan, tail = plan_at(step.rate)
            if not fits(clock(), search_deadline(step.rate), step.rate, plan.sent, tail):
                est, kept = plan.sent / step.rate + tail, kept_s(step.rate)
                too_long = f"the time budget: a probe at {step.rate:g} req/s (~{est:.0f} s) would end after it" + (
                    f", less the ~{kept:.0f} s kept for the --search-ttft-rate probe at {ttft:g} req/s" if kept else "")
                skipped.add(t)  # another target's (shorter) probe may still fit
                continue
            probe, records = await run(plan, AGAIN if again else "")
            if probe.ramp is not None and probe.ramp.short:
                redo = rerun_plan(probe.ramp, scfg.discard)
                ramp_too = measure_probe(step.rate, records, bounds, plan.warmup)  # time aside: a lighter load
                then = short_next(probe.ramp, redo, any(passes(ramp_too, x) for x in scfg.searched()),
                                  scfg.max_probes - len(order) - 1,
                                  fits(clock(), search_deadline(step.rate), step.rate, redo.sent,
                                       max(drain, probe.ramp.lifetime_s or 0.0)))
                probe = replace(probe, ramp=with_then(probe.ramp, then))
                if then == RERUN:
                    told(probe)
                    probe, _ = await run(redo, RERUN)
            told(probe)
            probes[step.rate] = pooled(probes[step.rate], probe) if step.rate in probes else probe
    pending = ttft_plan()  # the TTFT table's probe
    if pending is not None and (deadline is None or clock() + pending[1] <= deadline):
        probe, _ = await run(pending[0], TTFT)
        told(probe)
    entries = []
    searched = scfg.searched()
    for t in targets(scfg.itl_bounds_ms, scfg.shares):
        step = next_step(bracket(probes.values(), t), start, lo_rate, hi_rate, scfg.tolerance, waypoint=waypoint,
                         hint=scfg.hint(t))
        status = NOT_SEARCHED if t not in searched else step.status if step.rate is None else UNFINISHED
        entries.append(goodput_entry(probes.values(), t, status))
    unsettled = any(e["status"] == UNFINISHED for e in entries)
    return Outcome(start, lo_rate, hi_rate, order, entries, (exhausted or too_long) if unsettled else None,
                   scfg.ceiling(start, peak, shared_peak), arrivals)
