"""The ramp rule (rapidserve/benchmark/sustain.py): every probe's warm-up from the requests' lifetime, the check after
the probe, the short and capped verdicts (pure, table-tested), and the search against server models: one whose gaps
grow with the requests in flight (a rate that passes only while they ramp up must fail once judged at steady state),
and one whose load never settles (a short probe is re-run once, then fails)."""

from __future__ import annotations

import asyncio
import bisect
import math
import random
from dataclasses import replace

import pytest

from rapidserve.benchmark.backlog import MIN_TREND_REQUESTS
from rapidserve.benchmark.goodput import (
    AT_MAX,
    CONVERGED,
    UNFINISHED,
    Probe,
    Target,
    measure_probe,
    passes,
    pooled,
)
from rapidserve.benchmark.search import Outcome, search_frontier
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.benchmark.stats import RequestRecord, percentile
from rapidserve.benchmark.sustain import (
    CAP_FLAG,
    CAPPED,
    NO_RERUN_BUDGET,
    NO_RERUN_CAP,
    NO_RERUN_FAILS,
    NO_RERUN_PROBES,
    RAMP_MARGIN,
    RERUN,
    SHORT,
    STEADY,
    Arrival,
    ProbePlan,
    Ramp,
    arrivals_of,
    cap_problem,
    lifetime_estimate,
    plan_probe,
    realized_lifetime,
    rerun_plan,
    short_next,
    steady_keys,
    steady_minimum,
    upper_lifetime,
    warmup_arrivals,
)

# ---------------------------------------------------------------- the pure rule


@pytest.mark.parametrize("rate,ramp_s,discard,want", [
    (10.0, 0.0, 16, 16),  # no lifetime known: the discard alone
    (30.0, 0.5, 16, 16),  # a short lifetime: the discard covers it (2048:28's ~1 s at ~10 req/s)
    (30.0, 7.5, 16, 225),  # 1024:256: 6 s lifetimes x 1.25 at 30 req/s
    (3.0, 2.5, 0, 8),  # 7.5 arrivals: rounded up
    (4.0, 2.5, 0, 10),  # exactly 10: not 11
])
def test_warmup_arrivals(rate: float, ramp_s: float, discard: int, want: int) -> None:
    assert warmup_arrivals(rate, ramp_s, discard) == want


@pytest.mark.parametrize("wanted,want", [(64, 32), (256, 128), (17, 9), (12, 8), (10, 8), (6, 6), (1, 1)])
def test_steady_minimum(wanted: int, want: int) -> None:
    """Half of what a probe meant to count, at least MIN_TREND_REQUESTS (8), never more than it meant to count."""
    assert MIN_TREND_REQUESTS == 8 and steady_minimum(wanted) == want


LIVES = {4.0: 1.0, 8.0: 2.0, 16.0: 9.0}  # the lifetime measured at each probed rate


@pytest.mark.parametrize("rate,fallback,want", [
    (8.0, 5.0, 2.0),  # probed: its own
    (12.0, 5.0, 2.0),  # the highest rate below it
    (100.0, None, 9.0),
    (3.0, 5.0, 5.0),  # below every probe: the closed-loop run's
    (3.0, None, None),  # and without one: unknown
])
def test_lifetime_estimate(rate: float, fallback: float | None, want: float | None) -> None:
    assert lifetime_estimate(rate, LIVES, fallback) == want
    assert lifetime_estimate(rate, {}, fallback) == fallback


@pytest.mark.parametrize("rate,wanted,life,cap,floor,want", [
    (30.0, 64, 6.0, 1024, 0, ProbePlan(30.0, 225, 7.5, 64, 289, 289, 1024)),
    (30.0, 64, None, 1024, 0, ProbePlan(30.0, 16, 0.0, 64, 80, 80, 1024)),  # no estimate: the discard
    (5.0, 64, 1.0, 1024, 0, ProbePlan(5.0, 16, 1.25, 64, 80, 80, 1024)),  # 6.25 arrivals: the discard covers it
    # over the cap: sent at the cap, the warm-up shortened to what it leaves (the check's lifetime decides)
    (40.0, 256, 8.0, 300, 0, ProbePlan(40.0, 44, 10.0, 256, 656, 300, 300)),
    (40.0, 256, 8.0, 200, 0, ProbePlan(40.0, 16, 10.0, 256, 656, 200, 200)),  # never below the discard
    (30.0, 64, 1.0, 1024, 50, ProbePlan(30.0, 50, 1.25, 64, 114, 114, 1024)),  # a re-run: at least its first's
])
def test_plan_probe(rate: float, wanted: int, life: float | None, cap: int, floor: int, want: ProbePlan) -> None:
    plan = plan_probe(rate, wanted, 16, life, cap, floor=floor)
    assert plan == want and plan.capped == (want.sent < want.needed)


