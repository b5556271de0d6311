"""rapidserve.benchmark.goodput and search: the papers' goodput (pure parts, table-tested) and the rate search
against a fake server whose frontier is known."""

from __future__ import annotations

import asyncio
import dataclasses
import math
from collections.abc import Sequence

import pytest

from rapidserve.benchmark.backlog import Backlog
from rapidserve.benchmark.goodput import (
    AT_MAX,
    BELOW_MIN,
    CONVERGED,
    NOT_SEARCHED,
    UNFINISHED,
    Bracket,
    Probe,
    Target,
    attains,
    bound_key,
    bracket,
    bracket_width,
    contradicted,
    counted,
    fails_above,
    fits,
    goodput_entry,
    measure_probe,
    misses_allowed,
    next_step,
    p95_itl_s,
    passes,
    passes_above,
    pooled,
    round_rate,
    share_note,
    targets,
    ttft_limit_s,
    widest_first,
)
from rapidserve.benchmark.goodput_report import goodput_cell
from rapidserve.benchmark.search import AGAIN, search_frontier
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.benchmark.search_run import no_peak_advice, start_from_peak
from rapidserve.benchmark.stats import RequestRecord


def rec(prompt: int = 500, ttft: float = 0.5, itl: Sequence[float] = (0.01,) * 10, ok: bool = True,
        index: int = 0, conversation: int | None = None, at: float = 0.0, e2e: float | None = None) -> RequestRecord:
    return RequestRecord(index, prompt, len(itl) + 1, scheduled_s=at, start_s=at, success=ok,
                         output_tokens=len(itl) + 1 if ok else 0, ttft_s=ttft if ok else math.nan,
                         e2e_s=ttft + sum(itl) if e2e is None else e2e, itl_s=list(itl), conversation=conversation)


@pytest.mark.parametrize("prompt,want", [(0, 1.0), (500, 1.0), (1000, 1.0), (1500, 1.5), (4096, 4.096)])
def test_ttft_limit_is_one_second_per_1k_prompt_tokens_at_least_one(prompt: int, want: float) -> None:
    assert ttft_limit_s(prompt) == pytest.approx(want)


GAPS_20 = [0.01] * 19 + [0.5]  # one slow gap in 20: the p95 (linear interpolation) is 0.01 + 0.05 x 0.49
GAPS_10 = [0.01] * 9 + [0.5]  # one slow gap in 10: the p95 is 0.01 + 0.55 x 0.49 = 0.2795


@pytest.mark.parametrize("r,bound,want", [
    (rec(), None, True),  # TTFT rule only
    (rec(), 10.0, True),  # every gap 10 ms: the p95 is 10 ms
    (rec(), 9.9, False),
    (rec(itl=GAPS_20), 40.0, True),  # the p95 (34.5 ms), not the slowest gap (500 ms), is bounded
    (rec(itl=GAPS_20), 30.0, False),
    (rec(itl=GAPS_10), 250.0, False), (rec(itl=GAPS_10), 280.0, True),
    (rec(itl=()), 1.0, True),  # one output token: no gap, meets any bound
    (rec(ttft=1.0), None, True), (rec(ttft=1.01), None, False),  # 500 prompt tokens: the 1 s floor
    (rec(prompt=4000, ttft=3.9), 10.0, True), (rec(prompt=4000, ttft=4.1), 1000.0, False),  # 1 s per 1K
    (rec(ok=False), None, False),  # a failure never attains
])
def test_attains(r: RequestRecord, bound: float | None, want: bool) -> None:
    assert attains(r, bound) is want


def test_p95_itl() -> None:
    assert p95_itl_s([]) is None
    assert p95_itl_s(GAPS_20) == pytest.approx(0.01 + 0.49 * 0.05)


def test_counted_discards_the_first_arrivals_or_conversations() -> None:
    single = [rec(index=i) for i in range(6)]
    assert [r.index for r in counted(single, 2)] == [2, 3, 4, 5]
    turns = [rec(index=c * 2 + t, conversation=c) for c in range(3) for t in range(2)]
    assert [r.index for r in counted(turns, 1)] == [2, 3, 4, 5]  # conversation 0's two turns dropped


def test_measure_probe_and_passes() -> None:
    records = [rec(index=0, ttft=9.0)]  # the warm-up arrival, discarded
    records += [rec(index=i) for i in range(1, 9)]  # 8 meet 10 ms
    records += [rec(index=9, itl=(0.05,) * 5), rec(index=10, ok=False)]  # one meets 50 ms only, one failed
    p = measure_probe(2.0, records, [None, 10.0, 50.0], discard=1)
    assert (p.n, dict(p.attained)) == (10, {"unbounded": 9, "10": 8, "50": 9})
    assert p.attainment(10.0) == 0.8 and p.attainment(None) == 0.9
    assert passes(p, Target(None, 0.9)) and passes(p, Target(50.0, 0.9)) and not passes(p, Target(50.0, 0.99))
    assert passes(p, Target(10.0, 0.8)) and not passes(p, Target(10.0, 0.81))
    assert not passes(Probe(1.0, 0, {}), Target(None, 0.1))  # nothing counted: fails


def test_targets_loosest_first() -> None:
    assert targets([50.0, 200.0], [0.99, 0.9]) == [
        Target(None, 0.9), Target(None, 0.99), Target(200.0, 0.9), Target(200.0, 0.99), Target(50.0, 0.9),
        Target(50.0, 0.99)]


