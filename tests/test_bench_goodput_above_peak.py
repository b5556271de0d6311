"""A goodput search above the server's own closed-loop peak (rapidserve/benchmark/sustain.py, backlog.py, goodput.py):
the longer probes' arrivals, the backlog rule, the ceiling and the waypoint (pure, table-tested), and the search
against two server models: one that sustains more than its closed-loop peak (a server with an ITL SLO) and one that
does not (the search must settle above the peak for the first, and not be fooled by the second once probes are long)."""

from __future__ import annotations

import asyncio
import math
import random
import re

import pytest

from rapidserve.benchmark.backlog import MIN_TREND_REQUESTS, Backlog, backlog_trend
from rapidserve.benchmark.goodput import (
    AT_MAX,
    CONVERGED,
    MAX_RATE,
    OWN_PEAK,
    SHARED_PEAK,
    START_X8,
    Bracket,
    Ceiling,
    Target,
    measure_probe,
    next_step,
    passes,
    ttft_usage,
)
from rapidserve.benchmark.goodput_report import backlog_cell, search_block, search_markdown
from rapidserve.benchmark.search import Outcome, search_frontier
from rapidserve.benchmark.search_config import SearchConfig
from rapidserve.benchmark.stats import RequestRecord
from rapidserve.benchmark.sustain import probe_arrivals
from rapidserve.cli import main


@pytest.mark.parametrize("n,discard,factor,want", [
    (80, 16, None, 80), (80, 16, 1.0, 80),  # the default: as long as the others
    (80, 16, 2.0, 144), (80, 16, 1.5, 112), (48, 16, 4.0, 144),  # F x the counted, the warm-up unchanged
    (10, 0, 2.5, 25), (17, 16, 3.0, 19), (10, 3, 1.1, 11),  # rounded up: 7.7 counted -> 8
])
def test_probe_arrivals(n: int, discard: int, factor: float | None, want: int) -> None:
    assert probe_arrivals(n, discard, factor) == want


def ramp(lo: float, hi: float, m: int = 32) -> list[float]:
    return [lo + (hi - lo) * i / (m - 1) for i in range(m)]


@pytest.mark.parametrize("usage,first,last,projected,grew", [
    ([0.1] * 16, 0.1, 0.1, 0.1, False),  # steady
    (ramp(0.1, 0.6), 0.15645, 0.54355, 1.0597, True),  # one more probe length puts the median over its limit
    (ramp(0.1, 0.4), 0.13387, 0.36613, 0.67581, False),  # growing, but not so fast: within the rule's margin
    (ramp(0.01, 0.03), 0.012258, 0.027742, 0.048387, False),  # TTFT doubled, from 1% of its limit: no overload
    ([0.1] * 31 + [50.0], 0.1, 0.1, 0.1, False),  # one stall at the end: a median does not see it
    ([0.1] * 24 + [math.inf] * 8, 0.1, math.inf, math.inf, True),  # the last quarter failed: no first token
    ([math.inf] * 8 + [0.2] * 24, math.inf, 0.2, 0.2, False),  # failures early on, none later: no growth
    (ramp(0.9, 0.2), 0.82097, 0.27903, 0.27903, False),  # a falling trend projects its last level
    ([0.5] * MIN_TREND_REQUESTS, 0.5, 0.5, 0.5, False),  # the fewest judged: quarters of 2
])
def test_backlog_trend(usage: list[float], first: float, last: float, projected: float, grew: bool) -> None:
    b = backlog_trend(usage)
    assert b is not None and b.requests == len(usage) and b.grew is grew
    assert (b.first, b.last, b.projected) == pytest.approx((first, last, projected), rel=1e-4)


@pytest.mark.parametrize("growth,grew", [(0.0, False), (0.09, False), (0.11, True), (0.2, True)])
def test_the_backlog_rules_resolution(growth: float, grew: bool) -> None:
    """backlog.py's resolution: TTFT = 0.3 s + growth x t over T = 20 s of counted arrivals against a 4 s limit fires
    for growth > (4 - 0.3) / (1.875 x 20) = 0.099 s per s, while every one of these passes attainment at 90% (the
    steepest puts 7.5% of its requests over 4 s)."""
    usage = [(0.3 + growth * i * 0.1) / 4.0 for i in range(200)]
    b = backlog_trend(usage)
    assert b is not None and b.grew is grew and sum(u > 1.0 for u in usage) <= 0.1 * len(usage)


