"""rapidserve.benchmark client and runner against a fake OpenAI-compatible server (in-process aiohttp).

The fake server's behaviour is chosen by the prompt's first token id, so each case is one request:
1 one token per event, 2 three tokens per text event (only usage says so), 3 token_ids lists of two,
4 an HTTP 400 with an OpenAI error body, 5 an error event mid-stream, 6 a 500 with a plain-text body.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rapidserve.benchmark import client as client_module
from rapidserve.benchmark.client import Target, error_text, stream_completion
from rapidserve.benchmark.runner import BenchConfig, run_benchmark
from rapidserve.benchmark.stats import RequestRecord
from rapidserve.benchmark.workloads import WorkloadSpec

GAP = 0.02  # seconds between the fake server's events


class StepClock:
    """The client's `time` in test_streamed_timings: a perf_counter that stands still while the client reads an
    event and moves GAP on before the fake server sends the next, so the times the client measures are the
    server's gaps exactly, however long a loaded machine keeps either side off the CPU."""

    def __init__(self) -> None:
        self.now, self.reads = 1000.0, 0

    def perf_counter(self) -> float:
        self.reads += 1
        return self.now

    async def read_since(self, reads: int) -> None:
        """Until the client has read the clock again since `reads` (it does on each event it takes)."""
        deadline = time.monotonic() + 30
        while self.reads == reads:
            assert time.monotonic() < deadline, "the client never took the event"
            await asyncio.sleep(0.001)