@pytest.mark.parametrize("only,want", [
    (None, [None, 200.0, 50.0]), ((50.0,), [50.0]), ((None,), [None]), ((50.0, None), [None, 50.0]), ((), [])])
def test_targets_of_some_bounds_only(only: tuple[float | None, ...] | None, want: list[float | None]) -> None:
    got = targets([50.0, 200.0], [0.9, 0.99], only)
    assert got == [Target(b, q) for b in want for q in (0.9, 0.99)]
    assert SearchConfig(itl_bounds_ms=(50.0, 200.0), only_bounds=only).searched() == got


def _entry_bounds(e: dict[str, object]) -> tuple[float, float]:
    """bench/compare_repeats.entry_bounds (bench/ is not a package: loaded by path)."""
    import importlib.util
    import os
    import sys

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
    sys.path.insert(0, here)
    try:
        spec = importlib.util.spec_from_file_location("compare_repeats", os.path.join(here, "compare_repeats.py"))
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(here)
    return mod.entry_bounds(e)  # type: ignore[no-any-return]


def P(rate: float, ok: bool) -> Probe:  # noqa: N802 - a probe that passes Target(None, 0.9) or not
    return Probe(rate, 10, {"unbounded": 10 if ok else 0})


T = Target(None, 0.9)


@pytest.mark.parametrize("probes,want", [
    ([], Bracket(None, None)),
    ([P(4, True), P(8, True)], Bracket(8, None)),
    ([P(4, False), P(2, False)], Bracket(None, 2)),
    ([P(4, True), P(8, False), P(6, True)], Bracket(6, 8)),
    ([P(2, True), P(4, False), P(6, True), P(8, False)], Bracket(2, 4)),  # a pass above a failure is noise
])
def test_bracket(probes: list[Probe], want: Bracket) -> None:
    assert bracket(probes, T) == want


@pytest.mark.parametrize("probes,want,fails", [
    ([], None, None),
    ([P(4, True), P(8, True)], None, None),  # nothing failed
    ([P(4, True), P(8, False), P(6, True)], None, None),  # monotone
    ([P(2, True), P(4, False), P(6, True), P(8, False)], 6, 8),  # the pass above the failure, however noisy
    ([P(2, True), P(4, False), P(6, True), P(10, True), P(8, False)], 10, None),  # the highest one; none failed above
    ([P(2, True), P(4, False), P(6, True), P(12, False), P(16, False)], 6, 12),  # the lowest failure above it
    ([P(4, False), P(6, False)], None, None),
])
def test_passes_above(probes: list[Probe], want: float | None, fails: float | None) -> None:
    """A pass above the bracket's failure is named, not dropped: goodput by the highest passing rate alone lies in
    [passes_above, fails_above), and the ratios read those bounds (compare_repeats.entry_bounds)."""
    assert passes_above(probes, T) == want and fails_above(probes, T) == fails
    e = goodput_entry(probes, T, UNFINISHED)
    assert e["passes_above"] == want and e["fails_above"] == fails and (e["lo"], e["hi"]) == tuple(bracket(probes, T))
    bounds = _entry_bounds(e)
    if want is None:
        assert bounds[0] == (e["lo"] or 0.0)
    else:
        assert bounds == (want, math.inf if fails is None else fails)
    assert (goodput_cell(e).endswith(f"(passes {want:.3g})") if want is not None else "passes" not in goodput_cell(e))


@pytest.mark.parametrize("b,want", [
    (Bracket(None, None), (5.0, "")),  # nothing probed: the start
    (Bracket(5, None), (10.0, "")), (Bracket(30, None), (40.0, "")),  # double, capped at the max
    (Bracket(40, None), (None, AT_MAX)),
    (Bracket(None, 5), (2.5, "")), (Bracket(None, 2), (1.25, "")),  # halve, floored at the min
    (Bracket(None, 1.25), (None, BELOW_MIN)),
    (Bracket(4, 8), (6.0, "")), (Bracket(4, 4.3), (4.15, "")),  # bisect
    (Bracket(4, 4.2), (None, CONVERGED)), (Bracket(4, 4.19), (None, CONVERGED)),  # within 5%
    (Bracket(1.0 / 3, 0.3334 * 1.06), (0.343, "")),  # the midpoint to 3 significant digits
])
def test_next_step(b: Bracket, want: tuple[float | None, str]) -> None:
    assert tuple(next_step(b, start=5.0, min_rate=1.25, max_rate=40.0, tolerance=0.05)) == want


def test_next_step_never_repeats_a_probed_rate() -> None:
    rates: list[float] = []
    probes: list[Probe] = []
    for _ in range(30):  # a frontier at 7.77: every step is new until it converges
        step = next_step(bracket(probes, T), 5.0, 1.25, 40.0, 0.01)
        if step.rate is None:
            break
        assert step.rate not in rates
        rates.append(step.rate)
        probes.append(P(step.rate, step.rate <= 7.77))
    lo, hi = bracket(probes, T)
    assert step.status == CONVERGED and lo is not None and hi is not None and lo <= 7.77 < hi <= lo * 1.01


@pytest.mark.parametrize("now,deadline,rate,n,drain,want", [
    (0.0, None, 1.0, 100, 0.0, True), (0.0, 100.0, 1.0, 100, 0.0, True), (0.0, 100.0, 1.0, 100, 0.5, False),
    (50.0, 100.0, 4.0, 100, 20.0, True), (50.0, 100.0, 2.0, 100, 1.0, False)])
def test_fits(now: float, deadline: float | None, rate: float, n: int, drain: float, want: bool) -> None:
    assert fits(now, deadline, rate, n, drain) is want


