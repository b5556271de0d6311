"""Probes judged at a load the server sustains: every probe's warm-up (the ramp rule), and above a server's own
closed-loop peak how long probes are and whether the load they offered was sustained (the backlog rule: backlog.py)
(pure, no I/O; goodput.py applies them, search.py runs them).

The ramp rule. A Poisson probe at rate r starts from an empty server. By Little's law the requests in flight are
r x W at steady state, W being a request's lifetime (its end-to-end latency, a multiturn conversation's from its
first release to its last turn's end); before that they ramp up: at time t < W only the arrivals since 0 are in
flight, about r x t. A request released during the ramp sees a lighter server over its life (a smaller decode batch,
so shorter inter-token gaps, and more room for prefill) than one released after it, and is judged on a load the
server was never under. Where W is long against the probe (decode-heavy work: on an H200, 2026-11-30, 1024:256 had
W of 5-8 s while a 144-arrival probe at 31-40 req/s lasted ~4 s, so at most ~144 were ever in flight where steady
state holds 250-320), every counted request is a ramp request and a server "passes" at 2-3x what it sustains. So:

1. Plan (`plan_probe`): a probe's warm-up is the larger of `discard` arrivals and those expected within its first
   ramp_s = RAMP_MARGIN x W_est seconds (r x ramp_s, rounded up); it sends the warm-up then the arrivals it counts
   (n - discard, or above the peak `factor` x that), at most `cap` arrivals (--search-max-probe-arrivals; a probe
   the cap cuts keeps the arrivals it counts and shortens its warm-up, and the check below decides).
   W_est (`lifetime_estimate`): the lifetime measured by the probe at the highest rate <= r already run, else the
   closed-loop run's median E2E (every request at once: a queue of the whole probe, an overestimate below the
   peak, which only lengthens the warm-up), else none (the discard alone; the check below then corrects it).
   W grows with the rate (a bigger batch, slower steps), so an estimate from a lower rate is low; the margin
   covers that and the spread of Poisson arrival times (the warm-up's last arrival comes about ramp_s s in, give
   or take sqrt(r x ramp_s) / r).
2. Check (`steady_keys`): after the probe its own lifetime W (`realized_lifetime`: the median over its arrivals
   that completed) is known; counted are the arrivals after the warm-up released at or after W. Where the
   estimate was low, the arrivals before W are left out (`cut`). A probe left with fewer than `steady_minimum`
   (half what it meant to count, at least MIN_TREND_REQUESTS) is short: it cannot pass.
3. A short probe (`short_next`) is run once more, its warm-up from the lifetime its most loaded requests showed
   (`rerun_plan`: the upper quartile of its arrivals' lifetimes, at least W; x RAMP_MARGIN, never fewer arrivals
   than its first), up to the cap; a re-run still short fails every target (SHORT), and a probe that needed
   more than the cap (`ProbePlan.capped`) and came out short fails as CAPPED: steady state is out of reach within
   the cap. A short probe is not re-run, and fails, where a re-run could not change that: where even its ramp
   requests (all after its warm-up, time aside), which saw a lighter server than steady state would give them, fail
   every target searched (for a server whose latency does not fall as its load grows), or where the cap allows no
   longer probe (a trace's window); nor where the probes or the time budget are spent. Each run is a probe of its
   own in the search's count and report, and a short one is never pooled with another run (`goodput.pooled`).

Why the upper quartile for a re-run: a probe comes out short when its lifetime was underestimated, i.e. when W was
still growing with the load during the probe (on an H200, 2026-11-30, 1024:256 at 31.2 req/s: W 4.6 s in a first
run planned from 3.5 s, then 7.2 s in a re-run planned from 4.6 s, short again). Its median mixes the ramp's
requests with the most loaded ones; the upper quartile is the lifetime of the latter, the better estimate of the
steady state's. Where W is stationary the quartile lies close to the median (fixed output lengths), so a re-run
is only slightly longer.

Why the median lifetime, and only the start: the ramp is over for a request released once the requests before it
have lived a full lifetime; with fixed output lengths the lifetimes lie close to their median (the planning margin
covers a spread, the check uses the median itself, the lifetime the probe showed). At the probe's end the load
drains the same way, but a request released then meets the steady load at its release (its TTFT) and through its
first gaps, the largest it sees as the batch shrinks: its p95 gap is set by those, so the end of a probe biases
what is judged far less than its start, and is not cut.

Above the peak. By default a goodput search's ceiling is the server's closed-loop peak (every prompt of a probe sent
at once), because a finite probe above the rate a server sustains only grows its queue for that probe's arrivals and
may still pass the generous TTFT rule. For a server with an ITL SLO the closed-loop peak is lower than what it
sustains under Poisson arrivals (in the burst its decode batch is full, so its SLO leaves less room for prefill), so
its cells read `>= own peak`, floors that do not compare across systems. A search may go on above the peak (up to
--search-max-rate, or bench/compare.py's --search-shared-ceiling), and there two rules keep it honest:

1. Longer probes (`probe_arrivals`): a probe above the peak counts `factor` x the requests of one at or below it
   (--search-above-peak-factor; its warm-up the ramp rule's, as every probe's), because overload shows through the
   TTFT rule only once the queue has grown for long enough (backlog.py's resolution). A probe above the peak that
   the cap cut (--search-max-probe-arrivals, or a trace's window) and that counted fewer than it meant to (its
   shortened warm-up left arrivals before its lifetime) fails as CAPPED, even with the check's minimum counted: its
   counted span is shorter than planned, and the overload the backlog rule misses grows as that span shrinks. One
   whose cut warm-up still left every arrival it meant to count (none before its lifetime) spans what was planned,
   and is judged as any.
2. The backlog rule (backlog.py, `backlog_trend`), applied to every probe above the peak: the probe fails every
   target when the TTFT of its counted requests trends up so fast that, kept up for one more probe of the same
   length, it would put the typical request over its TTFT limit. Its counted requests come after the ramp (the ramp
   rule), so the TTFT that rises while the server fills up is not read as a backlog.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from rapidserve.benchmark.backlog import MIN_TREND_REQUESTS
from rapidserve.benchmark.stats import RequestRecord

RAMP_MARGIN = 1.25  # a warm-up covers this many lifetimes (an estimate's, or a re-run's measured one)
MIN_STEADY_SHARE = 0.5  # of the arrivals a probe means to count, those that must come after its lifetime
DEFAULT_MAX_PROBE_ARRIVALS = 1024  # --search-max-probe-arrivals
STEADY, SHORT, CAPPED = "steady", "short", "capped"  # a probe's ramp verdict (`Ramp.verdict`)
RERUN = "re-run"  # what the search does with a short probe (`short_next`), else why not:
NO_RERUN_FAILS = "not re-run: even its ramp requests fail every target searched"
NO_RERUN_PROBES = "not re-run: --search-max-probes spent"
NO_RERUN_BUDGET = "not re-run: it would end after the time budget"
NO_RERUN_CAP = "not re-run: the cap allows no longer probe"
CAP_FLAG = "--search-max-probe-arrivals"
TRACE_CAP = "the trace window's requests (--num-prompts / --duration-s)"  # a trace's cap: its window


def probe_arrivals(n: int, discard: int, factor: float | None) -> int:
    """The arrivals of a probe above the peak before any warm-up for the ramp: `discard`, then `factor` x the
    n - discard counted ones (rounded up; factor None or 1: n, as a probe at or below the peak)."""
    f = 1.0 if factor is None else factor
    return discard + math.ceil(f * (n - discard) - 1e-9)


# ---------------------------------------------------------------- the ramp rule


def warmup_arrivals(rate: float, ramp_s: float, discard: int) -> int:
    """A probe's warm-up at `rate`: the larger of `discard` arrivals and those expected in its first `ramp_s` s."""
    return max(discard, math.ceil(rate * ramp_s - 1e-9))