def r(i: int, at: float, e2e: float, ok: bool = True, conversation: int | None = None, turn: int | None = None,
      start: float | None = None) -> RequestRecord:
    return RequestRecord(i, 100, 8, scheduled_s=at, start_s=at if start is None else start, success=ok,
                         output_tokens=8 if ok else 0, ttft_s=0.1 if ok else math.nan, e2e_s=e2e if ok else math.nan,
                         itl_s=[0.01] * 7 if ok else [], conversation=conversation, turn=turn)


def test_arrivals_and_their_lifetime() -> None:
    single = [r(1, 0.5, 2.0), r(0, 0.0, 1.0), r(2, 0.9, 3.0, ok=False), r(3, 1.0, 4.0, start=1.5)]
    arr = arrivals_of(single)  # by number; a failed request has no lifetime; one the client held: from its release
    assert arr[:2] == [Arrival(0, 0.0, 1.0), Arrival(1, 0.5, 2.0)] and arr[3] == Arrival(3, 1.0, 4.5)
    assert arr[2].key == 2 and math.isnan(arr[2].life_s)
    assert realized_lifetime(arr) == 2.0  # the median of 1, 2, 4.5
    # a conversation: from its first turn's release to its last turn's end; one failed turn: no lifetime
    turns = [r(0, 0.0, 1.0, conversation=0, turn=0), r(1, 1.2, 2.0, conversation=0, turn=1),
             r(2, 0.3, 1.0, conversation=1, turn=0), r(3, 1.5, 1.0, ok=False, conversation=1, turn=1)]
    conv = arrivals_of(turns)
    assert conv[0] == Arrival(0, 0.0, 3.2) and conv[1].key == 1 and math.isnan(conv[1].life_s)
    assert realized_lifetime(conv) == 3.2 and realized_lifetime(conv[1:]) is None


def arrivals(n: int, gap: float, life: float) -> list[Arrival]:
    return [Arrival(i, i * gap, life) for i in range(n)]


PLAN = plan_probe(10.0, 40, 10, 2.0, 1024)  # warm-up 25 arrivals (2.5 s at 10 req/s), 40 to count, 65 sent


@pytest.mark.parametrize("arr,plan,life,cut,counted,verdict", [
    (arrivals(65, 0.1, 2.0), PLAN, 2.0, 0, 40, STEADY),  # the estimate held: nothing left out
    (arrivals(65, 0.1, 3.0), PLAN, 3.0, 5, 35, STEADY),  # lived longer: arrivals 25-29 came before 3 s
    (arrivals(65, 0.1, 5.0), PLAN, 5.0, 25, 15, SHORT),  # far longer: 15 left, fewer than half of 40
    (arrivals(65, 0.1, 4.5), PLAN, 4.5, 20, 20, STEADY),  # exactly half: judged
    ([a._replace(life_s=math.nan) for a in arrivals(65, 0.1, 9.0)], PLAN, None, 0, 40, STEADY),  # none completed
    # capped at 30: the warm-up shrinks to the discard, and the lifetime leaves 10
    (arrivals(30, 0.1, 2.0), plan_probe(10.0, 40, 10, 2.0, 30), 2.0, 10, 10, CAPPED),
    # capped by an estimate too long (4 s): the 8 it counts, after the 0.5 s the requests lived, are judged
    (arrivals(30, 0.1, 0.5), plan_probe(10.0, 8, 10, 4.0, 30), 0.5, 0, 8, STEADY),
])
def test_steady_keys(arr: list[Arrival], plan: ProbePlan, life: float | None, cut: int, counted: int,
                     verdict: str) -> None:
    keys, ramp = steady_keys(arr, plan)
    assert (ramp.lifetime_s, ramp.cut, ramp.counted, ramp.verdict) == (life, cut, counted, verdict)
    assert len(keys) == counted and all(k >= plan.warmup for k in keys) and ramp.short == (verdict != STEADY)
    assert all(arr[k].at_s >= (life or 0.0) for k in keys)