def test_round_rate_and_limits() -> None:
    assert round_rate(3.14159) == 3.14 and round_rate(123.456) == 123.0 and round_rate(0.0123456) == 0.0123
    assert SearchConfig().limits(4.0) == (1.0, 32.0)
    assert SearchConfig(min_rate=0.5, max_rate=10.0).limits(4.0) == (0.5, 10.0)
    assert SearchConfig().limits(4.0, peak=8.123) == (1.0, 8.12)  # no probe past the closed-loop peak
    assert SearchConfig(max_rate=20.0).limits(4.0, peak=8.0) == (1.0, 20.0)  # unless asked


@pytest.mark.parametrize("kw,probe_requests,match", [
    ({"shares": (0.9, 1.5)}, None, "--search-shares"), ({"shares": ()}, None, "--search-shares"),
    ({"tolerance": 1.0}, None, "--search-tolerance"), ({"itl_bounds_ms": (0.0,)}, None, "--search-itl-bounds-ms"),
    ({"start_rate": 5.0, "max_rate": 4.0}, None, "--search-max-rate"), ({"min_rate": -1.0}, None, "--search-min"),
    ({"discard": 16}, 16, "--search-discard"), ({"start_fraction": 0.0}, None, "--search-start-fraction"),
    ({"only_bounds": (30.0,)}, None, "--search-only-bounds 30: give one or more of the bounds searched "
                                     r"\(unbounded,25,50,100,200"),
    ({"only_bounds": ()}, None, "--search-only-bounds"),
])
def test_search_config_check(kw: dict[str, object], probe_requests: int | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SearchConfig(**kw).check(probe_requests)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the search against a fake server

N, D = 60, 10  # arrivals per probe, warm-up discarded


class FakeServer:
    """A server model with a known frontier. At rate r, the k-th of the N - D arrivals a probe counts (the last
    ones: its warm-up comes first) has every gap slope x r x (1 + (D + k) / N) s (so its p95 is that), and its TTFT
    is 0.2 s below `capacity` and 5 s above (over the 1 s rule). Arrival i is released at i / r and lives 0.1 s past
    its TTFT (a lifetime kept apart from the gaps, which are what is scored: 0.3 s below capacity keeps the ramp
    rule's warm-up at the discard up to ~26 req/s; above capacity a 5.1 s lifetime makes the probe short, and it
    fails as it did). Each call advances a fake clock by the probe's arrival span (n / r) plus 1 s of drain."""

    def __init__(self, capacity: float, slope: float = 0.006) -> None:
        self.capacity, self.slope, self.now, self.calls = capacity, slope, 0.0, []  # type: ignore[var-annotated]
        self.sent: list[int] = []
        self.whys: list[str] = []  # what the search said of each run (search.AGAIN, RERUN or "")

    def records(self, rate: float, n: int = N) -> list[RequestRecord]:
        ttft = 0.2 if rate <= self.capacity else 5.0
        w = n - (N - D)  # the warm-up the search planned
        return [rec(prompt=100, ttft=ttft, itl=(self.slope * rate * (1 + (D + i - w) / N),) * 8, index=i,
                    at=i / rate, e2e=ttft + 0.1) for i in range(n)]

    async def measure(self, rate: float, n: int = N, why: str = "") -> list[RequestRecord]:
        self.calls.append(rate)
        self.sent.append(n)
        self.whys.append(why)
        self.now += n / rate + 1.0
        return self.records(rate, n)

    def frontier(self, t: Target) -> float:
        """The highest rate at which a share t.share of the counted requests attain t's bound."""
        if t.itl_bound_ms is None:
            return self.capacity
        m = math.ceil(t.share * (N - D) - 1e-9)  # requests D .. D + m - 1 must meet it
        return min(self.capacity, t.itl_bound_ms / 1e3 / (self.slope * (1 + (D + m - 1) / N)))


def run_search(server: FakeServer, scfg: SearchConfig, start: float, deadline: float | None = None):  # type: ignore[no-untyped-def]
    return asyncio.run(search_frontier(server.measure, scfg, start, N, clock=lambda: server.now, deadline=deadline))


def test_search_finds_the_known_frontier_within_tolerance() -> None:
    server = FakeServer(capacity=10.0)
    scfg = SearchConfig(itl_bounds_ms=(5.0, 25.0, 50.0, 100.0, 200.0), max_probes=60, discard=D)
    out = run_search(server, scfg, start=5.0)
    assert out.stopped is None and (out.min_rate, out.max_rate) == (1.25, 40.0)
    assert len(server.calls) == len(set(server.calls)) == len(out.probes)  # each rate measured once, reused
    by = {(e["itl_bound_ms"], e["share"]): e for e in out.goodput}
    assert len(by) == 12
    for t in targets(scfg.itl_bounds_ms, scfg.shares):
        e, true = by[(t.itl_bound_ms, t.share)], server.frontier(t)
        if true < out.min_rate:
            assert e["status"] == BELOW_MIN and e["goodput"] == 0.0 and e["hi"] == out.min_rate, e
            continue
        assert e["status"] == CONVERGED, e
        assert e["lo"] <= true < e["hi"] <= e["lo"] * 1.05, (t, true, e)
        assert e["goodput"] == e["lo"] >= true / 1.05
    assert by[(5.0, 0.9)]["status"] == BELOW_MIN and by[(200.0, 0.99)]["lo"] <= 10.0 < by[(200.0, 0.99)]["hi"]
    # goodput never rises as the bound tightens or the share grows
    for q in scfg.shares:
        g = [by[(b, q)]["goodput"] for b in (None, 200.0, 100.0, 50.0, 25.0, 5.0)]
        assert g == sorted(g, reverse=True)
    for b in (None, 200.0, 100.0, 50.0, 25.0):
        assert by[(b, 0.99)]["goodput"] <= by[(b, 0.9)]["goodput"]


def test_search_at_the_max_rate() -> None:
    server = FakeServer(capacity=100.0, slope=1e-6)  # passes everything up to 8 x the start
    out = run_search(server, SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=D), start=4.0)
    assert [e["status"] for e in out.goodput] == [AT_MAX, AT_MAX] and server.calls == [4.0, 8.0, 16.0, 32.0]
    assert all(e["goodput"] == 32.0 and e["hi"] is None for e in out.goodput)


