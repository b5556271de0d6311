"""A client that goes away before its response begins is an ordinary event: one DEBUG line, no
traceback and nothing at WARNING or above, on every generation route, streaming or not.

Two ways it happens, each forced here: the client closes while its body is still arriving (the
handler's read raises ConnectionResetError "Connection lost"), and the connection is closing when a
stream's response is about to begin (`prepare` raises aiohttp's ClientConnectionResetError "Cannot
write to closing transport", which aiohttp logged with a 40-line ERROR traceback).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from prometheus_client.parser import text_string_to_metric_families

from tests.server_fakes import FakeEngine, running_server

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
BODIES = {"/v1/completions": {"prompt": [1, 2], "max_tokens": 5},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5},
          "/generate": {"prompt": [1, 2], "max_tokens": 5}}


def head(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()


def assert_quiet(records: list[logging.LogRecord], gone: int) -> None:
    """Nothing at WARNING or above, no traceback, and one DEBUG line for each of the `gone` disconnects."""
    loud = [f"{r.levelname} {r.name}: {r.getMessage()}" for r in records if r.levelno >= logging.WARNING]
    assert not loud, loud
    traces = [r.getMessage() for r in records if r.exc_info or r.exc_text or r.getMessage().count("\n") > 1]
    assert not traces, traces
    lines = [r for r in records if "client went away" in r.getMessage()]
    assert len(lines) == gone and all(r.levelno == logging.DEBUG for r in lines), [r.getMessage() for r in lines]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_while_its_body_arrives_is_one_debug_line(stream: bool, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    real_read = web.BaseRequest.read
    reading: list[str] = []  # the paths whose handler is reading its body

    async def read(self: web.BaseRequest) -> bytes:
        reading.append(self.path)
        return await real_read(self)

    monkeypatch.setattr(web.BaseRequest, "read", read)

    def gone_lines() -> int:
        return sum("client went away" in r.getMessage() for r in caplog.records)

    async def until(ok: Any, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 15
        while not ok():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.005)

    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (server, url):
            host, port = url.removeprefix("http://").split(":")
            for i, path in enumerate(ROUTES):
                body = json.dumps({**BODIES[path], "stream": stream}).encode()
                _, writer = await asyncio.open_connection(host, int(port))
                writer.write(head(path, body) + body[:5])  # the head and a part of the body
                await writer.drain()
                await until(lambda n=i + 1: reading == list(ROUTES[:n]), f"{path}'s handler never read its body")
                writer.close()  # while the handler is reading the body
                await until(lambda n=i + 1: gone_lines() == n, f"{path}: no 'client went away' line")
            await until(lambda: server.inflight == 0 and not engine.live, "requests still in flight")
            async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=BODIES["/generate"]) as r:
                assert r.status == 200  # and the server goes on

    with caplog.at_level(logging.DEBUG):
        asyncio.run(asyncio.wait_for(main(), 20))
    assert_quiet(caplog.records, len(ROUTES))


def test_a_client_gone_before_its_stream_begins_is_one_debug_line(monkeypatch: pytest.MonkeyPatch,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    real = web.StreamResponse.prepare

    async def closing(self: web.StreamResponse, request: Any) -> Any:
        if self.content_type == "text/event-stream":  # what aiohttp raises once the client has closed
            raise ClientConnectionResetError("Cannot write to closing transport")
        return await real(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", closing)

    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine) as (server, url), aiohttp.ClientSession() as s:
            for path in ("/v1/completions", "/generate"):  # (chat: no tokenizer here, a 400 before any stream)
                async with s.post(url + path, json={**BODIES[path], "stream": True}) as r:
                    assert r.status == 499
            assert server.inflight == 0 and not engine.live
            async with s.get(url + "/metrics") as r:
                done = {x.labels["finished_reason"]: x.value for fam in text_string_to_metric_families(await r.text())
                        for x in fam.samples if x.name == "vllm:request_success_total"}
            assert done == {"stop": 0, "length": 0, "abort": 2, "error": 0, "repetition": 0}, done

    with caplog.at_level(logging.DEBUG):
        asyncio.run(asyncio.wait_for(main(), 20))
    assert_quiet(caplog.records, 2)