SHORT_RAMP = steady_keys(arrivals(65, 0.1, 5.0), PLAN)[1]
REDO = rerun_plan(SHORT_RAMP, 10)


def test_rerun_plan() -> None:
    # the lifetime it measured, x 1.25: 6.25 s at 10 req/s, then the same 40 to count
    assert ProbePlan(10.0, 63, 6.25, 40, 103, 103, 1024, rerun=True) == REDO
    lower = steady_keys(arrivals(65, 0.1, 1.0), plan_probe(10.0, 40, 10, 4.0, 1024))[1]
    assert rerun_plan(lower, 10).warmup == 50  # never a shorter warm-up than its first (50 from a 4 s estimate)


def test_rerun_plans_from_the_most_loaded_requests() -> None:
    # a lifetime still growing through the probe (the load's, as W grows with the batch): 3 s for the first arrival
    # to 9.4 s for the last; the median (6.2 s) mixes ramp requests in, the upper quartile (7.8 s) is the re-run's
    growing = [Arrival(i, i * 0.1, 3.0 + 0.1 * i) for i in range(65)]
    ramp = steady_keys(growing, PLAN)[1]
    assert ramp.short and ramp.lifetime_s == pytest.approx(6.2) and ramp.upper_s == pytest.approx(7.8)
    redo = rerun_plan(ramp, 10)
    assert redo.ramp_s == pytest.approx(1.25 * 7.8) and redo.warmup == 98  # 9.75 s at 10 req/s
    assert rerun_plan(replace(ramp, upper_s=None), 10).ramp_s == pytest.approx(1.25 * 6.2)  # none known: the median


@pytest.mark.parametrize("lives,want", [
    ([], None),
    ([2.0], 2.0),
    ([1.0, 3.0], 2.5),
    ([1.0, 2.0, 3.0, 4.0, 5.0], 4.0),
    ([1.0, math.nan, 2.0, 3.0, 4.0, 5.0], 4.0),  # a failed arrival has no lifetime
])
def test_upper_lifetime(lives: list[float], want: float | None) -> None:
    got = upper_lifetime([Arrival(i, 0.0, x) for i, x in enumerate(lives)])
    assert got == (None if want is None else pytest.approx(want))


@pytest.mark.parametrize("ramp,redo,could,left,fits,want", [
    (SHORT_RAMP, REDO, True, 3, True, RERUN),
    (SHORT_RAMP, REDO, False, 3, True, NO_RERUN_FAILS),  # even its ramp requests fail: it fails anyway
    (SHORT_RAMP, REDO, True, 0, True, NO_RERUN_PROBES),
    (SHORT_RAMP, REDO, True, 3, False, NO_RERUN_BUDGET),
    (SHORT_RAMP, plan_probe(10.0, 40, 10, 5.0, 65, rerun=True), True, 3, True, NO_RERUN_CAP),  # a trace's window
    (steady_keys(arrivals(65, 0.1, 2.0), PLAN)[1], REDO, True, 3, True, ""),  # steady: nothing to do
    (Ramp(REDO, 9.0, 40, 0), REDO, True, 3, True, ""),  # a re-run still short: it fails
    (Ramp(plan_probe(10.0, 40, 10, 2.0, 30), 2.0, 10, 10), REDO, True, 3, True, ""),  # capped: none longer allowed
])
def test_short_next(ramp: Ramp, redo: ProbePlan, could: bool, left: int, fits: bool, want: str) -> None:
    assert short_next(ramp, redo, could, left, fits) == want


@pytest.mark.parametrize("cap,n,discard,factor,want", [
    (1024, 80, 16, None, None),
    (80, 80, 16, None, None),  # exactly a probe before any ramp warm-up
    (79, 80, 16, None, "--search-max-probe-arrivals 79 is below the 80 arrivals of a probe (--num-prompts)"),
    (200, 80, 16, 4.0, "--search-max-probe-arrivals 200 is below the 272 arrivals of a probe above the peak"),
    (0, None, 16, None, "--search-max-probe-arrivals 0: give a positive number"),
    (5, None, 16, None, None),  # the probe's size not known yet: checked again once it is
])
def test_cap_problem(cap: int, n: int | None, discard: int, factor: float | None, want: str | None) -> None:
    got = cap_problem(cap, n, discard, factor)
    assert (got is None) == (want is None) and (want is None or want in (got or ""))