def test_search_stops_at_the_closed_loop_peak() -> None:
    server = FakeServer(capacity=100.0, slope=1e-6)
    out = asyncio.run(search_frontier(server.measure, SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=D),
                                      4.0, N, clock=lambda: server.now, peak=8.0))
    assert server.calls == [4.0, 8.0] and all(e["status"] == AT_MAX and e["goodput"] == 8.0 for e in out.goodput)


def test_search_brackets_every_target_coarsely_before_refining_any() -> None:
    server = FakeServer(capacity=10.0)
    out = run_search(server, SearchConfig(max_probes=12, discard=D), start=5.0)
    assert len(out.probes) == 12 and out.stopped is not None
    for e in out.goodput:  # a bracket around every frontier, though none is within 5% yet
        true = server.frontier(Target(e["itl_bound_ms"], e["share"]))
        assert e["status"] == UNFINISHED and e["lo"] <= true < e["hi"] <= e["lo"] * 1.5, e
    assert sum(e["hi"] <= e["lo"] * 1.25 + 1e-9 for e in out.goodput) >= 8  # most within the coarse 25%


def test_search_stops_at_max_probes_with_the_bracket_so_far() -> None:
    server = FakeServer(capacity=10.0)
    out = run_search(server, SearchConfig(max_probes=3, discard=D), start=5.0)
    assert server.calls == [5.0, 10.0, 20.0] and "3 probes" in (out.stopped or "")
    unbounded = out.goodput[0]
    assert (unbounded["status"], unbounded["lo"], unbounded["hi"]) == (UNFINISHED, 10.0, 20.0)
    assert len(out.goodput) == 10 and all(e["status"] == UNFINISHED for e in out.goodput)  # nothing settled yet


def test_search_stops_before_a_probe_that_would_pass_the_deadline() -> None:
    server = FakeServer(capacity=10.0)
    out = run_search(server, SearchConfig(max_probes=60, discard=D), start=5.0, deadline=60.0)
    # 5 req/s: 12 s + 1; 10: 7; 20: 4 -> 24 s; then bisections until the next would end after 60 s
    assert out.stopped is not None and "time budget" in out.stopped and server.now <= 60.0
    assert server.calls[:3] == [5.0, 10.0, 20.0]
    for e in out.goodput:
        true = server.frontier(Target(e["itl_bound_ms"], e["share"]))
        assert e["status"] in (CONVERGED, UNFINISHED, BELOW_MIN)
        if e["status"] == UNFINISHED:  # the frontier lies in its bracket so far
            assert (e["lo"] or 0.0) <= true and (e["hi"] is None or true < e["hi"]), e
    assert any(e["status"] == UNFINISHED for e in out.goodput)


def test_a_probe_too_long_for_the_budget_leaves_its_target_not_the_others() -> None:
    server = FakeServer(capacity=10.0)
    scfg = SearchConfig(itl_bounds_ms=(5.0,), shares=(0.9,), max_probes=60, discard=D)
    out = run_search(server, scfg, start=5.0, deadline=38.0)
    # after 5, 10, 20 (~20 s) the 5 ms target, the widest ([min, 5)), wants 2.5 req/s (~20 s): it never fits; the
    # unbounded one is still refined past it while its probes fit
    assert 2.5 not in server.calls and server.calls[:5] == [5.0, 10.0, 20.0, 15.0, 12.5] and server.now <= 38.0
    unbounded, tight = out.goodput
    assert unbounded["status"] == UNFINISHED and unbounded["lo"] == 10.0 and unbounded["hi"] <= 12.5
    assert (tight["status"], tight["lo"], tight["hi"]) == (UNFINISHED, None, 5.0)
    assert out.stopped is not None and "time budget" in out.stopped


def test_the_widest_bracket_is_refined_first() -> None:
    # the 2 x H200 case (2026-11-30): with few probes, the tight bound must not stay [0, x) while every probe goes
    # to the loose one: each probe goes to the target whose bracket is widest in log terms
    server = FakeServer(capacity=10.0)
    scfg = SearchConfig(itl_bounds_ms=(20.0,), shares=(0.9,), max_probes=6, discard=D)  # frontiers 10, 1.75
    out = run_search(server, scfg, start=5.0)
    unbounded, tight = out.goodput
    assert tight["lo"] is not None and unbounded["lo"] is not None  # both brackets closed on both sides
    widths = [math.log(e["hi"] / e["lo"]) for e in (unbounded, tight)]
    assert max(widths) < math.log(2.0) + 1e-9, (server.calls, out.goodput)  # loosest first: [10, 12.5), [0, 2.5)