def steady_minimum(wanted: int) -> int:
    """The fewest arrivals a probe meaning to count `wanted` may be judged on: MIN_STEADY_SHARE of them, at least
    MIN_TREND_REQUESTS, at most `wanted`."""
    return min(wanted, max(MIN_TREND_REQUESTS, math.ceil(MIN_STEADY_SHARE * wanted - 1e-9)))


def lifetime_estimate(rate: float, lifetimes: Mapping[float, float], fallback: float | None) -> float | None:
    """W_est before a probe at `rate` (module docstring): the lifetime measured at the highest probed rate <= rate
    (`lifetimes`: by rate, the latest run's), else `fallback` (the closed-loop run's), else None."""
    below = [r for r in lifetimes if r <= rate]
    return lifetimes[max(below)] if below else fallback


@dataclass(frozen=True)
class ProbePlan:
    """What one probe sends: its warm-up (arrivals, and the seconds of ramp it was planned to cover), the arrivals it
    means to count, those it needs (the ramp's warm-up and those) and those it sends (at most `cap`: where that
    cuts it, the warm-up shrinks to what the cap leaves, and the check's lifetime decides; above the peak such a
    probe fails where it counted fewer than it meant to, `Ramp.verdict`); `rerun`: a short probe's second run;
    `above_peak`: a probe above the server's closed-loop peak, judged by the backlog rule too."""

    rate: float
    warmup: int
    ramp_s: float
    wanted: int
    needed: int
    sent: int
    cap: int
    rerun: bool = False
    above_peak: bool = False

    @property
    def capped(self) -> bool:
        """Steady state needed more arrivals than the cap allowed."""
        return self.sent < self.needed