def test_ramp_words() -> None:
    steady = steady_keys(arrivals(65, 0.1, 3.0), PLAN)[1]
    assert steady.describe() == "warm-up 25 arrivals (2.5 s), lifetime 3 s, 5 arrivals before it left out"
    assert steady.to_json() == {"warmup": 25, "ramp_s": 2.5, "lifetime_s": 3.0, "upper_lifetime_s": 3.0, "cut": 5,
                                "counted": 35,
                                "wanted": 40, "minimum": 20, "needed": 65, "sent": 65, "cap": 1024, "rerun": False,
                                "above_peak": False,
                                "verdict": STEADY, "then": ""}
    assert Ramp(PLAN, 5.0, 25, 15, RERUN).describe() == ("warm-up 25 arrivals (2.5 s), lifetime 5 s, 25 arrivals "
                                                         "before it left out; SHORT: 15 counted, minimum 20: re-run")
    assert Ramp(REDO, 9.0, 40, 0).describe() == ("re-run: warm-up 63 arrivals (6.25 s), lifetime 9 s, 40 arrivals "
                                                 "before it left out; SHORT: 0 counted, minimum 20: fails every "
                                                 "target")
    capped = Ramp(plan_probe(10.0, 40, 10, 2.0, 30), 2.0, 10, 10, NO_RERUN_FAILS)
    assert capped.describe("the window") == (
        "warm-up 10 arrivals (2.5 s), lifetime 2 s, 10 arrivals before it left out; needed 65 arrivals, sent 30 (the "
        "window 30); CAPPED: 10 counted, minimum 20: steady state not reached within the window 30: fails every "
        f"target ({NO_RERUN_FAILS})")
    assert CAP_FLAG in capped.describe()


# ---------------------------------------------------------------- a probe's verdict


def test_a_short_probe_fails_every_target_and_is_not_pooled() -> None:
    records = [r(i, i * 0.1, 5.0) for i in range(65)]  # every request fine, but they live 5 s: 15 after it
    t = Target(50.0, 0.9)
    short = measure_probe(10.0, records, [None, 50.0], 10, plan=PLAN)
    assert short.ramp is not None and short.ramp.verdict == SHORT and short.n == 15 and short.attainment(50.0) == 1.0
    assert short.unsteady and not passes(short, t)
    old = measure_probe(10.0, records, [None, 50.0], 10)  # by the discard alone (no plan): 55 counted, passing
    assert old.n == 55 and old.ramp is None and passes(old, t)
    steady = Probe(10.0, 40, {"50": 40}, ramp=steady_keys(arrivals(65, 0.1, 2.0), PLAN)[1])
    assert passes(steady, t) and not steady.unsteady
    assert pooled(short, steady) == steady and pooled(steady, short) == steady  # a short probe counted nothing
    assert pooled(short, short) == short
    both = pooled(steady, steady)
    assert both.n == 80 and both.ramp == steady.ramp and passes(both, t)


# ---------------------------------------------------------------- the search against server models

W, T = 6.0, 32  # a request's lifetime (s) and output gaps


