"""The server counters `rapidserve bench` reads from /metrics and reports per run (prefix cache, partition)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rapidserve.benchmark.client import counter_deltas, server_counters
from rapidserve.benchmark.report import _server_counts

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