def plan_probe(rate: float, wanted: int, discard: int, lifetime_s: float | None, cap: int,
               rerun: bool = False, floor: int = 0, above_peak: bool = False) -> ProbePlan:
    """The plan of a probe at `rate` counting `wanted` arrivals, from a lifetime estimate (None: unknown, the discard
    alone); `floor`: the fewest warm-up arrivals (a re-run's: its first run's); `above_peak`: above the server's
    closed-loop peak."""
    ramp_s = RAMP_MARGIN * lifetime_s if lifetime_s is not None and math.isfinite(lifetime_s) else 0.0
    warm = max(floor, warmup_arrivals(rate, ramp_s, discard))
    sent = min(warm + wanted, cap)
    return ProbePlan(rate, warm if sent == warm + wanted else max(discard, sent - wanted), ramp_s, wanted,
                     warm + wanted, sent, cap, rerun, above_peak)


class Arrival(NamedTuple):
    """One arrival of a probe: its number (a request's index, a conversation's), when it was released (s from the
    probe's start) and its lifetime (until its last request ended; nan where one failed)."""

    key: int
    at_s: float
    life_s: float


def arrival_key(r: RequestRecord) -> int:
    """The arrival a record belongs to: its conversation (multiturn), else its own index."""
    return r.conversation if r.conversation is not None else r.index


def arrivals_of(records: Iterable[RequestRecord]) -> list[Arrival]:
    """A probe's arrivals from its records, by number."""
    by: dict[int, list[RequestRecord]] = {}
    for r in records:
        by.setdefault(arrival_key(r), []).append(r)
    out = []
    for key, rs in sorted(by.items()):
        at = min(r.scheduled_s for r in rs)
        ok = all(r.success and math.isfinite(r.e2e_s) for r in rs)
        out.append(Arrival(key, at, max(r.end_s for r in rs) - at if ok else math.nan))
    return out


def realized_lifetime(arrivals: Iterable[Arrival]) -> float | None:
    """The median lifetime of the arrivals that completed (None: none did)."""
    lives = [a.life_s for a in arrivals if math.isfinite(a.life_s)]
    return statistics.median(lives) if lives else None


def upper_lifetime(arrivals: Iterable[Arrival]) -> float | None:
    """The upper quartile of the completed arrivals' lifetimes (inclusive method; None: none completed): the most
    loaded requests' lifetime, from which a short probe's re-run plans its warm-up (module docstring, 3.)."""
    lives = sorted(a.life_s for a in arrivals if math.isfinite(a.life_s))
    if len(lives) < 2:
        return lives[0] if lives else None
    return statistics.quantiles(lives, n=4, method="inclusive")[2]


@dataclass(frozen=True)
class Ramp:
    """How a probe's warm-up went: its plan, the lifetime it measured (the median), the arrivals after the warm-up
    left out for coming before that lifetime (`cut`) and those counted; `then`: for a short probe, RERUN or why not
    (NO_RERUN_*; '' where it cannot be re-run: itself a re-run, or at the cap); `upper_s`: the upper quartile of its
    lifetimes (`upper_lifetime`; None: not known, the median stands for it)."""

    plan: ProbePlan
    lifetime_s: float | None
    cut: int
    counted: int
    then: str = ""
    upper_s: float | None = None

    @property
    def minimum(self) -> int:
        return steady_minimum(self.plan.wanted)

    @property
    def verdict(self) -> str:
        """STEADY: judged at steady state; SHORT or CAPPED (it needed more than the cap): fails every target. Above
        the peak a probe the cap cut is CAPPED where it counted fewer than it meant to, even the check's minimum:
        the backlog rule's resolution is its counted span (backlog.py), and such a probe is shorter than the
        one planned to show an overload (2026-11-30, a 64-request trace window: vLLM passed 24 req/s, 1.7x its
        closed-loop peak, on 27 requests over ~1 s). Where the cut took only warm-up (every arrival it meant to count
        counted) its span is the planned one, and it is judged as any."""
        if self.plan.above_peak and self.plan.capped and self.counted < self.plan.wanted:
            return CAPPED
        if self.counted >= self.minimum:
            return STEADY
        return CAPPED if self.plan.capped else SHORT

    @property
    def short(self) -> bool:
        return self.verdict != STEADY

    def to_json(self) -> dict[str, Any]:
        p = self.plan
        return {"warmup": p.warmup, "ramp_s": round(p.ramp_s, 3), "lifetime_s": _rounded(self.lifetime_s),
                "upper_lifetime_s": _rounded(self.upper_s), "cut": self.cut, "counted": self.counted,
                "wanted": p.wanted, "minimum": self.minimum,
                "needed": p.needed, "sent": p.sent, "cap": p.cap, "rerun": p.rerun, "above_peak": p.above_peak,
                "verdict": self.verdict,
                "then": self.then}

    def describe(self, cap_name: str = CAP_FLAG) -> str:
        return ramp_text(self.to_json(), cap_name)