def test_backlog_trend_needs_enough_requests() -> None:
    assert backlog_trend([5.0] * (MIN_TREND_REQUESTS - 1)) is None
    b = Backlog(0.05, 0.31, math.inf, 64)
    assert b.to_json() == {"first": 0.05, "last": 0.31, "projected": None, "requests": 64, "grew": True}
    assert b.describe() == "TTFT/limit 0.05 -> 0.31, projected inf: GREW (fails every target)"


def rec(i: int, ttft: float, at: float, prompt: int = 4000, ok: bool = True) -> RequestRecord:
    return RequestRecord(i, prompt, 9, scheduled_s=at, start_s=at, success=ok, output_tokens=9 if ok else 0,
                         ttft_s=ttft if ok else math.nan, e2e_s=ttft + 0.08, itl_s=[0.01] * 8 if ok else [])


def test_ttft_usage() -> None:
    assert ttft_usage(rec(0, 2.0, 0.0)) == 0.5 and ttft_usage(rec(0, 0.5, 0.0, prompt=100)) == 0.5  # the 1 s floor
    assert ttft_usage(rec(0, 0.5, 0.0, ok=False)) == math.inf


def test_a_probe_above_the_peak_fails_every_target_when_its_backlog_grew() -> None:
    # every request within its 4 s TTFT limit (attainment 100%), but its TTFT climbing 0.3 s -> 3.4 s over the probe;
    # the records come back out of arrival order (their scheduled times order them)
    records = [rec(i, 0.3 + 0.1 * i, 0.1 * i) for i in range(32)]
    shuffled = records[1::2] + records[::2]
    t = Target(50.0, 0.9)
    below = measure_probe(8.0, shuffled, [None, 50.0], discard=0)
    above = measure_probe(8.0, shuffled, [None, 50.0], discard=0, above_peak=True)
    assert below.backlog is None and passes(below, t) and passes(below, Target(None, 0.99))
    assert above.above_peak and above.attainment(50.0) == 1.0
    assert above.backlog is not None and above.backlog.grew and above.backlog.first == pytest.approx(0.65 / 4)
    assert not passes(above, t) and not passes(above, Target(None, 0.5))
    steady = measure_probe(8.0, [rec(i, 0.3, 0.1 * i) for i in range(32)], [None], discard=4, above_peak=True)
    assert steady.backlog is not None and not steady.backlog.grew and steady.backlog.requests == 28
    assert passes(steady, Target(None, 0.99))


@pytest.mark.parametrize("kw,start,peak,shared,want", [
    ({}, 4.0, 8.123, None, Ceiling(8.12, OWN_PEAK)),  # by default: the closed-loop peak
    ({}, 4.0, 8.123, 12.34, Ceiling(12.3, SHARED_PEAK)),  # a comparison's higher peak
    ({}, 4.0, 8.123, 8.12, Ceiling(8.12, OWN_PEAK)),  # the same once rounded: its own
    ({}, 4.0, 8.123, 5.0, Ceiling(8.12, OWN_PEAK)),  # a lower one: its own
    ({"max_rate": 20.0}, 4.0, 8.0, 12.0, Ceiling(20.0, MAX_RATE)),  # given: it wins
    ({"max_rate": 6.0}, 4.0, 8.0, None, Ceiling(6.0, MAX_RATE)),  # even below the peak
    ({}, 4.0, None, None, Ceiling(32.0, START_X8)),  # a given start rate, no peak measured
    ({"max_rate": 3.0}, 4.0, 8.0, None, Ceiling(4.0, MAX_RATE)),  # never below the start
])
def test_ceiling(kw: dict[str, float], start: float, peak: float | None, shared: float | None, want: Ceiling) -> None:
    scfg = SearchConfig(**kw)  # type: ignore[arg-type]
    assert scfg.ceiling(start, peak, shared) == want and scfg.limits(start, peak, shared)[1] == want.rate


@pytest.mark.parametrize("b,max_rate,waypoint,want", [
    (Bracket(4.0, None), 20.0, 8.57, 8.0),  # doubling below the waypoint, as without it
    (Bracket(4.29, None), 20.0, 8.57, 8.57),  # a doubling past the peak stops at it first
    (Bracket(8.57, None), 20.0, 8.57, 17.1),  # then on above it
    (Bracket(8.57, None), 12.0, 8.57, 12.0),  # up to the ceiling
    (Bracket(12.0, None), 12.0, 8.57, None),  # which passed: AT_MAX
    (Bracket(8.57, 17.1), 20.0, 8.57, 12.8),  # bisection is unchanged
    (Bracket(4.29, None), 20.0, None, 8.58),  # no waypoint: plain doubling
])
def test_next_step_passes_through_the_waypoint(b: Bracket, max_rate: float, waypoint: float | None,
                                               want: float | None) -> None:
    step = next_step(b, 4.0, 1.0, max_rate, 0.05, waypoint=waypoint)
    assert step.rate == want and (want is not None or step.status == AT_MAX)


