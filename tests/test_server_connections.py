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

import aiohttp
from aiohttp import web

from rapidserve.server.serve import make_runner
from rapidserve.server_config import ServerConfig


@asynccontextmanager
async def serving(**cfg: float) -> AsyncIterator[tuple[int, asyncio.Event]]:
    """A small app (GET /ok; GET /slow: answers once `release` is set; GET /sleep?s=S) on the server's
    runner; yields (port, release)."""
    release = asyncio.Event()

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(request: web.Request) -> web.Response:
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
    try:
        yield runner.addresses[0][1], release
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
    asyncio.run(asyncio.wait_for(fn(), 30))


def test_slowloris_connections_are_closed_within_the_head_timeout() -> None:
    async def main() -> None:
        async with serving(header_timeout_s=1.0, keepalive_timeout_s=30) as (port, _):
            conns = [await connect(port) for _ in range(5)]
            t0 = time.monotonic()

            async def trickle(w: asyncio.StreamWriter) -> None:
                for b in b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
                    w.write(bytes([b]))
                    await asyncio.sleep(0.1)

            tricklers = [asyncio.create_task(trickle(w)) for _, w in conns]
            assert await get_ok(port) == 200  # normal requests work meanwhile
            closed = await asyncio.gather(*(closed_by_server(r, 5.0) for r, _ in conns))
            for t in tricklers:
                t.cancel()
            for _, w in conns:
                w.close()
            assert all(c is not None for c in closed), closed
            assert time.monotonic() - t0 < 1.0 + 1.0
            assert await get_ok(port) == 200

    run(main)


def test_idle_connections_beyond_the_cap_are_closed_and_requests_still_work() -> None:
    async def main() -> None:
        async with serving(max_connections=20, header_timeout_s=30, keepalive_timeout_s=30) as (port, _):
            conns = [await connect(port) for _ in range(100)]
            await asyncio.sleep(0.3)
            assert await get_ok(port) == 200  # the oldest idle connection made room
            await asyncio.sleep(0.2)
            open_now = [c for c in await asyncio.gather(*(closed_by_server(r, 0.3) for r, _ in conns)) if c is None]
            assert len(open_now) <= 20
            for _, w in conns:
                w.close()

    run(main)


def test_busy_connections_at_the_cap_make_a_new_one_get_503() -> None:
    async def main() -> None:
        async with serving(max_connections=2) as (port, release), aiohttp.ClientSession() as s:
            busy = [asyncio.create_task(s.get(f"http://127.0.0.1:{port}/slow")) for _ in range(2)]
            await asyncio.sleep(0.3)
            reader, writer = await connect(port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 5)
            assert answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
            assert b"Retry-After: 1" in answer
            writer.close()
            release.set()
            assert [(await b).status for b in busy] == [200, 200]

    run(main)


def test_idle_keepalive_connection_is_closed_after_the_keepalive_timeout() -> None:
    async def main() -> None:
        async with serving(keepalive_timeout_s=0.5, header_timeout_s=30) as (port, _):
            reader, writer = await connect(port)
            writer.write(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200")
            assert await reader.readexactly(2) == b"ok"
            closed = await closed_by_server(reader, 5.0)
            writer.close()
            assert closed is not None and closed < 0.5 + 1.5

    run(main)


def test_a_request_being_handled_is_not_cut_by_the_head_timeout() -> None:
    async def main() -> None:
        url = "http://127.0.0.1:{}/sleep?s=1.0"
        async with serving(header_timeout_s=0.3) as (port, _), aiohttp.ClientSession() as s, \
                s.get(url.format(port)) as r:
            assert (r.status, await r.text()) == (200, "slept")

    run(main)


def test_defaults_bound_every_connection() -> None:
    cfg = ServerConfig()
    assert cfg.host == "127.0.0.1" and cfg.max_connections == 2048
    assert 0 < cfg.header_timeout_s <= 15 and 0 < cfg.keepalive_timeout_s <= 75
