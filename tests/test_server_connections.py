"""Connection limits (rapidserve/server/connections.py) against raw sockets, in-process.

Slowloris connections (a request head trickled a byte at a time) are closed within the head
timeout + 1 s; idle connections beyond the cap are closed (the oldest idle one makes room) while
normal requests keep working; when every connection is busy a new one gets 503; an idle keep-alive
connection is closed after the keep-alive timeout; a request being handled is never cut.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from rapidserve.server.connections import _GuardedServer
from rapidserve.server.serve import make_runner
from rapidserve.server_config import ServerConfig


@dataclass
class Watch:
    guard: _GuardedServer  # the connections it holds (`live`, oldest first) and its counters
    slow_in: list[web.Request]  # the GET /slow requests being handled


async def until(ok: Callable[[], bool], what: Callable[[], str], timeout: float = 20.0) -> None:
    """Poll `ok()` (the event loop runs meanwhile) until it is true; fail after `timeout` s with `what()`."""
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {what()}"
        await asyncio.sleep(0.01)


@asynccontextmanager
async def serving(**cfg: float) -> AsyncIterator[tuple[int, asyncio.Event, Watch]]:
    """A small app (GET /ok; GET /slow: answers once `release` is set; GET /sleep?s=S) on the server's
    runner; yields (port, release, what the test can watch of it)."""
    release = asyncio.Event()
    slow_in: list[web.Request] = []

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(request: web.Request) -> web.Response:
        slow_in.append(request)
        await release.wait()
        return web.Response(text="slow")

    async def sleep(request: web.Request) -> web.Response:
        await asyncio.sleep(float(request.query["s"]))
        return web.Response(text="slept")

    app = web.Application()
    app.router.add_get("/ok", ok)
    app.router.add_get("/slow", slow)
    app.router.add_get("/sleep", sleep)
    runner = make_runner(app, ServerConfig(**cfg))  # type: ignore[arg-type]
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    assert runner.guard is not None
    try:
        yield runner.addresses[0][1], release, Watch(runner.guard, slow_in)
    finally:
        release.set()
        await runner.cleanup()


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def closed_by_server(reader: asyncio.StreamReader, timeout: float) -> float | None:
    """Seconds until the server closed the connection (EOF or reset), or None if it stayed open."""
    t0 = time.monotonic()
    try:
        while await asyncio.wait_for(reader.read(1024), timeout - (time.monotonic() - t0)):
            pass
    except asyncio.TimeoutError:
        return None
    except ConnectionError:
        pass
    return time.monotonic() - t0


async def get_ok(port: int) -> int:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}/ok") as r:
        assert await r.text() == "ok"
        return r.status


def run(fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(fn(), 60))


def test_slowloris_connections_are_closed_within_the_head_timeout() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=1.0, keepalive_timeout_s=30) as (port, _, watch):
            conns = [await connect(port) for _ in range(5)]
            t0 = time.monotonic()

            async def trickle(w: asyncio.StreamWriter) -> None:
                for b in b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                    w.write(bytes([b]))
                    await asyncio.sleep(0.1)

            tricklers = [asyncio.create_task(trickle(w)) for _, w in conns]
            assert await get_ok(port) == 200  # normal requests work meanwhile
            # The trickle lasts 13.5 s (135 bytes, one each 0.1 s): closed well before it ends, the head timeout ran
            # from the connection, not from its last byte. The bound leaves seconds for a loaded machine.
            closed = await asyncio.gather(*(closed_by_server(r, 8.0) for r, _ in conns))
            for t in tricklers:
                t.cancel()
            for _, w in conns:
                w.close()
            assert all(c is not None for c in closed), closed
            assert time.monotonic() - t0 < 1.0 + 7.0
            assert watch.guard.head_timeouts_total == 5  # each closed by its head timeout
            assert await get_ok(port) == 200

    run(main)


def test_idle_connections_beyond_the_cap_are_closed_and_requests_still_work() -> None:
    async def main() -> None:
        async with serving(max_connections=20, header_timeout_s=30, keepalive_timeout_s=30) as (port, _, watch):
            g = watch.guard
            conns = [await connect(port) for _ in range(100)]
            # the server has taken all 100 (each beyond the cap evicting the oldest idle one) ...
            await until(lambda: g.evicted_total == 80, lambda: f"{g.evicted_total} evicted, {len(g.live)} live")
            assert len(g.live) == 20 and g.rejected_total == 0
            assert await get_ok(port) == 200  # ... so the oldest idle connection made room for this one
            assert g.evicted_total == 81 and g.rejected_total == 0

            def still_open() -> list[asyncio.StreamReader]:
                return [r for r, _ in conns if not r.at_eof() and r.exception() is None]

            # every eviction reaches its client (the readers see EOF or a reset): at most 20 stay open
            readers = [asyncio.create_task(closed_by_server(r, 30.0)) for r, _ in conns]  # (EOF is seen by reading)
            await until(lambda: len(still_open()) <= 20, lambda: f"{len(still_open())} still open")
            for _, w in conns:
                w.close()
            await asyncio.gather(*readers)

    run(main)


def test_busy_connections_at_the_cap_make_a_new_one_get_503() -> None:
    async def main() -> None:
        async with serving(max_connections=2) as (port, release, watch), aiohttp.ClientSession() as s:
            busy = [asyncio.create_task(s.get(f"http://127.0.0.1:{port}/slow")) for _ in range(2)]
            await until(lambda: len(watch.slow_in) == 2, lambda: f"{len(watch.slow_in)} of 2 /slow requests in")
            reader, writer = await connect(port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
            assert b"Retry-After: 1" in answer and watch.guard.rejected_total == 1
            writer.close()
            release.set()
            assert [(await b).status for b in busy] == [200, 200]

    run(main)


def test_idle_keepalive_connection_is_closed_after_the_keepalive_timeout() -> None:
    async def main() -> None:
        async with serving(keepalive_timeout_s=0.5, header_timeout_s=30) as (port, _, _):
            reader, writer = await connect(port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"
            # closed by the keep-alive timeout (0.5 s), not the head timeout (30 s): the bound leaves seconds of slack
            closed = await closed_by_server(reader, 10.0)
            writer.close()
            assert closed is not None and closed < 0.5 + 9.5

    run(main)


def test_a_request_being_handled_is_not_cut_by_the_head_timeout() -> None:
    async def main() -> None:
        url = "http://127.0.0.1:{}/sleep?s=1.0"
        async with serving(header_timeout_s=0.3) as (port, _, _), aiohttp.ClientSession() as s, \
                s.get(url.format(port)) as r:
            assert (r.status, await r.text()) == (200, "slept")

    run(main)


def test_defaults_bound_every_connection() -> None:
    cfg = ServerConfig()
    assert cfg.host == "127.0.0.1" and cfg.max_connections == 2048
    assert 0 < cfg.header_timeout_s <= 15 and 0 < cfg.keepalive_timeout_s <= 75