def test_search_config_above_the_peak() -> None:
    scfg = SearchConfig(discard=16, above_peak_factor=4.0, max_rate=20.0)
    assert scfg.waypoint(20.0, 8.571) == 8.57 and scfg.waypoint(8.57, 8.571) is None
    assert scfg.waypoint(20.0, None) is None
    assert [scfg.above_peak(r, 8.571) for r in (4.0, 8.57, 8.58, 12.0)] == [False, False, True, True]
    assert scfg.arrivals(8.57, 48, 8.571) == 48 and scfg.arrivals(12.0, 48, 8.571) == 16 + 4 * 32
    assert scfg.arrivals(12.0, 48, None) == 48  # no peak measured: nothing is above it
    with pytest.raises(ValueError, match="--search-above-peak-factor 0.5: give a factor >= 1"):
        SearchConfig(above_peak_factor=0.5).check()
    with pytest.raises(ValueError, match="--search-above-peak-factor lengthens .* --search-start-rate"):
        SearchConfig(above_peak_factor=2.0, start_rate=4.0).check()
    SearchConfig(above_peak_factor=1.0, start_rate=4.0).check()  # 1: nothing to lengthen, nothing to refuse


# ---------------------------------------------------------------- the search against server models

N, D = 60, 10  # arrivals per probe at or below the peak, warm-up discarded


class Server:
    """A server model: closed-loop peak `peak` (what the search is told), sustained Poisson rate `sustained`. At rate
    r each request's gaps are 10 ms and its TTFT is `base` x a noise factor in [0.5, 1.5) (seeded by the rate), plus,
    above the sustained rate, the backlog's growth: (r - sustained) / sustained s of waiting for every second since
    the probe began. 4000-token prompts: a 4 s TTFT limit. Each probe advances a fake clock by its span plus 1 s."""

    def __init__(self, peak: float, sustained: float, base: float = 0.3) -> None:
        self.peak, self.sustained, self.base = peak, sustained, base
        self.calls: list[tuple[float, int]] = []
        self.now = 0.0

    def records(self, rate: float, n: int) -> list[RequestRecord]:
        rng = random.Random(round(rate * 1000))
        growth = max(0.0, (rate - self.sustained) / self.sustained)
        out, at = [], 0.0
        for i in range(n):
            at += rng.expovariate(rate)
            out.append(rec(i, self.base * (0.5 + rng.random()) + growth * at, at))
        return out

    async def measure(self, rate: float, n: int, why: str = "") -> list[RequestRecord]:
        self.calls.append((rate, n))
        self.now += n / rate + 1.0
        return self.records(rate, n)


def search(server: Server, factor: float | None, max_rate: float | None = 16.0,
           shared_peak: float | None = None) -> Outcome:
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=D, max_probes=40, max_rate=max_rate,
                        above_peak_factor=factor)
    return asyncio.run(search_frontier(server.measure, scfg, server.peak / 2, N, clock=lambda: server.now,
                                       peak=server.peak, shared_peak=shared_peak))


def settled(out: Outcome) -> tuple[str, float, float | None]:
    statuses = {(e["status"], e["lo"], e["hi"]) for e in out.goodput}
    assert len(statuses) == 1  # ITL is never the limit here: every target settles alike
    return statuses.pop()


def test_by_default_the_search_stops_at_the_closed_loop_peak() -> None:
    server = Server(peak=8.0, sustained=12.0)
    out = search(server, factor=4.0, max_rate=None)
    assert server.calls == [(4.0, N), (8.0, N)] and settled(out) == (AT_MAX, 8.0, None)  # ">= 8": a floor
    assert out.ceiling == Ceiling(8.0, OWN_PEAK) and not any(p.above_peak for p in out.probes)