@pytest.mark.parametrize(("lo", "hi", "width"), [
    (10.0, 12.0, math.log(1.2)),
    (None, 8.0, math.log(8.0 / 0.5)),  # no pass yet: from the search's min rate
    (8.0, None, math.log(16.0 / 8.0)),  # no failure yet: to its max rate
    (None, None, math.log(16.0 / 0.5)),
    (12.0, 12.0, 0.0),
    (None, 0.5, 0.0),  # the min rate failed: nothing left below
    (16.0, None, 0.0),  # the max rate passed: nothing left above
])
def test_bracket_width(lo: float | None, hi: float | None, width: float) -> None:
    assert bracket_width(Bracket(lo, hi), 0.5, 16.0) == pytest.approx(width)


@pytest.mark.parametrize(("brackets", "order"), [
    ([(None, 12.0, 13.0), (50.0, None, 8.49)], [50.0, None]),  # the 4096:64 case: [0, 8.49) before [12, 13)
    ([(None, 10.0, 12.0), (50.0, 10.0, 12.0)], [None, 50.0]),  # a tie: the given (loosest-first) order
    ([(None, 8.0, 16.0), (100.0, 4.0, 5.0), (50.0, 1.0, 4.0)], [50.0, None, 100.0]),
])
def test_widest_first(brackets: list[tuple[float | None, float | None, float | None]],
                      order: list[float | None]) -> None:
    got = widest_first([(Target(b, 0.9), Bracket(lo, hi)) for b, lo, hi in brackets], 0.5, 16.0)
    assert [t.itl_bound_ms for t in got] == order


@pytest.mark.parametrize("only,capacity", [
    ((None,), 10.0), ((200.0,), 10.0), ((100.0,), 10.0), ((50.0,), 10.0), ((25.0,), 10.0), ((5.0,), 10.0),
    ((25.0,), 3.0),  # the bound passes up to the capacity, where the TTFT rule fails
    ((50.0, None), 10.0),
])
def test_a_search_for_some_bounds_stops_when_their_brackets_close(only: tuple[float | None, ...],
                                                                  capacity: float) -> None:
    """A policy run with its ITL SLO at one bound is searched at that bound only: its probes follow that bound's
    targets and stop on the probe that closes their brackets (fewer than the every-bound search, same answer);
    the other bounds are scored but reported not searched."""
    bounds = (5.0, 25.0, 50.0, 100.0, 200.0)
    full_server, server = FakeServer(capacity), FakeServer(capacity)
    full = run_search(full_server, SearchConfig(itl_bounds_ms=bounds, max_probes=60, discard=D), start=5.0)
    scfg = SearchConfig(itl_bounds_ms=bounds, max_probes=60, discard=D, only_bounds=only)
    scfg.check(N)
    out = run_search(server, scfg, start=5.0)
    assert out.stopped is None and len(out.goodput) == 12 and len(server.calls) < len(full_server.calls)
    mine = scfg.searched()

    def settled(probes: Sequence[Probe]) -> bool:
        return all(next_step(bracket(probes, t), 5.0, out.min_rate, out.max_rate, 0.05).rate is None for t in mine)

    assert settled(out.probes) and not settled(out.probes[:-1])  # the last probe closed them: no probe after
    full_by = {(e["itl_bound_ms"], e["share"]): e for e in full.goodput}
    for e in out.goodput:
        t = Target(e["itl_bound_ms"], e["share"])
        if t not in mine:
            assert e["status"] == NOT_SEARCHED, e
            continue
        assert e["status"] in (CONVERGED, AT_MAX, BELOW_MIN), e
        true = server.frontier(t)
        if e["status"] == CONVERGED:
            assert e["lo"] <= true < e["hi"] <= e["lo"] * 1.05, (t, true, e)
        assert e["status"] == full_by[(t.itl_bound_ms, t.share)]["status"]
        assert abs(e["goodput"] - full_by[(t.itl_bound_ms, t.share)]["goodput"]) <= 0.05 * max(true, 1.0)


def test_pooled_sums_two_probes_of_a_rate() -> None:
    a = Probe(6.0, 32, {"unbounded": 32, "50": 12})
    b = Probe(6.0, 32, {"unbounded": 31, "50": 32, "25": 3})
    p = pooled(a, b)
    assert (p.rate, p.n, dict(p.attained)) == (6.0, 64, {"unbounded": 63, "50": 44, "25": 3})
    assert passes(p, Target(None, 0.9)) and not passes(p, Target(50.0, 0.9))  # 44/64 = 69%
    grew, steady = Backlog(0.2, 0.8, 1.4, 64), Backlog(0.2, 0.25, 0.3, 64)
    above = [Probe(9.0, 96, {"unbounded": 96}, True, g) for g in (grew, steady)]
    assert pooled(above[0], above[1]).backlog == steady  # grew in one of two: not a backlog that grew
    assert pooled(above[1], above[0]).backlog == steady
    assert pooled(above[0], above[0]).backlog_grew  # grew in both


@pytest.mark.parametrize(("probes", "made", "want"), [
    ([P(2, True), P(4, False), P(6, True)], {2: 1, 4: 1, 6: 1}, 4),  # a failure below a pass: probe it again
    ([P(2, True), P(4, False), P(6, True)], {2: 1, 4: 2, 6: 1}, None),  # probed twice already: it stands
    ([P(2, True), P(4, True), P(6, False)], {2: 1, 4: 1, 6: 1}, None),  # consistent
    ([P(2, False), P(4, False)], {2: 1, 4: 1}, None),  # nothing passed above the failure
    ([P(4, True), P(8, True)], {4: 1, 8: 1}, None),  # nothing failed
    ([P(2, True), P(4, False), P(6, False), P(8, True)], {2: 1, 4: 1, 6: 1, 8: 1}, 4),  # the lowest failure first
])
def test_contradicted(probes: list[Probe], made: dict[float, int], want: float | None) -> None:
    assert contradicted(probes, T, made) == want