def steady_keys(arrivals: Sequence[Arrival], plan: ProbePlan) -> tuple[frozenset[int], Ramp]:
    """The check (module docstring): the arrivals counted, those after the warm-up released at or after the probe's
    own lifetime, and the Ramp that says how it went."""
    life = realized_lifetime(arrivals)
    after = [a for a in arrivals if a.key >= plan.warmup]
    kept = frozenset(a.key for a in after if life is None or a.at_s >= life)
    return kept, Ramp(plan, life, len(after) - len(kept), len(kept), upper_s=upper_lifetime(arrivals))


def short_next(ramp: Ramp, redo: ProbePlan, could_pass: bool, probes_left: int, fits: bool) -> str:
    """What the search does with a probe (module docstring, 3.), `redo` being its re-run's plan (`rerun_plan`): ''
    where it is not short, is itself a re-run, or was capped (a re-run could be no longer); NO_RERUN_FAILS where even
    its ramp requests fail every target searched (`could_pass` False); NO_RERUN_CAP where the cap leaves the re-run
    no longer than it (a trace's window); NO_RERUN_PROBES or NO_RERUN_BUDGET where the re-run finds no probe or time
    left; else RERUN."""
    if not ramp.short or ramp.plan.rerun or ramp.plan.capped:
        return ""
    if not could_pass:
        return NO_RERUN_FAILS
    if redo.capped and redo.sent <= ramp.plan.sent:
        return NO_RERUN_CAP
    if probes_left < 1:
        return NO_RERUN_PROBES
    return RERUN if fits else NO_RERUN_BUDGET


def rerun_plan(ramp: Ramp, discard: int) -> ProbePlan:
    """A short probe's second run: its warm-up from the lifetime its most loaded requests showed (the larger of
    `upper_s` and the median; x RAMP_MARGIN, never fewer arrivals than its first), the same arrivals to count, the
    same cap."""
    p = ramp.plan
    lives = [x for x in (ramp.lifetime_s, ramp.upper_s) if x is not None and math.isfinite(x)]
    return plan_probe(p.rate, p.wanted, discard, max(lives) if lives else None, p.cap, rerun=True, floor=p.warmup,
                      above_peak=p.above_peak)


def with_then(ramp: Ramp, then: str) -> Ramp:
    return replace(ramp, then=then)


def ramp_text(r: Mapping[str, Any], cap_name: str = CAP_FLAG) -> str:
    """A probe's warm-up in words, from Ramp.to_json: 'warm-up 240 arrivals (7.5 s), lifetime 6.1 s; SHORT: 12
    counted after it, minimum 32: re-run'."""
    life = r.get("lifetime_s")
    text = (("re-run: " if r.get("rerun") else "") + f"warm-up {r['warmup']} arrivals ({r['ramp_s']:.3g} s), "
            + ("no request completed" if life is None else f"lifetime {life:.3g} s"))
    if r.get("cut"):
        text += f", {r['cut']} arrivals before it left out"
    if r.get("sent", 0) < r.get("needed", 0):
        text += f"; needed {r['needed']} arrivals, sent {r['sent']} ({cap_name} {r['cap']})"
    verdict = r.get("verdict", STEADY)
    if verdict == STEADY:
        return text
    text += f"; {verdict.upper()}: {r['counted']} counted, minimum {r['minimum']}"
    if verdict == CAPPED:
        text += (f": above the peak, a probe cut by {cap_name} {r['cap']} is too short for the backlog rule"
                 if r.get("above_peak") and r["counted"] >= r["minimum"]
                 else f": steady state not reached within {cap_name} {r['cap']}")
    then = r.get("then") or ""
    return text + (f": {then}" if then == RERUN else ": fails every target" + (f" ({then})" if then else ""))


def cap_problem(cap: int, n: int | None, discard: int, factor: float | None) -> str | None:
    """Why --search-max-probe-arrivals `cap` cannot work with probes of n arrivals (`factor`: above the peak, longer;
    n None: not known yet), or None."""
    if cap < 1:
        return f"{CAP_FLAG} {cap}: give a positive number of arrivals (default {DEFAULT_MAX_PROBE_ARRIVALS})"
    need = probe_arrivals(n, discard, factor) if n is not None else 0
    if cap >= need:
        return None
    longer = factor not in (None, 1.0)
    what = "above the peak (--search-above-peak-factor)" if longer else "(--num-prompts)"
    return (f"{CAP_FLAG} {cap} is below the {need} arrivals of a probe {what} before any warm-up for the ramp: give "
            f"at least {need} (default {DEFAULT_MAX_PROBE_ARRIVALS}), or fewer --num-prompts"
            + (" or a smaller factor" if longer else ""))


def _rounded(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 3)