@pytest.mark.parametrize("max_rate,shared_peak", [(16.0, None), (None, 16.0)])  # --search-max-rate, a shared peak
def test_a_server_that_sustains_more_than_its_peak_settles_above_it(max_rate: float | None,
                                                                    shared_peak: float | None) -> None:
    server = Server(peak=8.0, sustained=12.0)
    out = search(server, factor=4.0, max_rate=max_rate, shared_peak=shared_peak)
    assert out.ceiling == Ceiling(16.0, MAX_RATE if max_rate else SHARED_PEAK)
    long = D + 4 * (N - D)
    assert server.calls[:3] == [(4.0, N), (8.0, N), (16.0, long)]  # today's probes up to the peak, then long ones
    # every probe above the peak counts 4 x the others' counted arrivals, after the ramp rule's warm-up (the discard,
    # or more where the lifetime measured below asks for it: 13.5 req/s after 13's 1.0 s)
    assert [p.ramp.plan.wanted for p in out.probes if p.ramp] == [4 * (N - D) if p.rate > 8.0 else N - D
                                                                   for p in out.probes]
    assert [(p.rate, p.ramp.plan.sent) for p in out.probes if p.ramp] == server.calls
    assert all(p.ramp.plan.warmup >= D and not p.ramp.short for p in out.probes if p.ramp)
    status, lo, hi = settled(out)
    # the sustained 12 req/s, found above the closed-loop peak 8; at most the rule's margin over it (sustain.py:
    # g <= (4 - 0.45) / (1.875 x ~15 s) here)
    assert status == CONVERGED and 12.0 <= lo <= 12.0 * 1.15 and hi is not None and hi <= lo * 1.05
    assert all(p.above_peak == (p.rate > 8.0) for p in out.probes)
    assert any(p.backlog is not None and p.backlog.grew and p.attainment(None) == 1.0 for p in out.probes)  # the rule
    assert out.arrivals == dict(server.calls)


def test_short_probes_above_the_peak_are_fooled() -> None:
    """The problem longer probes solve: at factor 1 a probe at 16 req/s, a third over what the server sustains, ends
    before its queue breaks the TTFT rule or the backlog rule's margin."""
    server = Server(peak=8.0, sustained=12.0)
    assert settled(search(server, factor=1.0)) == (AT_MAX, 16.0, None)
    assert all(n == N for _, n in server.calls)


@pytest.mark.parametrize("factor,at_most", [(4.0, 8.0 * 1.1), (8.0, 8.0 * 1.05)])
def test_a_server_that_sustains_only_its_peak_is_not_fooled_by_long_probes(factor: float, at_most: float) -> None:
    short, long = Server(peak=8.0, sustained=8.0), Server(peak=8.0, sustained=8.0)
    fooled = settled(search(short, factor=1.0))
    status, lo, _ = settled(search(long, factor=factor))
    assert fooled[0] == CONVERGED and fooled[1] > 8.0 * 1.3  # short probes read 40% over what it sustains
    assert status == CONVERGED and 8.0 <= lo <= at_most  # long ones: within the rule's margin, halved as F doubles


def test_long_probes_count_against_the_budget() -> None:
    server = Server(peak=8.0, sustained=12.0)
    scfg = SearchConfig(itl_bounds_ms=(50.0,), shares=(0.9,), discard=D, max_probes=40, max_rate=16.0,
                        above_peak_factor=4.0)
    out = asyncio.run(search_frontier(server.measure, scfg, 4.0, N, clock=lambda: server.now, deadline=35.0,
                                      peak=8.0))
    # 4 req/s: 16 s, 8: 8.5 s; a long probe at 16 (210 arrivals, ~14 s with the drain) would end after 35 s
    assert server.calls == [(4.0, N), (8.0, N)] and out.stopped is not None and "a probe at 16 req/s" in out.stopped


# ---------------------------------------------------------------- the report and the flags


def result(ceiling: str, max_rate: float, probes: list[dict[str, object]]) -> dict[str, object]:
    """A search result as run_goodput_search writes it (peak 8.57, 48 arrivals a probe, factor 4)."""
    def att(u: float) -> dict[str, float]:
        return {"unbounded": u, "50": u}

    return {"kind": "goodput_search", "label": "duet@50", "base_url": "http://h:1", "model": "m",
            "workload": {"name": "fixed", "input_len": 4096, "output_len": 64}, "created": "now",
            "search": {"settings": {"itl_bounds_ms": [50.0], "shares": [0.9], "start_fraction": 0.5, "tolerance": 0.05,
                                    "max_probes": 12, "discard": 16, "above_peak_factor": 4.0},
                       "start_rate": 4.29, "min_rate": 1.07, "max_rate": max_rate, "probe_requests": 48,
                       "peak_request_throughput": 8.571, "ceiling": ceiling, "shared_peak": 11.9},
            "probes": [{"rate": r, "order": i + 1, "counted": 32 if not extra else 128, "attainment": att(1.0),
                        "summary": {"ttft_ms": {"p99": 900.0}, "itl_ms": {"p99": 40.0}, "failed": 0}, **extra}
                       for i, (r, extra) in enumerate(probes)],
            "goodput": [{"itl_bound_ms": b, "share": 0.9, "goodput": 10.2, "lo": 10.2, "hi": 10.7,
                         "status": CONVERGED} for b in (None, 50.0)],
            "finished": True, "stopped": None}