class NoisyServer(FakeServer):
    """FakeServer (capacity 10, gaps of 2 ms per req/s: every request within 50 ms up to 12.5 req/s), except that the
    first probe at each rate in `spurious` has every gap at 200 ms (a short probe's noise: a stall at the wrong
    moment; its TTFTs are fine); a second probe there sees the true server."""

    def __init__(self, spurious: set[float]) -> None:
        super().__init__(capacity=10.0, slope=0.002)
        self.spurious = set(spurious)

    def records(self, rate: float, n: int = N) -> list[RequestRecord]:
        if rate in self.spurious:
            self.spurious.discard(rate)
            return [rec(prompt=100, ttft=0.2, itl=(0.2,) * 8, index=i, at=i / rate, e2e=0.3) for i in range(n)]
        return super().records(rate, n)


@pytest.mark.parametrize(("share", "settles"), [(0.5, True), (0.9, False)])
def test_a_failure_below_a_pass_is_probed_again_and_pooled(share: float, settles: bool) -> None:
    """The unbounded target's probes climb past 5 req/s (5 passes it: TTFTs are fine) to the capacity, 10; the 50-ms
    target then sees 5 fail (the spurious probe) below 10 passing, and probes 5 once more. Pooled, half of 5's
    requests are within 50 ms: at a share of 0.5 the pool passes and the bracket settles at the capacity (the true
    frontier); at 0.9 it still fails and stands (conservative), probed no third time."""
    server = NoisyServer(spurious={5.0})
    out = run_search(server, SearchConfig(itl_bounds_ms=(50.0,), shares=(share,), max_probes=30, discard=D), 5.0)
    assert server.calls.count(5.0) == 2 and all(server.calls.count(r) == 1 for r in server.calls if r != 5.0)
    assert [w for r, w in zip(server.calls, server.whys, strict=True) if r == 5.0] == ["", AGAIN]  # said so
    assert server.whys.count(AGAIN) == 1
    assert len(out.probes) == len(server.calls)  # each run reported, the repeat too
    by = {e["itl_bound_ms"]: e for e in out.goodput}
    assert by[None]["lo"] <= 10.0 < by[None]["hi"]
    if settles:
        assert by[50.0]["status"] == CONVERGED and by[50.0]["lo"] <= 10.0 < by[50.0]["hi"], by[50.0]
    else:
        assert by[50.0]["hi"] == 5.0 and (by[50.0]["lo"] is None or by[50.0]["lo"] < 5.0), by[50.0]


@pytest.mark.parametrize(("kw", "peak", "want"), [
    ({}, 391.07, 196.0),  # half the closed-loop peak
    ({"max_rate": 40.0}, 391.07, 40.0),  # never above the ceiling asked for (it was: the start became the ceiling)
    ({"min_rate": 30.0}, 20.0, 30.0),  # nor below the floor asked for
    ({"start_fraction": 0.25}, 8.0, 2.0),
])
def test_a_search_starts_within_its_given_limits(kw: dict[str, float], peak: float, want: float) -> None:
    scfg = SearchConfig(**kw)  # type: ignore[arg-type]
    start = start_from_peak(scfg, peak)
    assert start == want
    lo, hi = scfg.limits(start, peak)
    assert lo <= start <= hi and (scfg.max_rate is None or hi == scfg.max_rate)


@pytest.mark.parametrize(("b", "waypoint", "want"), [
    (Bracket(15.7, None), None, 31.5),  # 31.4 lies within 5% of the ceiling: the ceiling itself
    (Bracket(10.0, None), None, 20.0),  # 20 is far from it
    (Bracket(15.7, None), 31.5, 31.5),  # the waypoint (the peak) within 5% of the doubled rate
    (Bracket(4.0, None), 31.5, 8.0),
    (Bracket(20.0, None), 31.5, 31.5),  # capped at the waypoint
    (Bracket(31.5, None), 31.5, 40.0),  # past the waypoint: on to the ceiling (63 > 40)
])
def test_a_step_within_the_tolerance_of_the_ceiling_or_waypoint_probes_it(b: Bracket, waypoint: float | None,
                                                                         want: float) -> None:
    top = 31.5 if waypoint is None else 40.0
    step = next_step(b, start=5.0, min_rate=1.0, max_rate=top, tolerance=0.05, waypoint=waypoint)
    assert step == (want, "")


@pytest.mark.parametrize(("errors", "says"), [
    ({"HTTP 400: 'prompt' holds 15387: token ids must be integers in [0, 1280)": 10, "(2 other error texts)": 2},
     "--token-range"),  # every request refused: the workload does not fit the server
    ({"ClientConnectorError: connection refused": 12}, "--search-start-rate"),
    ({"HTTP 400: bad": 3, "TimeoutError": 9}, "--search-start-rate"),
    ({}, "--search-start-rate"),
])
def test_a_closed_loop_probe_that_completed_none_says_what_to_do(errors: dict[str, int], says: str) -> None:
    assert says in no_peak_advice(errors)