class RampServer:
    """Decode-heavy: every request lives W = 6 s (0.2 s to its first token, then T gaps), and each gap is 10 ms +
    0.25 ms per request in flight at that moment (its own batch), so at steady state under Poisson arrivals at r it
    is 10 + 0.25 x r x W ms: a 50-ms bound holds up to r = 26.7 req/s. A probe of 60 arrivals at 40 req/s lasts
    1.5 s, a quarter of a lifetime: at most 60 are ever in flight (25 ms gaps), where steady state holds 240 (70 ms).
    Arrivals are Poisson (seeded by the rate and the call); the fake clock advances by the span plus one lifetime."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, int]] = []
        self.now = 0.0

    def records(self, rate: float, n: int, seed: int = 0) -> list[RequestRecord]:
        rng = random.Random(round(rate * 1000) + 7919 * seed)
        at, t = [], 0.0
        for _ in range(n):
            t += rng.expovariate(rate)
            at.append(t)

        def inflight(x: float) -> int:  # released by x and not yet done
            return bisect.bisect_right(at, x) - bisect.bisect_right(at, x - W)

        out = []
        for i, a in enumerate(at):
            gaps = [0.010 + 0.00025 * inflight(a + 0.2 + (W - 0.2) * (j + 0.5) / T) for j in range(T)]
            out.append(RequestRecord(i, 100, T + 1, scheduled_s=a, start_s=a, success=True, output_tokens=T + 1,
                                     ttft_s=0.2, e2e_s=W, itl_s=gaps))
        return out

    async def measure(self, rate: float, n: int, why: str = "") -> list[RequestRecord]:
        self.calls.append((rate, n))
        self.now += n / rate + W
        return self.records(rate, n, len(self.calls))


def ramp_search(server: RampServer) -> Outcome:
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=10, max_probes=30, max_rate=40.0,
                        start_rate=10.0)
    return asyncio.run(search_frontier(server.measure, scfg, 10.0, 60, clock=lambda: server.now))


def test_a_rate_that_passes_only_during_the_ramp_fails_at_steady_state() -> None:
    server, t = RampServer(), Target(50.0, 0.9)
    # judged as before the ramp rule (the discard alone), 60 arrivals at 40 req/s pass: 1.5 s of a 6 s ramp
    ramp_only = measure_probe(40.0, server.records(40.0, 60), [50.0], 10)
    assert passes(ramp_only, t) and ramp_only.attainment(50.0) == 1.0
    # the ramp rule, from the 6 s lifetime: a warm-up of 300 arrivals (7.5 s), then the 50: it fails
    plan = plan_probe(40.0, 50, 10, W, 1024)
    steady = measure_probe(40.0, server.records(40.0, plan.sent), [50.0], 10, plan=plan)
    assert plan.sent == 350 and steady.ramp is not None and steady.ramp.verdict == STEADY and steady.n == 50
    assert steady.attainment(50.0) < 0.1 and not passes(steady, t)

    out = ramp_search(server)
    # the search, from 10 req/s and no lifetime known: its first probe (the discard alone, 60 arrivals over 6 s) is
    # short, and re-run once with a warm-up of 1.25 x the 6 s it measured; every later probe warms up that long
    first, redo = out.probes[:2]
    assert first.ramp is not None and first.ramp.verdict == SHORT and first.ramp.then == RERUN
    assert redo.ramp is not None and redo.ramp.plan == ProbePlan(10.0, 75, 7.5, 50, 125, 125, 1024, rerun=True)
    assert redo.ramp.verdict == STEADY and server.calls[:2] == [(10.0, 60), (10.0, 125)]
    assert all(p.ramp is not None and p.ramp.verdict == STEADY for p in out.probes[1:])
    assert all(n == math.ceil(rate * RAMP_MARGIN * W) + 50 for rate, n in server.calls[1:])
    (e,) = out.goodput[1:]  # the 50-ms target: the steady-state frontier, not the ramp's (40 and beyond)
    assert e["status"] == CONVERGED and 24.0 <= e["lo"] <= 26.7 and e["hi"] <= e["lo"] * 1.05 + 1e-9, e
    assert all(not passes(p, t) for p in out.probes if p.rate > 26.7)


def steady_gap_ms(server: RampServer, rate: float) -> float:
    """The p95 gap of a request released well into a long run at `rate` (a check of the model itself)."""
    recs = server.records(rate, int(rate * 3 * W))
    return 1e3 * percentile([percentile(q.itl_s, 95) for q in recs if 1.5 * W < q.scheduled_s < 2 * W], 50)


def test_the_ramp_server_model() -> None:
    server = RampServer()
    assert steady_gap_ms(server, 20.0) == pytest.approx(10 + 0.25 * 20 * W, rel=0.15)
    assert steady_gap_ms(server, 40.0) == pytest.approx(10 + 0.25 * 40 * W, rel=0.15)


class NeverSettles:
    """A load that never settles: every request lives as long as its probe's arrivals span, plus 1 s, so whatever the
    warm-up, the arrivals after it all come before the lifetime the probe measures (with `life`: every request lives
    that long instead). Its requests are fine otherwise (TTFT `ttft`, 10 ms gaps). Arrivals every 1 / r s; the fake
    clock advances by the probe's span plus 1 s."""

    def __init__(self, ttft: float = 0.1, life: float | None = None) -> None:
        self.ttft, self.life, self.calls, self.now = ttft, life, [], 0.0  # type: ignore[var-annotated]
        self.whys: list[str] = []  # what the search said of each run

    async def measure(self, rate: float, n: int, why: str = "") -> list[RequestRecord]:
        self.calls.append((rate, n))
        self.whys.append(why)
        self.now += n / rate + 1.0
        life = n / rate + 1.0 if self.life is None else self.life
        return [RequestRecord(i, 100, 9, scheduled_s=i / rate, start_s=i / rate, success=True, output_tokens=9,
                              ttft_s=self.ttft, e2e_s=life, itl_s=[0.01] * 8) for i in range(n)]