class Fake:
    def __init__(self, clock: StepClock | None = None) -> None:
        self.clock = clock  # None: real time, the events GAP apart
        self.inflight = 0
        self.max_inflight = 0
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.peers: set[Any] = set()  # the client's (host, port) of each connection a completion came on

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "max_model_len": 512}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth.append(request.headers.get("Authorization"))
        self.peers.add(request.transport.get_extra_info("peername") if request.transport else None)
        mode, n = body["prompt"][0], body["max_tokens"]
        if mode == 4:
            return web.json_response({"error": {"message": "'prompt' is too long", "type": "invalid_request_error"}},
                                     status=400)
        if mode == 6:
            return web.Response(text="upstream exploded", status=500)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj: dict[str, Any]) -> None:
                await resp.write(b"data: " + json.dumps(obj).encode() + b"\n\n")

            per = {1: 1, 2: 3, 3: 2, 5: 1}[mode]
            sent = 0
            while sent < n:
                k = min(per, n - sent)
                choice: dict[str, Any] = {"index": 0, "text": "x" * k, "finish_reason": None}
                if mode == 3:
                    choice["token_ids"] = list(range(sent, sent + k))
                    choice["text"] = ""
                reads = self.clock.reads if self.clock is not None else 0
                if self.clock is not None:
                    self.clock.now += GAP  # before each event: the first one's is its TTFT
                await send({"choices": [choice]})
                sent += k
                if mode == 5:
                    await send({"error": {"message": "engine died", "code": 503}})
                    await resp.write_eof()
                    return resp
                if self.clock is not None:
                    await self.clock.read_since(reads)
                else:
                    await asyncio.sleep(GAP)
            await send({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})  # carries no token
            await send({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.inflight -= 1


def with_fake(test: Callable[[Fake, str], Awaitable[Any]], clock: StepClock | None = None) -> Any:
    async def main() -> Any:
        fake = Fake(clock)
        runner = web.AppRunner(fake.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            return await test(fake, f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()

    return asyncio.run(main())


def one(mode: int, n: int, api_key: str | None = None,
        clock: StepClock | None = None) -> tuple[RequestRecord, list[int] | None, Fake]:
    async def test(fake: Fake, url: str) -> tuple[RequestRecord, list[int] | None, Fake]:
        async with aiohttp.ClientSession() as s:
            rec = RequestRecord(0, 0, 0)
            got = await stream_completion(s, Target(url, "fake-model", api_key, 30.0), [mode, 7, 7], n, rec, 0.0)
            return rec, got.token_ids, fake

    return with_fake(test, clock)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode,n,itls", [(1, 5, 4), (2, 7, 6), (3, 6, 4)])
def test_streamed_timings(mode: int, n: int, itls: int, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = StepClock()
    monkeypatch.setattr(client_module, "time", clock)  # the client times events by the server's steps
    rec, ids, fake = one(mode, n, api_key="sekret", clock=clock)
    assert rec.success and rec.error == "" and rec.output_tokens == n and rec.prompt_tokens == 3
    assert len(rec.itl_s) == itls  # every token after the first chunk's has one ITL
    assert rec.ttft_s > 0 and rec.e2e_s >= rec.ttft_s + sum(rec.itl_s) - 1e-6
    chunk_gap = GAP / {1: 1, 2: 3, 3: 2}[mode]  # a k-token chunk's gap is shared by its k tokens
    assert min(rec.itl_s) > 0.5 * chunk_gap and max(rec.itl_s) < 20 * chunk_gap
    assert rec.itl_s == pytest.approx([chunk_gap] * itls) and rec.ttft_s == pytest.approx(GAP)  # the clock's steps
    assert rec.tpot_s == pytest.approx((rec.e2e_s - rec.ttft_s) / (n - 1))
    assert ids == (list(range(n)) if mode == 3 else None)
    body = fake.bodies[0]
    assert body["max_tokens"] == n == body["min_tokens"] and body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake-model"
    assert fake.auth == ["Bearer sekret"]


@pytest.mark.parametrize("mode,needle", [(4, "HTTP 400: 'prompt' is too long"), (5, "stream error: engine died"),
                                         (6, "HTTP 500: upstream exploded")])
def test_failures_keep_their_error_text(mode: int, needle: str) -> None:
    rec, ids, _ = one(mode, 4)
    assert not rec.success and rec.error == needle and ids is None and math.isnan(rec.ttft_s)


def test_connection_refused_is_a_failure() -> None:
    async def main() -> RequestRecord:
        async with aiohttp.ClientSession() as s:
            rec = RequestRecord(0, 0, 0)
            await stream_completion(s, Target("http://127.0.0.1:9", "m", timeout_s=5), [1], 2, rec, 0.0)
            return rec

    rec = asyncio.run(main())
    assert not rec.success and "Connect" in rec.error


@pytest.mark.parametrize("status,body,want", [
    (400, '{"error": {"message": "bad prompt"}}', "HTTP 400: bad prompt"),
    (503, '{"error": "overloaded"}', "HTTP 503: overloaded"),
    (422, '{"message": "nope"}', "HTTP 422: nope"),
    (502, "<html>gateway</html>", "HTTP 502: <html>gateway</html>"),
])
def test_error_text(status: int, body: str, want: str) -> None:
    assert error_text(status, body) == want


def test_sweep_with_concurrency_cap_and_multiturn() -> None:
    async def test(fake: Fake, url: str) -> tuple[dict[str, Any], dict[str, Any], Fake]:
        single = BenchConfig(base_url=url, workload=WorkloadSpec("fixed", 8, 3, token_lo=1, token_hi=2),
                             rates=(50.0, math.inf), num_prompts=6, max_concurrency=2, slos_ms={"ttft": 1000},
                             quiet=True)
        r1 = await run_benchmark(single)
        fake.max_inflight = 0
        multi = BenchConfig(base_url=url, label="sys-a", rates=(math.inf,), num_prompts=2, quiet=True,
                            workload=WorkloadSpec("multiturn", 10, 3, num_turns=3, turn_input_len=4, token_lo=1,
                                                  token_hi=2))
        r2 = await run_benchmark(multi)
        return r1, r2, fake

    r1, r2, fake = with_fake(test)
    assert r1["model"] == "fake-model" and r1["label"] == "fake-model"
    assert r1["workload"]["max_model_len"] == 512  # from /v1/models
    assert [run["rate"] for run in r1["runs"]] == [50.0, "inf"]
    for run in r1["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["goodput"] == pytest.approx(s["request_throughput"])
        reqs = run["requests"]
        assert [r["index"] for r in reqs] == list(range(6)) and all(r["output_tokens"] == 3 for r in reqs)
        # the cap: never more than 2 in flight, so the 3rd request waits for a slot
        assert max(r["start_s"] - r["scheduled_s"] for r in reqs) > 0.02
    assert r2["label"] == "sys-a" and r2["runs"][0]["summary"]["completed"] == 6
    turns = sorted((r["conversation"], r["turn"], r["prompt_tokens"]) for r in r2["runs"][0]["requests"])
    assert turns == [(c, t, 10 + t * (3 + 4)) for c in (0, 1) for t in range(3)]
    assert fake.max_inflight == 2  # two conversations, each one turn at a time


def test_workload_too_long_for_the_server_is_refused() -> None:
    async def test(fake: Fake, url: str) -> None:
        cfg = BenchConfig(base_url=url, workload=WorkloadSpec("fixed", 500, 100), num_prompts=1, quiet=True)
        with pytest.raises(ValueError, match="max model length is 512"):
            await run_benchmark(cfg)
        assert fake.bodies == []  # nothing was sent

    with_fake(test)


def test_each_request_has_a_connection_of_its_own() -> None:
    """The benchmark's requests never reuse a pooled keep-alive connection, which a server's idle timeout may close
    as a request is sent on it (uvicorn's 5 s: a ServerDisconnectedError charged to that server): six requests one
    after the other come on six connections."""
    async def test(fake: Fake, url: str) -> tuple[dict[str, Any], Fake]:
        cfg = BenchConfig(base_url=url, workload=WorkloadSpec("fixed", 8, 2, token_lo=1, token_hi=2),
                          rates=(math.inf,), num_prompts=6, max_concurrency=1, quiet=True)
        return await run_benchmark(cfg), fake

    report, fake = with_fake(test)
    assert report["runs"][0]["summary"]["completed"] == 6
    assert len(fake.peers) == 6 and None not in fake.peers