@pytest.mark.parametrize("share,counted,want", [
    (0.9, 32, 3), (0.9, 10, 1), (0.99, 32, 0), (0.99, 100, 1), (0.99, 64, 0), (1.0, 50, 0), (0.5, 7, 3), (0.9, 0, 0),
])
def test_misses_allowed_matches_passes(share: float, counted: int, want: int) -> None:
    assert misses_allowed(share, counted) == want
    if counted:  # exactly `want` misses pass, one more fails
        t = Target(50.0, share)
        assert passes(Probe(1.0, counted, {bound_key(50.0): counted - want}), t)
        assert want == counted or not passes(Probe(1.0, counted, {bound_key(50.0): counted - want - 1}), t)


@pytest.mark.parametrize("share,counted,want", [
    (0.9, [32], None),
    (0.99, [32, 64], "with 32-64 requests counted a probe, 99% allows no miss"),
    (0.99, [32], "with 32 requests counted a probe, 99% allows no miss"),
    (0.99, [32, 128], None),  # the longer probes allow one
    (1.0, [32], None),  # every request is what 100% asks for
    (0.99, [], None),
])
def test_share_note(share: float, counted: list[int], want: str | None) -> None:
    got = share_note(share, counted)
    assert (got is None) == (want is None) and (want is None or (got or "").startswith(want))



def test_the_closed_loop_peak_is_in_the_unit_of_the_rates() -> None:
    """A multi-turn probe's rate counts conversations and its summary counts their turns: the closed-loop peak the
    search starts from and is capped by is turns/s over the turns (2 x H200, 2026-11-30: 35.3 turns/s of 6-turn
    conversations had been read as 35.3 conversations/s)."""
    from dataclasses import replace

    from rapidserve.benchmark.runner import BenchConfig
    from rapidserve.benchmark.search_run import arrival_turns, closed_peak
    from rapidserve.benchmark.workloads import WorkloadSpec

    run = {"summary": {"completed": 288, "request_throughput": 35.28}}
    assert closed_peak(run) == 35.28 and closed_peak(run, 6) == pytest.approx(5.88)
    assert closed_peak({"summary": {"completed": 0, "request_throughput": 0.0}}, 6) is None
    cfg = BenchConfig()
    assert arrival_turns(cfg) == 1
    assert arrival_turns(replace(cfg, workload=WorkloadSpec(name="multiturn", num_turns=6))) == 6
    assert arrival_turns(replace(cfg, workload=WorkloadSpec(name="fixed", num_turns=6))) == 1


@pytest.mark.parametrize("b,hint,want", [
    (Bracket(None, None), (9.97, 12.0), (9.97, "")),  # nothing probed: the earlier lo
    (Bracket(None, None), (None, 12.0), (6.0, "")),  # only an upper end known: below it
    (Bracket(None, None), (0.5, 12.0), (1.25, "")), (Bracket(None, None), (90.0, None), (40.0, "")),  # within limits
    (Bracket(9.97, None), (9.97, 12.0), (12.0, "")),  # it passed: the earlier hi, not 2 x lo
    (Bracket(12.0, None), (9.97, 12.0), (24.0, "")),  # the earlier hi passed too: growth as without a hint
    (Bracket(None, 9.0), (3.41, 6.81), (3.41, "")),  # everything failed: the earlier lo, not hi / 2
    (Bracket(None, 3.0), (3.41, 6.81), (1.5, "")),  # the earlier lo failed too: halve as without it
    (Bracket(9.97, 12.0), (9.97, 12.0), (11.0, "")), (Bracket(4, 4.19), (1.0, 9.0), (None, CONVERGED)),  # bisect
    (Bracket(40, None), (9.97, 50.0), (None, AT_MAX)), (Bracket(None, 1.25), (3.41, 6.81), (None, BELOW_MIN)),
])
def test_next_step_from_an_earlier_bracket(b: Bracket, hint: tuple[float | None, float | None],
                                           want: tuple[float | None, str]) -> None:
    assert tuple(next_step(b, start=5.0, min_rate=1.25, max_rate=40.0, tolerance=0.05, hint=hint)) == want


@pytest.mark.parametrize("capacity,hint_scale", [(10.0, 1.0), (10.0, 0.8), (10.0, 1.25), (3.0, 1.0)])
def test_a_search_from_earlier_brackets_settles_sooner_and_right_where_they_moved(capacity: float,
                                                                                 hint_scale: float) -> None:
    """The earlier search's brackets (the true frontier, then moved by hint_scale as between sessions) make the search
    converge in no more probes than from scratch, and to the same truth."""
    scfg = SearchConfig(itl_bounds_ms=(50.0, 100.0), shares=(0.9,), max_probes=40, discard=D)
    scratch_server = FakeServer(capacity=capacity)
    scratch = run_search(scratch_server, scfg, start=5.0)
    assert scratch.stopped is None
    hints = tuple((t.itl_bound_ms, t.share, round_rate(scratch_server.frontier(t) * hint_scale * 0.97),
                   round_rate(scratch_server.frontier(t) * hint_scale * 1.1)) for t in scfg.searched())
    server = FakeServer(capacity=capacity)
    hinted = run_search(server, dataclasses.replace(scfg, hints=hints), start=5.0)
    assert hinted.stopped is None and len(server.calls) <= len(scratch_server.calls)
    if hint_scale == 1.0:
        assert len(server.calls) < len(scratch_server.calls)
    for e in hinted.goodput:
        true = server.frontier(Target(e["itl_bound_ms"], e["share"]))
        assert e["status"] == CONVERGED and e["lo"] <= true < e["hi"] <= e["lo"] * 1.05, (e, true)