def settle_search(server: NeverSettles, max_probes: int = 2, deadline: float | None = None,
                  cap: int = 1024) -> Outcome:
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=10, max_probes=max_probes, start_rate=8.0,
                        max_rate=16.0, max_probe_arrivals=cap)
    return asyncio.run(search_frontier(server.measure, scfg, 8.0, 60, clock=lambda: server.now, deadline=deadline))


def test_a_short_probe_is_run_once_more_then_fails_as_short() -> None:
    server = NeverSettles()
    out = settle_search(server)
    # 60 arrivals at 8 req/s live 8.5 s: none after it; the re-run warms up for 1.25 x 8.5 s = 85 arrivals and its
    # 135 arrivals live 17.9 s: still none after it. Its ramp requests were fine, yet it fails every target
    assert server.calls == [(8.0, 60), (8.0, 135)] and len(out.probes) == 2
    assert server.whys == ["", RERUN]  # the run's own words say it is a re-run (the report's "again (a short probe")
    first, redo = out.probes
    assert first.ramp is not None and (first.ramp.verdict, first.ramp.then, first.ramp.counted) == (SHORT, RERUN, 0)
    assert redo.ramp is not None and redo.ramp.plan.rerun and redo.ramp.plan.warmup == 85
    assert (redo.ramp.verdict, redo.ramp.then, redo.n) == (SHORT, "", 0)
    assert "SHORT: 0 counted, minimum 25: fails every target" in redo.ramp.describe()
    assert all(not passes(p, Target(b, 0.9)) for p in out.probes for b in (None, 50.0))
    assert all(e["status"] == UNFINISHED and e["hi"] == 8.0 and e["lo"] is None for e in out.goodput)
    assert out.stopped == "2 probes made (--search-max-probes)"


def test_a_short_probe_that_fails_anyway_is_not_run_again() -> None:
    server = NeverSettles(ttft=5.0)  # over the 1 s TTFT rule: its ramp requests fail too
    out = settle_search(server, max_probes=1)
    assert server.calls == [(8.0, 60)] and out.probes[0].ramp is not None
    assert (out.probes[0].ramp.verdict, out.probes[0].ramp.then) == (SHORT, NO_RERUN_FAILS)


@pytest.mark.parametrize("max_probes,deadline,then", [(1, None, NO_RERUN_PROBES), (5, 30.0, NO_RERUN_BUDGET)])
def test_a_short_probe_not_run_again_for_want_of_probes_or_time_fails(max_probes: int, deadline: float | None,
                                                                      then: str) -> None:
    server = NeverSettles()
    out = settle_search(server, max_probes=max_probes, deadline=deadline)
    # the re-run (135 arrivals at 8 req/s, ~17 s, then ~8.5 s to drain) would end after the 30 s deadline
    assert server.calls[0] == (8.0, 60) and out.probes[0].ramp is not None
    assert (out.probes[0].ramp.verdict, out.probes[0].ramp.then) == (SHORT, then)
    assert not passes(out.probes[0], Target(None, 0.9)) and (8.0, 135) not in server.calls


class SettlesBelow10(NeverSettles):
    """NeverSettles above 10 req/s; below it every request lives 0.13 s (steady at once)."""

    async def measure(self, rate: float, n: int, why: str = "") -> list[RequestRecord]:
        self.life = 0.13 if rate < 10.0 else None
        return await super().measure(rate, n, why)


