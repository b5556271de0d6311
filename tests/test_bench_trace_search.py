"""The goodput search on a trace (rapidserve/benchmark/search_run.py): with --search-trace-probe N each probe sends
the window's first requests (N, or what the ramp rule and a probe above the peak need, up to the window), against the
in-process fake server of test_bench_trace_run; a window too small for a probe is refused before any request; and
above the peak a probe the window cut fails (sustain.Ramp.verdict)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from test_bench_trace_run import MOON, Fast, trace_cfg, with_fast

from rapidserve.benchmark.replay import Replay, build_replay
from rapidserve.benchmark.search_config import SearchConfig, trace_window_problem
from rapidserve.benchmark.search_run import KnownPeak, first, run_goodput_search
from rapidserve.benchmark.sustain import CAPPED, STEADY, TRACE_CAP, Ramp, plan_probe
from rapidserve.benchmark.traces import TraceSpec
from rapidserve.benchmark.workloads import WorkloadSpec


def window_of(n: int) -> Replay:
    """The Mooncake excerpt's first n requests at Poisson arrivals, as the search's fake-server runs replay them."""
    return build_replay(WorkloadSpec("trace", max_model_len=8192, trace=TraceSpec(MOON, arrivals="poisson")), n, None)


FAST_SEARCH = SearchConfig(discard=2, start_rate=200.0, max_probes=2, tolerance=0.5, shares=(0.9,),
                           itl_bounds_ms=(50.0,), trace_probe=8)


def test_probes_send_the_windows_first_requests() -> None:
    """A window of 24, probes of 8: the closed loop is skipped (a start rate), each probe sends its plan's arrivals
    (the warm-up and the 6 counted), the window's first ones, the same lengths at every rate; the result says the
    window and the probe size."""
    async def test(fake: Fast, url: str) -> dict[str, Any]:
        return await run_goodput_search(trace_cfg(url, MOON, arrivals="poisson", num_prompts=24, warmup=1),
                                        FAST_SEARCH)

    res = with_fast(8192, test)
    replay = window_of(24)
    s = res["search"]
    assert (s["probe_requests"], s["trace_window"], s["max_probe_arrivals"]) == (8, 24, 24)
    assert res["trace"]["replayed"] == 24 and 1 <= len(res["probes"]) <= 2
    for p in res["probes"]:
        ramp = p["ramp"]
        assert ramp["wanted"] == 6 and ramp["cap"] == 24 and len(p["requests"]) == ramp["sent"] <= 24
        lengths = [r["prompt_tokens"] for r in sorted(p["requests"], key=lambda r: r["index"])]
        assert lengths == [it.input_len for it in replay.items[:ramp["sent"]]]


@pytest.mark.parametrize("life", [0.05, None])  # None: a report from before the lifetime was recorded
def test_a_known_peak_stands_for_the_closed_loop(life: float | None) -> None:
    """bench/compare.py --search-peak-from-prior: given a peak (and its lifetime), no closed loop runs (the server sees
    the warm-up and the probes alone), the search starts at start_fraction of it, its ceiling is that peak, and the
    result records it and where it came from."""
    async def test(fake: Fast, url: str) -> tuple[dict[str, Any], int]:
        res = await run_goodput_search(trace_cfg(url, MOON, arrivals="poisson", num_prompts=24, warmup=1),
                                       replace(FAST_SEARCH, start_rate=None),
                                       known_peak=KnownPeak(400.0, life, "b.json", "a.json"))
        return res, len(fake.bodies)

    res, bodies = with_fast(8192, test)
    s = res["search"]
    assert bodies == 1 + sum(len(p["requests"]) for p in res["probes"]) and res["peak"] is None
    assert (s["peak_request_throughput"], s["peak_lifetime_s"], s["start_rate"], s["max_rate"]) == (
        400.0, life, 200.0, 400.0)
    assert (s["peak_reused_from"], s["peak_measured_in"]) == ("b.json", "a.json")



@pytest.mark.parametrize("size", [8, 16])
def test_a_known_peak_of_a_closed_loop_of_another_size_is_measured_again(size: int) -> None:
    """A closed loop sends its probe's n requests at once, so its peak is that concurrency's: an earlier peak from a
    closed loop of 16 (another --num-prompts or --search-trace-probe) does not stand for this search's of 8 (its
    closed loop runs, and the log and the result say why); one of 8 does."""
    async def test(fake: Fast, url: str) -> tuple[dict[str, Any], int]:
        res = await run_goodput_search(trace_cfg(url, MOON, arrivals="poisson", num_prompts=24, warmup=1),
                                       replace(FAST_SEARCH, start_rate=None),
                                       known_peak=KnownPeak(400.0, 0.05, "b.json", "b.json", size))
        return res, len(fake.bodies)

    res, bodies = with_fast(8192, test)
    s, probes = res["search"], sum(len(p["requests"]) for p in res["probes"])
    if size == 8:
        assert bodies == 1 + probes and res["peak"] is None and s["peak_reused_from"] == "b.json"
        assert "peak_not_reused" not in s and s["peak_request_throughput"] == 400.0
    else:
        assert bodies == 1 + 8 + probes and res["peak"] is not None and "peak_reused_from" not in s
        assert "sent 16 requests at once, this one sends 8" in s["peak_not_reused"]
        assert s["peak_request_throughput"] != 400.0

@pytest.mark.parametrize(("scfg", "peak", "says"), [
    (replace(FAST_SEARCH, start_rate=2.0), 8.0, "--search-start-rate gives one: drop one of them"),
    (replace(FAST_SEARCH, start_rate=None), 0.0, "the closed-loop peak reused from p.json is 0.0: not a positive"),
])
def test_a_known_peak_that_cannot_be_used_is_refused_before_any_request(scfg: SearchConfig, peak: float,
                                                                        says: str) -> None:
    async def test(fake: Fast, url: str) -> str:
        with pytest.raises(ValueError) as e:
            await run_goodput_search(trace_cfg(url, MOON, arrivals="poisson", num_prompts=24), scfg,
                                     known_peak=KnownPeak(peak, None, "p.json", "p.json"))
        assert fake.bodies == []
        return str(e.value)

    assert says in with_fast(8192, test)


def test_a_window_too_small_for_a_probe_is_refused_before_any_request() -> None:
    async def test(fake: Fast, url: str) -> str:
        with pytest.raises(ValueError) as e:
            await run_goodput_search(trace_cfg(url, MOON, arrivals="poisson", num_prompts=24),
                                     replace(FAST_SEARCH, trace_probe=16, above_peak_factor=2.0, start_rate=None,
                                             max_rate=400.0))
        assert fake.bodies == []
        return str(e.value)

    said = with_fast(8192, test)
    assert said == ("a probe of --search-trace-probe 16 with --search-above-peak-factor 2 needs 30 arrivals, and the "
                    "trace window holds 24: give the trace a larger window (--num-prompts or --duration-s), or a "
                    "smaller --search-trace-probe")


@pytest.mark.parametrize(("n", "window", "factor", "ok"), [
    (8, 24, None, True), (24, 24, None, True), (25, 24, None, False),  # the whole window: as before the flag
    (16, 30, 2.0, True), (16, 29, 2.0, False),  # 2 + 2 x 14 = 30 above the peak
])
def test_trace_window_problem(n: int, window: int, factor: float | None, ok: bool) -> None:
    scfg = SearchConfig(discard=2, above_peak_factor=factor, trace_probe=n)
    if ok:
        trace_window_problem(n, window, scfg)
    else:
        with pytest.raises(ValueError, match="the trace window holds"):
            trace_window_problem(n, window, scfg)


def test_first_takes_a_prefix_and_leaves_the_window_whole() -> None:
    replay = window_of(12)
    assert first(None, 5) is None and first(replay, 12) is replay and first(replay, 99) is replay
    assert first(replay, 5).items == replay.items[:5]  # type: ignore[union-attr]


@pytest.mark.parametrize(("above", "sent", "counted", "verdict"), [
    (False, 64, 27, STEADY),  # below the peak a cut warm-up is judged by the check: enough counted after W
    (True, 64, 27, CAPPED),  # above it a cut probe fails, whatever it counted (2026-11-30: vLLM at 24 req/s)
    (True, 200, 27, STEADY),  # not cut: judged as any
    (False, 64, 10, CAPPED),  # cut and short: as before
    # above the peak, the cap took only warm-up (every arrival it meant to count counted, none before its lifetime):
    # its span is the planned one, judged as any (e.g. a Poisson search's --search-max-probe-arrivals cutting a long
    # warm-up); before, it failed as CAPPED all the same
    (True, 64, 48, STEADY),
])
def test_above_the_peak_a_probe_the_cap_cut_fails(above: bool, sent: int, counted: int, verdict: str) -> None:
    plan = plan_probe(24.0, 48, 16, 1.5, sent, above_peak=above)  # warm-up 45 (1.25 x 1.5 s at 24 req/s) + 48
    assert plan.needed == 93 and plan.capped == (sent < 93)
    ramp = Ramp(plan, 1.5, 48 - counted, counted)
    assert ramp.verdict == verdict and ramp.to_json()["above_peak"] == above
    if above and verdict == CAPPED:
        assert "above the peak, a probe cut by " + TRACE_CAP + " 64 is too short for the backlog rule" in \
            ramp.describe(TRACE_CAP)


TRACE_FLAGS = ["--workload", "trace", "--trace", MOON, "--trace-arrivals", "poisson"]


@pytest.mark.parametrize(("args", "rc", "says"), [
    # a window of 1024 with probes of 64, 4x longer above the peak (16 + 4 x 48 = 208): it goes (exit 1: nothing
    # listens on port 9); before, the flags were checked as 1024-arrival probes against --search-max-probe-arrivals'
    # default 1024, a flag a trace may not take, and refused
    (["--num-prompts", "1024", "--search-trace-probe", "64", "--search-above-peak-factor", "4",
      "--search-max-rate", "20"], 1, "cannot search"),
    # refused with the flags before any request (before: only once the server answered, naming --num-prompts)
    (["--num-prompts", "30", "--search-trace-probe", "8"], 2,
     "--search-discard 16 leaves nothing of --search-trace-probe 8 to count"),
    (["--num-prompts", "30", "--search-trace-probe", "64"], 2,
     "a probe of --search-trace-probe 64 needs 64 arrivals, and the trace window holds 30"),
    (["--num-prompts", "10"], 2, "--search-discard 16 leaves nothing of --num-prompts 10 to count"),  # as before
])
def test_the_trace_flags_are_checked_as_a_traces(args: list[str], rc: int, says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`rapidserve bench --goodput-search` on a trace checks its probe (--search-trace-probe, else the window) against
    the discard and the window, not --num-prompts against --search-max-probe-arrivals."""
    from rapidserve.cli import main

    assert main(["bench", "--base-url", "http://127.0.0.1:9", "--goodput-search", *TRACE_FLAGS, *args]) == rc
    assert says in capsys.readouterr().err


def test_compare_checks_each_trace_workloads_window_before_any_server(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/compare.py refuses a trace workload whose window cannot hold a probe with the workload named, before any
    server starts (before: the search raised it once the server was up, costing its start-up)."""
    from tests.test_bench_compare import _load

    compare = _load()
    base = ["--dry-run", "--systems", "rapidserve", "--goodput-search", "--search-trace-probe", "64"]
    with pytest.raises(SystemExit) as e:
        compare.main([*base, "--workload-args", " ".join([*TRACE_FLAGS, "--num-prompts", "30"])])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--num-prompts 30`: a probe of --search-trace-probe 64 needs 64 arrivals" in err
    assert compare.main([*base, "--workload-args", " ".join([*TRACE_FLAGS, "--num-prompts", "256"])]) == 0
    # longer probes above the peak go on a trace with a probe smaller than its window (compare_args passes the flag
    # on to each workload's check): 16 + 4 x 48 = 208 of 256
    assert compare.main([*base, "--search-shared-ceiling", "--search-above-peak-factor", "4", "--workload-args",
                         " ".join([*TRACE_FLAGS, "--num-prompts", "256"])]) == 0