def test_hints_are_checked() -> None:
    SearchConfig(hints=((None, 0.9, 3.0, 4.0), (50.0, 0.9, None, 2.0))).check()
    for bad in ((None, 0.9, 4.0, 3.0), (None, 0.9, -1.0, None), (None, 0.9, None, math.inf)):
        with pytest.raises(ValueError, match="--search-start-from: the earlier bracket .* is no bracket"):
            SearchConfig(hints=(bad,)).check()
    assert SearchConfig(hints=((50.0, 0.9, 3.0, 4.0),)).hint(Target(50.0, 0.9)) == (3.0, 4.0)
    assert SearchConfig(hints=((50.0, 0.9, 3.0, 4.0),)).hint(Target(50.0, 0.99)) is None
    assert SearchConfig().hint(Target(None, 0.9)) is None


def test_one_more_probe_at_the_ttft_rate_after_the_search_and_no_bracket_reads_it() -> None:
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), max_probes=40, discard=D)
    plain_server = FakeServer(capacity=10.0)
    plain = run_search(plain_server, scfg, start=5.0)
    server = FakeServer(capacity=10.0)
    out = run_search(server, dataclasses.replace(scfg, ttft_rate=7.77), start=5.0)
    assert server.calls == [*plain_server.calls, 7.77] and server.whys[-1] == "ttft"
    assert out.goodput == plain.goodput and out.probes[-1].rate == 7.77  # reported among the probes, read by none
    again = FakeServer(capacity=10.0)
    run_search(again, dataclasses.replace(scfg, ttft_rate=plain_server.calls[1]), start=5.0)  # the search probed it
    assert again.calls == plain_server.calls
    budget = sum(N / r + 1.0 for r in plain_server.calls) + 1.0  # the whole search's time, no more
    late = FakeServer(capacity=10.0)  # the TTFT probe's time is kept from the search's probes: it still runs
    run_search(late, dataclasses.replace(scfg, ttft_rate=7.77), start=5.0, deadline=budget)
    assert late.calls[-1] == 7.77 and late.whys[-1] == "ttft" and late.now <= budget
    assert late.calls[:3] == plain_server.calls[:3] and 7.77 not in late.calls[:-1]
    assert sum(N / r + 1.0 for r in late.calls[:-1]) < budget - (N / 7.77 + 1.0)  # the search gave up what it needed
    never = FakeServer(capacity=10.0)  # a TTFT probe longer than the whole budget: nothing kept, and not run
    run_search(never, dataclasses.replace(scfg, ttft_rate=0.01), start=5.0, deadline=budget)
    assert never.calls == plain_server.calls
    with pytest.raises(ValueError, match="--search-ttft-rate -1"):
        SearchConfig(ttft_rate=-1.0).check()


def test_a_search_probe_at_the_ttft_rate_keeps_no_time_for_itself() -> None:
    """A search probe at the --search-ttft-rate serves as the TTFT probe (none runs after it): no time is kept from
    it for a TTFT probe there. 5 req/s (~13 s), then 10 (~7 s) end at 20 s, within 20.5; keeping 10's own ~7 s had
    cut it, and the TTFT probe then ran at 10 all the same, read by no bracket."""
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), max_probes=40, discard=D)
    plain = FakeServer(capacity=10.0)
    run_search(plain, scfg, start=5.0, deadline=20.5)
    server = FakeServer(capacity=10.0)
    out = run_search(server, dataclasses.replace(scfg, ttft_rate=10.0), start=5.0, deadline=20.5)
    assert server.calls == plain.calls == [5.0, 10.0] and server.whys == ["", ""]
    assert (out.goodput[0]["lo"], out.goodput[0]["hi"]) == (10.0, None)


def test_the_ttft_probe_never_takes_the_search_s_first_probe() -> None:
    """Where the budget fits the search's first probe (5 req/s, ~12 s of 15) but not it and the TTFT probe (~8 s), the
    search runs its probe, as without --search-ttft-rate, and the TTFT probe is the one left out: a search of no
    probe settles nothing (keeping the TTFT probe's time from the first had left every target [None, None))."""
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), max_probes=40, discard=D)
    plain = FakeServer(capacity=10.0)
    want = run_search(plain, scfg, start=5.0, deadline=15.0)
    server = FakeServer(capacity=10.0)
    out = run_search(server, dataclasses.replace(scfg, ttft_rate=7.77), start=5.0, deadline=15.0)
    assert server.calls == plain.calls == [5.0] and server.whys == [""]
    assert out.goodput == want.goodput and out.goodput[0]["lo"] == 5.0 and out.stopped == want.stopped


def test_a_probe_cut_for_the_ttft_probe_says_so() -> None:
    """A probe that would end within the budget but not before the time kept for the TTFT probe is not said to end
    after the budget alone: 10 req/s (~7 s) at 13 s ends at 20 s, within 26 s but not within 26 less the TTFT probe's
    ~9 s (7.77 req/s: 60 / 7.77 + 1 s), which then runs."""
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), max_probes=40, discard=D, only_bounds=(None,),
                        ttft_rate=7.77)
    server = FakeServer(capacity=10.0)
    out = run_search(server, scfg, start=5.0, deadline=26.0)
    assert server.calls == [5.0, 7.77] and server.whys == ["", "ttft"]
    assert out.stopped == ("the time budget: a probe at 10 req/s (~7 s) would end after it, less the ~9 s kept for "
                           "the --search-ttft-rate probe at 7.77 req/s")
