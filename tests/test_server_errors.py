"""The server's failure paths over HTTP, in-process against a stand-in engine (fast, deterministic).

An engine failure mid-stream ends the stream with an error event and `data: [DONE]` in a well-formed
chunked body (never a second response); a non-stream request gets 503 JSON with Retry-After;
`end_all` (the end of the shutdown grace) ends both kinds; /health reports the engine's state; every
engine request is counted once in `request_success_total`, however it ends. The same paths with the
real two-process engine: tests/test_server_failures.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fakes import CRASH, REJECT, FakeEngine, running_server, sse_events

COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 1000}
TWO_SAMPLES = {"prompt": [1, 2, 3], "max_tokens": 1000, "n": 2}


def success(body: str) -> dict[str, float]:
    return {s.labels["finished_reason"]: s.value for fam in text_string_to_metric_families(body)
            for s in fam.samples if s.name == "vllm:request_success_total"}


async def metrics(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        return success(await r.text())


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 20))


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      started: asyncio.Event | None = None) -> tuple[int, list[str]]:
    async with session.post(url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status == 200, await r.text()
        first = await r.content.readuntil(b"\n\n")
        if started is not None:
            started.set()
        return r.status, sse_events(first + await r.read())  # read(): raises if the chunked body is cut


def assert_error_then_done(events: list[str], code: str) -> dict[str, Any]:
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["type"] == "server_error" and err["code"] == code and err["message"], err
    assert all("error" not in json.loads(e) for e in events[:-2])
    return err


def test_engine_failure_ends_streams_with_error_event_and_non_streams_with_503() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            started = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(read_stream(s, url, b, e))
                       for b, e in zip((COMPLETION, TWO_SAMPLES), started, strict=True)]
            plain = asyncio.create_task(s.post(url + "/v1/completions", json=COMPLETION))
            await asyncio.gather(*(e.wait() for e in started))
            t0 = time.monotonic()
            engine.die.set()
            for task in streams:
                _, events = await task
                err = assert_error_then_done(events, "engine_unavailable")
                assert "decode worker died" in err["message"]
            r = await plain
            assert r.status == 503 and r.headers["Retry-After"]
            err = (await r.json())["error"]
            assert err["type"] == "server_error" and "decode worker died" in err["message"]
            assert time.monotonic() - t0 < 2.0
            assert (await metrics(s, url))["error"] == 4  # 1 + 2 choices streamed, 1 plain: each once
            assert (await metrics(s, url))["abort"] == 0

    run(main)


def test_engine_not_ready_answers_503_before_any_response_begins() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.state, engine.dead_reason = "restarting", "the prefill worker died"
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            for stream in (False, True):
                async with s.post(url + "/v1/completions", json={**COMPLETION, "stream": stream}) as r:
                    assert r.status == 503 and r.headers["Retry-After"]
                    assert "restarting" in (await r.json())["error"]["message"]

    run(main)


def test_a_bug_mid_stream_ends_it_with_an_error_event_not_a_second_response() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.mode = CRASH
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            _, events = await read_stream(s, url, COMPLETION)
            err = json.loads(events[-2])["error"]
            assert events[-1] == "[DONE]" and err["message"] == "internal server error"
            assert "HTTP/1.1" not in "".join(events)
            async with s.get(url + "/health") as r:  # the connection pool and server are fine
                assert r.status == 200

    run(main)


def test_end_all_ends_streams_and_non_streams_and_aborts_their_engine_requests() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (server, url), aiohttp.ClientSession() as s:
            started = asyncio.Event()
            stream = asyncio.create_task(read_stream(s, url, COMPLETION, started))
            plain = asyncio.create_task(s.post(url + "/v1/completions", json=COMPLETION))
            await started.wait()
            await wait_until(lambda: _true(len(engine.live) == 2))
            server.draining = True
            assert server.end_all("the server is shutting down") == 2
            _, events = await stream
            assert "shutting down" in assert_error_then_done(events, "server_shutting_down")["message"]
            r = await plain
            assert r.status == 503 and (await r.json())["error"]["code"] == "server_shutting_down"
            await wait_until(lambda: _true(not engine.live))
            assert len(engine.aborted) == 2
            m = await metrics(s, url)
            assert (m["abort"], m["error"]) == (2, 0)
            async with s.get(url + "/health") as h:
                assert h.status == 503 and (await h.json())["status"] == "draining"

    run(main)


async def _true(v: bool) -> bool:
    return v


def test_client_disconnects_are_counted_as_abort_exactly_once() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (server, url):
            async with aiohttp.ClientSession() as s:
                r = await s.post(url + "/v1/completions", json={**TWO_SAMPLES, "stream": True})
                await r.content.readuntil(b"\n\n")
                r.close()  # the client goes away mid-stream
                with pytest.raises(asyncio.TimeoutError):  # and one that gives up on a plain request
                    await s.post(url + "/v1/completions", json=COMPLETION, timeout=aiohttp.ClientTimeout(total=0.3))
            async with aiohttp.ClientSession() as s:
                await wait_until(lambda: _true(not engine.live and server.inflight == 0))
                await asyncio.sleep(0.2)
                m = await metrics(s, url)
                assert (m["abort"], m["error"], m["length"]) == (3, 0, 0)
                assert len(engine.aborted) == 3  # every engine request was aborted
                async with s.post(url + "/v1/completions", json={"prompt": [1], "max_tokens": 3}) as ok:
                    assert ok.status == 200
                assert (await metrics(s, url))["length"] == 1

    run(main)


@pytest.mark.parametrize("state", ["starting", "restarting", "down"])
def test_health_is_503_with_the_reason_until_the_engine_is_ready(state: str) -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (server, url), aiohttp.ClientSession() as s:
            engine.state, engine.dead_reason = state, "the decode worker died (exit code 1)"
            async with s.get(url + "/health") as r:
                body = await r.json()
                assert r.status == 503 and body["status"] == state and body["reason"]
            engine.state = "ready"
            async with s.get(url + "/health") as r:
                assert r.status == 200 and await r.json() == {"status": "ok"}

    run(main)


def test_engine_restarts_and_deaths_are_exported() -> None:
    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            async def counters() -> tuple[float, float]:
                async with s.get(url + "/metrics") as r:
                    text = await r.text()
                v = {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples}
                return v["rapidserve:engine_restarts_total"], v["rapidserve:engine_worker_deaths_total"]

            assert await counters() == (0, 0)
            engine.deaths_total, engine.restarts_total = 2, 1
            assert await counters() == (1, 2)
            engine.deaths_total = engine.restarts_total = 2
            assert await counters() == (2, 2)

    run(main)


def test_a_body_trickled_in_slowly_gets_408_and_the_server_goes_on() -> None:
    async def main() -> None:
        async with running_server(FakeEngine(), header_timeout_s=0.5) as (_, url):
            host, port = url.removeprefix("http://").split(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 40\r\n\r\n{\"prompt\": ")
            await writer.drain()
            t0 = time.monotonic()
            head = await asyncio.wait_for(reader.readline(), 5)
            assert b" 408 " in head and time.monotonic() - t0 < 2.0, head
            writer.close()
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions",
                                                            json={"prompt": [1, 2], "max_tokens": 2}) as r:
                assert r.status == 200

    asyncio.run(main())


def test_a_prompt_the_engine_refuses_is_a_400_not_a_503() -> None:
    """RequestRejected is an EngineError and a ValueError: it is the client's error (400 /
    invalid_request_error), not the engine's 503, stream or not."""
    async def main() -> None:
        engine = FakeEngine()
        engine.mode = REJECT
        async with running_server(engine) as (_, url), aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}) as r:
                body = await r.json()
                assert r.status == 400 and body["error"]["param"] == "prompt", body
                assert "token ids must be integers" in body["error"]["message"]
            async with s.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True}) as r:
                events = sse_events(await r.read())  # the stream had begun: an error event, then [DONE]
                err = json.loads(events[-2])["error"]
                assert events[-1] == "[DONE]" and err["type"] == "invalid_request_error" and err["param"] == "prompt"

    asyncio.run(main())
