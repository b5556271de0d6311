"""Trace replay through the runner and the report against an in-process fake server, and the trace
flags of `rapidserve bench` (checked in-process, before any request)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from rapidserve.benchmark.cli import check_flags_apply, config_from_args
from rapidserve.benchmark.replay import build_replay
from rapidserve.benchmark.report import to_markdown
from rapidserve.benchmark.results import workload_title
from rapidserve.benchmark.runner import BenchConfig, run_benchmark
from rapidserve.benchmark.traces import HASH_BLOCK_TOKENS, TraceSpec
from rapidserve.benchmark.workloads import WorkloadSpec
from rapidserve.cli import build_parser

DATA = Path(__file__).parent / "data"
CODE = str(DATA / "azure_code_2023_excerpt.csv.gz")
MOON = str(DATA / "mooncake_conversation_excerpt.jsonl.gz")


class Fast:
    """Answers every completion at once in two chunks (+ usage); records the bodies. Like vLLM, it
    streams `token_ids` only when asked (`return_token_ids`): ids 100000 + prompt length + k."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fast", "max_model_len": self.max_model_len}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        n, m = body["max_tokens"], len(body["prompt"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids = [100000 + m + k for k in range(n)]
        for part in (ids[:1], ids[1:]):
            if not part:
                continue
            choice: dict[str, Any] = {"index": 0, "text": "x" * len(part), "finish_reason": None}
            if body.get("return_token_ids"):
                choice["token_ids"] = part
            await resp.write(b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n")
            await asyncio.sleep(0.001)
        usage = {"prompt_tokens": m, "completion_tokens": n}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp


def with_fast(mml: int, test: Callable[[Fast, str], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        fake = Fast(mml)
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            return await test(fake, f"http://127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def trace_cfg(url: str, path: str, **kw: Any) -> BenchConfig:
    ts = TraceSpec(path, **{k: kw.pop(k) for k in ("arrivals", "start_s", "overflow", "block_size") if k in kw})
    return BenchConfig(base_url=url, workload=WorkloadSpec("trace", trace=ts), quiet=True, **kw)


def test_timestamps_replay_with_time_scales() -> None:
    async def test(fake: Fast, url: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        res = await run_benchmark(trace_cfg(url, MOON, time_scales=(100.0, 400.0), num_prompts=8, warmup=1))
        return res, fake.bodies

    res, bodies = with_fast(8192, test)
    replay = build_replay(WorkloadSpec("trace", max_model_len=8192, trace=TraceSpec(MOON)), 8, None)
    t = res["trace"]
    assert t["replayed"] == 8 and t["in_window"] == 40 and t["beyond_num_prompts"] == 32 and t["format"] == "mooncake"
    assert t["clipped"] == sum(it.clipped for it in replay.items) > 0 and t["skipped"] == 0
    assert t["ideal_hit_rate"] == replay.hits["ideal_hit_rate"] and "ideal_hit_rate_hash_blocks" in t
    assert res["workload"]["max_model_len"] == 8192 and res["config"]["time_scales"] == [100.0, 400.0]
    assert [run["time_scale"] for run in res["runs"]] == [100.0, 400.0]
    for run, scale in zip(res["runs"], (100.0, 400.0), strict=True):
        assert run["rate"] == pytest.approx(replay.offered_rate(scale)) and run["summary"]["completed"] == 8
        reqs = sorted(run["requests"], key=lambda r: r["index"])
        assert [r["prompt_tokens"] for r in reqs] == [it.input_len for it in replay.items]
        last = (replay.items[-1].t_s - replay.items[0].t_s) / scale
        assert reqs[-1]["scheduled_s"] >= last - 1e-3  # released at its scaled trace time
    assert len(bodies) == 1 + 16  # the warm-up (the window's first request) and two runs of 8
    first = {len(b["prompt"]): b["prompt"] for b in bodies[1:9]}
    second = {len(b["prompt"]): b["prompt"] for b in bodies[9:]}
    assert sorted(first) == sorted(second)  # the same lengths ...
    assert all(first[n][:512] != second[n][:512] for n in first)  # ... but each run's prompts are its own
    assert "return_token_ids" not in bodies[1]
    assert len({tuple(p[:HASH_BLOCK_TOKENS]) for p in first.values()}) == 1  # all start with hash id 0: one block
    md = to_markdown(res)
    assert "trace " + MOON in md and "(x100)" in md and "(x400)" in md and "inter-arrival times divided by" in md
    assert workload_title(res["workload"]) == "trace mooncake_conversation_excerpt.jsonl.gz"


def test_poisson_replay_and_skip() -> None:
    async def test(fake: Fast, url: str) -> dict[str, Any]:
        return await run_benchmark(trace_cfg(url, CODE, arrivals="poisson", overflow="skip", rates=(200.0, math.inf),
                                             num_prompts=5, seed=3))

    res = with_fast(4096, test)
    t = res["trace"]
    assert t["arrivals"] == "poisson" and t["replayed"] == 5 and t["skipped"] > 0 and t["clipped"] == 0
    assert "time_scales" not in res["config"] and [run["rate"] for run in res["runs"]] == [200.0, "inf"]
    for run in res["runs"]:
        assert run["summary"]["completed"] == 5 and "time_scale" not in run
        assert all(r["prompt_tokens"] + r["requested_output_tokens"] <= 4096 for r in run["requests"])
    md = to_markdown(res)
    assert "Poisson at each rate" in md and "no hash ids" in md and "| 200 |" in md


def test_multiturn_resends_the_returned_output_ids() -> None:
    spec = WorkloadSpec("multiturn", input_len=10, output_len=3, num_turns=3, turn_input_len=4)

    async def test(fake: Fast, url: str) -> list[dict[str, Any]]:
        await run_benchmark(BenchConfig(base_url=url, workload=spec, num_prompts=1, quiet=True))
        return fake.bodies

    bodies = with_fast(512, test)
    assert len(bodies) == 3 and all(b["return_token_ids"] is True for b in bodies)
    for k in (1, 2):
        prev, cur = bodies[k - 1]["prompt"], bodies[k]["prompt"]
        returned = [100000 + len(prev) + j for j in range(3)]  # what the fake returned for the previous turn
        assert cur[:len(prev)] == prev and cur[len(prev):len(prev) + 3] == returned and len(cur) == len(prev) + 7


def parse(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *args])


@pytest.mark.parametrize("args,needle", [
    (["--trace", CODE], "--trace only apply to --workload trace (not fixed)"),
    (["--time-scale", "2", "--block-size", "8"], "--time-scale, --block-size only apply to --workload trace"),
    (["--workload", "trace"], "--workload trace needs --trace PATH"),
    (["--workload", "trace", "--trace", CODE, "--request-rate", "2"],
     "--request-rate goes with --trace-arrivals poisson"),
    (["--workload", "trace", "--trace", CODE, "--trace-arrivals", "poisson", "--time-scale", "2"],
     "--time-scale goes with --trace-arrivals timestamps"),
    (["--workload", "trace", "--trace", CODE, "--arrival", "fixed"], "--arrival is for the synthetic workloads"),
    (["--workload", "trace", "--trace", "/no/such.csv"], "--trace /no/such.csv: cannot read it"),
    (["--workload", "trace", "--trace", str(DATA / "README.md")], "line 1: neither an Azure CSV"),
    (["--workload", "trace", "--trace", CODE, "--trace-start", "35"], "--trace-start 35 is past the end"),
    (["--workload", "trace", "--trace", CODE, "--trace-start", "5", "--duration-s", "10"], "in the window [5, 15) s"),
    (["--workload", "trace", "--trace", MOON, "--max-model-len", "900", "--trace-overflow", "skip"],
     "40 skipped as longer than the max model length 900"),
])
def test_trace_flag_combinations(args: list[str], needle: str) -> None:
    a = parse(*args)
    with pytest.raises(ValueError) as ei:
        check_flags_apply(a)  # as `rapidserve bench` does first
        config_from_args(a)
    assert needle in str(ei.value)


def test_config_from_args_ignores_flags_a_caller_set_as_defaults() -> None:
    """bench/compare.py sets its sweep flags (rates, arrival) as parser defaults for every workload."""
    a = parse("--workload", "trace", "--trace", CODE, "--request-rate", "1,2", "--arrival", "fixed")
    cfg = config_from_args(a)
    assert cfg.workload.trace == TraceSpec(CODE) and cfg.time_scales == (1.0,)
    assert config_from_args(parse("--time-scale", "2")).workload.trace is None


def test_trace_flags_make_the_config() -> None:
    cfg = config_from_args(parse("--workload", "trace", "--trace", MOON, "--time-scale", "1,2.5", "--trace-start", "3",
                                 "--duration-s", "6", "--num-prompts", "4", "--block-size", "32",
                                 "--trace-overflow", "skip", "--max-model-len", "32768"))
    assert cfg.time_scales == (1.0, 2.5) and cfg.duration_s == 6.0 and cfg.num_prompts == 4
    assert cfg.workload.trace == TraceSpec(MOON, "timestamps", 3.0, "skip", 32) and cfg.arrival == "poisson"
    cfg = config_from_args(parse("--workload", "trace", "--trace", CODE, "--trace-arrivals", "poisson",
                                 "--request-rate", "1,inf"))
    assert cfg.rates == (1.0, math.inf) and cfg.workload.trace == TraceSpec(CODE, "poisson")
    assert cfg.num_prompts == 100 and cfg.time_scales == (1.0,)
    plain = config_from_args(parse())
    assert plain.rates == (math.inf,) and plain.arrival == "poisson" and plain.workload.trace is None