GREW = {"above_peak": True, "arrivals": 144,
        "backlog": {"first": 0.05, "last": 0.6, "projected": 1.3, "requests": 128, "grew": True}}
STEADY = {"above_peak": True, "arrivals": 144,
          "backlog": {"first": 0.05, "last": 0.06, "projected": 0.07, "requests": 128, "grew": False}}


def test_the_report_says_which_probes_were_above_the_peak_and_long() -> None:
    res = result(SHARED_PEAK, 11.9, [(4.29, {}), (8.57, {}), (11.9, GREW), (10.2, STEADY), (10.7, GREW)])
    md = search_markdown(res)
    assert ("the ceiling 11.9 req/s is the comparison's highest closed-loop peak so far, above this server's own 8.57: "
            "probes above 8.57 send 144 arrivals (4 x the counted) and fail every target where their TTFT backlog "
            "grew; ") in md
    assert "| above the peak: arrivals, backlog |" in md and "u = TTFT / the request's TTFT limit" in md
    assert "| 8.57 | 2 | 32 | 100.0% | 100.0% | 900 | 40.0 | 0 | - | - |" in md  # at the peak: short, unchecked
    assert ("| 11.9 | 3 | 128 | 100.0% | 100.0% | 900 | 40.0 | 0 | - | 144 arrivals; TTFT/limit 0.05 -> 0.6, "
            "projected 1.3: GREW (fails every target) |") in md  # every request attained, yet it failed
    assert "| 10.2 | 4 | 128 | 100.0% | 100.0% | 900 | 40.0 | 0 | - | 144 arrivals; TTFT/limit 0.05 -> 0.06, " \
           "projected 0.07: steady |" in md
    block = search_block(res)
    assert "Ceiling (req/s):" in block and "11.9 (the comparison's highest closed-loop peak so far)" in block
    assert re.search(r"Probes above the peak, backlog grew: +3, 2", block)
    plain = result(OWN_PEAK, 8.57, [(4.29, {}), (8.57, {})])  # as by default: nothing new said
    assert "above the peak:" not in search_markdown(plain) + search_block(plain)
    assert "the ceiling" not in search_markdown(plain) and "Ceiling" not in search_block(plain)
    assert "| 8.57 | 2 | 32 | 100.0% | 100.0% | 900 | 40.0 | 0 | - |\n" in search_markdown(plain)
    given = result(MAX_RATE, 6.0, [(4.29, {})])  # a given ceiling below the peak: said, nothing above it
    assert "the ceiling 6 req/s is --search-max-rate; " in search_markdown(given)
    assert backlog_cell({"above_peak": True, "arrivals": 20, "backlog": None}) == \
        "20 arrivals; too few requests to judge the backlog"
    assert backlog_cell({"rate": 4.0}) == "-"


@pytest.mark.parametrize("args,needle", [
    (["--search-above-peak-factor", "2"], "--search-above-peak-factor 2 lengthens the probes above the closed-loop "
                                          "peak, and with the peak as the ceiling there are none: give a ceiling above "
                                          "it, --search-max-rate R (bench/compare.py: or --search-shared-ceiling)"),
    (["--search-above-peak-factor", "0.5"], "0.5 must be a number >= 1"),
    (["--search-above-peak-factor", "2", "--search-max-rate", "20", "--search-start-rate", "4"],
     "which --search-start-rate skips measuring"),
    (["--search-above-peak-factor", "2", "--search-max-rate", "20", "--workload", "trace", "--trace", "t.jsonl",
      "--trace-arrivals", "poisson"], "each probe replays the trace's whole window: give --search-trace-probe N"),
    (["--search-max-probe-arrivals", "400", "--workload", "trace", "--trace", "t.jsonl", "--trace-arrivals",
      "poisson"], "--search-max-probe-arrivals caps a probe's arrivals, but a trace's window is its cap"),
    (["--search-trace-probe", "48"], "--search-trace-probe sets a trace's arrivals per probe; for this workload "
                                     "--num-prompts does"),
    (["--search-trace-probe", "0", "--workload", "trace", "--trace", "t.jsonl", "--trace-arrivals", "poisson"],
     "--search-trace-probe: 0 must be an integer >= 1"),
])
def test_bad_above_peak_flags_exit_2(args: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    # nothing listens on port 9: a check that passed would fail with exit 1 instead
    try:
        rc = main(["bench", "--base-url", "http://127.0.0.1:9", "--goodput-search", *args])
    except SystemExit as e:  # argparse's own type error
        rc = e.code  # type: ignore[assignment]
    assert rc == 2 and needle in capsys.readouterr().err
