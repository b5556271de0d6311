"""The server counters `rapidserve bench` reads from /metrics and reports per run (prefix cache, partition, the
decode worker's steps by shape kind)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rapidserve.benchmark.client import counter_deltas, server_counters
from rapidserve.benchmark.report import _server_counts
from rapidserve.benchmark.step_mix import step_cell

METRICS = """# HELP vllm:prefix_cache_queries_total x
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 250.0
rapidserve:partition_switches_total{model_name="m"} 4.0
rapidserve:partition_steps_total{config="d66-p66",model_name="m"} 30.0
rapidserve:partition_steps_total{config="full",model_name="m"} 10.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 5.0
vllm:num_preemptions_total{engine="0",model_name="m"} 7.0
"""


def _fetch(body: str, status: int = 200) -> dict[str, float] | None:
    async def main() -> dict[str, float] | None:
        app = web.Application()
        app.router.add_get("/metrics", lambda _: web.Response(text=body, status=status))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as s:
                return await server_counters(s, f"http://127.0.0.1:{port}", None)
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def test_server_counters_parse_metrics() -> None:
    got = _fetch(METRICS)
    assert got == {"prefix_cache_queries": 1005.0, "prefix_cache_hits": 250.0, "partition_switches": 4.0,
                   "partition_steps:d66-p66": 30.0, "partition_steps:full": 10.0}
    assert _fetch("oops", status=500) is None


@pytest.mark.parametrize(("before", "after", "want"), [
    (None, {"prefix_cache_queries": 1.0}, {}),
    ({}, {}, {}),
    ({"prefix_cache_queries": 100.0, "prefix_cache_hits": 10.0},
     {"prefix_cache_queries": 300.0, "prefix_cache_hits": 110.0},
     {"prefix_cache": {"queried_tokens": 200.0, "hit_tokens": 100.0, "hit_rate": 0.5}}),
    ({"prefix_cache_queries": 5.0}, {"prefix_cache_queries": 5.0},
     {"prefix_cache": {"queried_tokens": 0.0, "hit_tokens": 0.0, "hit_rate": None}}),
    # one configuration and no switch: nothing to say about the partition
    ({"partition_steps:a": 1.0}, {"partition_steps:a": 9.0, "partition_switches": 0.0}, {}),
    ({"partition_steps:a": 1.0, "partition_switches": 2.0},
     {"partition_steps:a": 9.0, "partition_steps:b": 4.0, "partition_switches": 5.0},
     {"partition": {"switches": 3, "decode_steps": {"a": 8, "b": 4}}}),
])
def test_counter_deltas(before: dict[str, float] | None, after: dict[str, float], want: dict[str, Any]) -> None:
    assert counter_deltas(before, after) == want


def test_report_line() -> None:
    run = {"prefix_cache": {"hit_rate": 0.25}, "partition": {"switches": 3, "decode_steps": {"a": 1, "b": 3}}}
    assert _server_counts(run) == ("prefix cache hit rate 25.0%; 3 partition switches; decode steps by "
                                   "configuration: b 75%, a 25%")
    assert _server_counts({}) == ""


PHASE_METRICS = """vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_queue_time_seconds_bucket{engine="0",le="0.1",model_name="m"} 3.0
rapidserve:request_admission_time_seconds_sum{model_name="m"} 0.1
rapidserve:request_admission_time_seconds_count{model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.25
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0
rapidserve:request_first_token_handoff_seconds_sum{model_name="m"} 0.05
rapidserve:request_first_token_handoff_seconds_count{model_name="m"} 10.0
vllm:request_queue_time_seconds_sum{engine="1",model_name="m"} 1.5
vllm:request_queue_time_seconds_count{engine="1",model_name="m"} 5.0
"""


def test_server_counters_parse_ttft_phases() -> None:
    """vLLM's queue and prefill phases (summed over engines) and rapidserve's own (admission, hand-off)."""
    got = _fetch(PHASE_METRICS)
    assert got == {"phase_sum:queue": 2.0, "phase_count:queue": 15.0, "phase_sum:admission": 0.1,
                   "phase_count:admission": 10.0, "phase_sum:prefill": 0.25, "phase_count:prefill": 10.0,
                   "phase_sum:handoff": 0.05, "phase_count:handoff": 10.0}


def test_ttft_phase_means_over_a_run() -> None:
    before = {"phase_sum:queue": 1.0, "phase_count:queue": 10.0, "phase_sum:prefill": 2.0,
              "phase_count:prefill": 10.0}
    after = {"phase_sum:queue": 1.3, "phase_count:queue": 13.0, "phase_sum:prefill": 2.0,
             "phase_count:prefill": 10.0, "phase_sum:handoff": 0.006, "phase_count:handoff": 3.0}
    # queue: 0.3 s over 3 requests; prefill: no request in this run; hand-off: new since `before`
    assert counter_deltas(before, after) == {"ttft_phases_ms": {"queue": 100.0, "handoff": 2.0}}
    assert _server_counts({"ttft_phases_ms": {"queue": 100.0, "handoff": 2.0}}) == (
        "time to first token, server's means: queue 100 ms, handoff 2 ms")


STEP_METRICS = """# HELP rapidserve:steps_total Decode-worker steps landed, by the shape the policy chose.
# TYPE rapidserve:steps_total counter
rapidserve:steps_total{kind="fused",model_name="m"} 100.0
rapidserve:steps_total{kind="split",model_name="m"} 40.0
rapidserve:steps_total{kind="alone",model_name="m"} 0.0
rapidserve:step_seconds_total{kind="fused",model_name="m"} 4.2
rapidserve:steps_over_slo_total{kind="fused",model_name="m"} 7.0
rapidserve:step_predicted_seconds_total{kind="fused",model_name="m"} 4.0
rapidserve:step_predicted_measured_seconds_total{kind="fused",model_name="m"} 4.1
rapidserve:step_correction_ratio{kind="fused",model_name="m"} 1.05
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 10.0
"""


def test_server_counters_parse_the_step_series() -> None:
    assert _fetch(STEP_METRICS) == {
        "step:steps:fused": 100.0, "step:steps:split": 40.0, "step:steps:alone": 0.0, "step:measured_s:fused": 4.2,
        "step:over_slo:fused": 7.0, "step:predicted_s:fused": 4.0, "step:predicted_measured_s:fused": 4.1,
        "step_correction:fused": 1.05, "prefix_cache_queries": 10.0}


def scrape(fused: tuple[float, float, float, float, float], split: tuple[float, float, float],
           ratio: float) -> dict[str, float]:
    """A scrape's dict as server_counters gives it: fused (steps, measured s, over, predicted s, predicted's
    measured s), split (steps, measured s, over; never predicted), the fused correction."""
    keys = ("steps", "measured_s", "over_slo", "predicted_s", "predicted_measured_s")
    out = {f"step:{k}:fused": v for k, v in zip(keys, fused, strict=True)}
    out.update({f"step:{k}:split": v for k, v in zip(keys, split, strict=False)})
    out.update({"step:steps:alone": 3.0, "step:steps:fused_decode": 0.0, "step_correction:fused": ratio})
    return out


def test_step_deltas_and_the_probe_cell_from_two_scrapes() -> None:
    before = scrape((100, 4.0, 5, 3.8, 4.0), (40, 0.8, 0), 1.02)
    after = scrape((162, 6.7, 9, 6.3, 6.7), (70, 1.4, 1), 1.07)
    after["step:steps:alone"] = 11.0
    got = counter_deltas(before, after)
    host = {"gaps": 0, "gap_s": 0.0, "gaps_over_slo": 0, "idle_s": 0.0, "host_s": 0.0}  # an older server: none
    assert got["server_steps"] == {  # the raw deltas, kinds without a step in the run left out
        "fused": {"steps": 62, "measured_s": pytest.approx(2.7), "over_slo": 4, "predicted_s": pytest.approx(2.5),
                  "predicted_measured_s": pytest.approx(2.7), **host},
        "split": {"steps": 30, "measured_s": pytest.approx(0.6), "over_slo": 1, "predicted_s": 0.0,
                  "predicted_measured_s": 0.0, **host},
        "alone": {"steps": 8, "measured_s": 0.0, "over_slo": 0, "predicted_s": 0.0, "predicted_measured_s": 0.0,
                  **host}}
    assert got["server_step_correction"] == {"fused": 1.07}  # a gauge: its value at the end
    assert list(got["server_steps"]) == ["fused", "split", "alone"]  # the server's order
    # 2.7 s over 62 fused steps: 43.5 ms each; the alone steps were not timed
    assert step_cell(got) == "fused 62% (43.5 ms; 1.08, 6.5%) / split 30% (20.0 ms; -, 3.3%) / alone 8% (-; -, 0%)"
    assert _server_counts(got) == ("steps by kind, share (mean step; measured/predicted, over SLO): fused 62% (43.5 "
                                   "ms; 1.08, 6.5%) / split 30% (20.0 ms; -, 3.3%) / alone 8% (-; -, 0%)")


def test_the_host_view_in_the_probe_cell() -> None:
    before = scrape((100, 4.0, 5, 3.8, 4.0), (40, 0.8, 0), 1.02)
    after = scrape((140, 5.6, 5, 5.3, 5.6), (40, 0.8, 0), 1.02)
    # 40 fused steps: 38 of them ended a token gap (1.9 s in all), 6 of those over the SLO; 0.2 s idle before them
    before.update({"step:gaps:fused": 90.0, "step:gap_s:fused": 4.0, "step:gaps_over_slo:fused": 1.0,
                   "step:idle_s:fused": 0.1, "step:host_s:fused": 0.5})
    after.update({"step:gaps:fused": 128.0, "step:gap_s:fused": 5.9, "step:gaps_over_slo:fused": 7.0,
                  "step:idle_s:fused": 0.3, "step:host_s:fused": 0.62})
    got = counter_deltas(before, after)
    fused = got["server_steps"]["fused"]
    assert (fused["gaps"], fused["gaps_over_slo"]) == (38, 6)
    assert fused["gap_s"] == pytest.approx(1.9) and fused["idle_s"] == pytest.approx(0.2)
    # the only kind that stepped; 0.12 s of host time over its 40 steps: 3 ms each
    assert step_cell(got) == "fused 100% (40.0 ms; 1.07, 0%; gaps 15.8% over, idle 5.0 ms, host 3.0 ms)"
    # duet's adapted SLO margin (a gauge beside the correction ratios) ends the cell
    got["server_step_correction"] = {**got["server_step_correction"], "slo_margin": 0.954}
    assert step_cell(got).endswith("host 3.0 ms) / margin 0.954")


@pytest.mark.parametrize(("before", "after"), [
    ({"prefix_cache_queries": 1.0}, {"prefix_cache_queries": 2.0}),  # vLLM: no step series
    (scrape((5, 0.1, 0, 0.1, 0.1), (0, 0, 0), 1.0), scrape((5, 0.1, 0, 0.1, 0.1), (0, 0, 0), 1.0)),  # no step
])
def test_no_steps_no_step_fields_and_a_dash(before: dict[str, float], after: dict[str, float]) -> None:
    got = counter_deltas(before, after)
    assert "server_steps" not in got and "server_step_correction" not in got
    assert step_cell(got) == "-" and "steps by kind" not in _server_counts(got)