def test_a_short_probe_at_the_ttft_rate_is_re_run_without_time_kept_for_itself() -> None:
    """A short probe at the --search-ttft-rate is re-run where the budget allows it, as without the flag: the probe
    there (or its re-run) serves as the TTFT probe, so no time is kept from its re-run for one (keeping it had
    refused the re-run, and then no TTFT probe ran either: the rate was probed)."""
    def search(ttft: float | None) -> tuple[list[tuple[float, int]], list[str], list[str | None]]:
        server = SettlesBelow10()
        scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=10, max_probes=5, start_rate=8.0,
                            max_rate=16.0, ttft_rate=ttft)
        out = asyncio.run(search_frontier(server.measure, scfg, 8.0, 60, clock=lambda: server.now, deadline=30.0))
        return server.calls, server.whys, [p.ramp.then if p.ramp is not None else None for p in out.probes]

    runs = [search(None), search(16.0)]
    assert runs[1] == runs[0]
    assert runs[1][:2] == ([(8.0, 60), (16.0, 60), (16.0, 145), (12.0, 60)], ["", "", RERUN, ""])
    assert runs[1][2][1] == RERUN


def test_a_probe_that_needs_more_than_the_cap_fails_as_capped() -> None:
    server = NeverSettles()
    out = settle_search(server, cap=100)
    # the first probe (60) is short; its re-run needs 135 arrivals, is sent 100 (the cap), and fails as capped
    assert server.calls == [(8.0, 60), (8.0, 100)]
    redo = out.probes[1].ramp
    assert redo is not None and (redo.verdict, redo.plan.needed, redo.plan.sent) == (CAPPED, 135, 100)
    assert "steady state not reached within --search-max-probe-arrivals 100" in redo.describe()
    # a rate whose estimate alone needs more than the cap is sent at the cap, never longer, and judged by its lifetime
    ramp = RampServer()
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=10, max_probes=1, start_rate=40.0,
                        max_rate=40.0, max_probe_arrivals=200)
    out = asyncio.run(search_frontier(ramp.measure, scfg, 40.0, 60, clock=lambda: ramp.now, lifetime_s=W))
    assert ramp.calls == [(40.0, 200)] and out.probes[0].ramp is not None
    assert (out.probes[0].ramp.verdict, out.probes[0].ramp.then) == (CAPPED, "")
    assert out.goodput[1]["hi"] == 40.0  # failed, not passed on a ramp


def test_a_trace_window_too_short_for_steady_state_fails_without_a_rerun() -> None:
    """A trace replays its window's requests (search.py passes its count as the cap): a re-run could be no longer, so
    a short probe is not run again; it fails."""
    server = NeverSettles()
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=10, max_probes=1, start_rate=8.0, max_rate=16.0)
    out = asyncio.run(search_frontier(server.measure, scfg, 8.0, 60, clock=lambda: server.now, cap=60))
    assert server.calls == [(8.0, 60)] and out.probes[0].ramp is not None
    assert (out.probes[0].ramp.verdict, out.probes[0].ramp.then) == (SHORT, NO_RERUN_CAP)
    assert "fails every target (not re-run: the cap allows no longer probe)" in out.probes[0].ramp.describe()


def test_the_time_budget_knows_the_warm_up() -> None:
    """A probe's estimated length is its warm-up and counted arrivals over the rate, then one lifetime to drain: at
    10 req/s with a 6 s lifetime, 125 arrivals (12.5 s) + 6 s; a deadline at 15 s starts nothing."""
    server = RampServer()
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=10, start_rate=10.0, max_rate=40.0)
    out = asyncio.run(search_frontier(server.measure, scfg, 10.0, 60, clock=lambda: server.now, deadline=15.0,
                                      lifetime_s=W))
    assert server.calls == [] and out.stopped == ("the time budget: a probe at 10 req/s (~18 s) would end after it")
    out = asyncio.run(search_frontier(server.measure, scfg, 10.0, 60, clock=lambda: server.now, deadline=19.0,
                                      lifetime_s=W))
    assert server.calls[0] == (10.0, 125)


def test_a_search_whose_probes_reach_steady_state_is_unchanged_at_the_ceiling() -> None:
    """Where lifetimes are short against the discard (2048:28-like), the ramp rule adds nothing: every probe sends
    the discard then the counted, and a server that passes everything reads `>= ceiling` as before."""
    server = NeverSettles(ttft=0.05, life=0.13)
    out = settle_search(server, max_probes=5)
    assert server.calls == [(8.0, 60), (16.0, 60)] and all(e["status"] == AT_MAX for e in out.goodput)
    assert all(p.ramp is not None and p.ramp.verdict == STEADY and p.ramp.cut == 0 for p in out.probes)

