"""Start-up as operators expect: the port first, 503 "starting" until the engine is ready.

`rapidserve serve` binds its listening sockets before anything else (`bind_sockets`: a busy port or an
address that cannot be bound fails at once, with one line, before the model's configuration is read),
then serves the `StartupGate` on them while the model is resolved, the tokenizer loaded and the
engine's workers load weights, size the KV pool and capture graphs:

- GET /health and /ping answer 503 `{"status": "starting", "reason": ...}` with Retry-After, the reason
  saying which step runs now (a Kubernetes startup probe, a load balancer and a client all see why);
- GET /version answers as it will when ready;
- every other route answers an OpenAI-style 503 (`code: "server_starting"`, Retry-After).

No route reads a request body or checks the API key here (nothing is served but these fixed answers);
every answer closes its connection, so no client stays on the gate once the server proper takes the
sockets over (`serve.py`: the gate stops accepting, the server's own runner listens on the same sockets,
then the gate's runner stops; a connection arriving meanwhile waits in the backlog). `process_age_s`
dates "ready in X s" from the process's start.
`configure_logging` sets up the process's logs once, from the flags (--log-level, --uvicorn-log-level,
--disable-log-requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from rapidserve import __version__
from rapidserve.server.errors import APIError

log = logging.getLogger("rapidserve.server")
REQUEST_LOG = "rapidserve.requests"  # the logger of the one line per request (off with --disable-log-requests)
HTTP_LOGGERS = ("aiohttp.access", "aiohttp.server", "aiohttp.web", "aiohttp.internal")
BACKLOG = 128  # pending connections per socket (aiohttp's default)
T = TypeVar("T")


class BindError(Exception):
    """The server cannot listen where it was asked to; the message says where, why and what to do."""


def bind_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to (as aiohttp's TCPSite binds), non-blocking;
    with port 0 every address shares the first one's free port. BindError naming the address otherwise."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise BindError(f"--host {host}: cannot resolve it ({e.strerror}); give an IP address or a host name of "
                        "this machine") from None
    socks: list[socket.socket] = []
    seen: set[tuple[int, object]] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr) in seen:
                continue
            seen.add((family, addr))
            if port == 0 and socks:
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio: a TIME_WAIT port is free
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
            s.listen(BACKLOG)
            s.setblocking(False)
    except OSError as e:
        for s in socks:
            s.close()
        where = f"{host}:{port}"
        hint = {errno.EADDRINUSE: "another process listens there: stop it or pick another --port",
                errno.EACCES: "ports below 1024 need privileges: pick --port 1024 or above",
                errno.EADDRNOTAVAIL: "no interface of this machine has that address: check --host"}.get(
            e.errno or 0, "check --host and --port")
        raise BindError(f"cannot listen on {where}: {e.strerror or e} ({hint})") from None
    return socks


def process_age_s() -> float:
    """Seconds since this process started (Linux: from /proc; elsewhere 0, i.e. from now)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


async def off_loop(fn: Callable[[], T]) -> T:
    """`fn()` on a daemon thread, the event loop answering meanwhile. Unlike the default executor, a Ctrl-C
    during a long step (a GGUF conversion) is not held up at exit waiting for the thread."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if fut.done():  # the waiter was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)  # type: ignore[arg-type]

    def work() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            error = e
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server stopped meanwhile
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, name="rapidserve-startup", daemon=True).start()
    return await fut


def configure_logging(level: str = "info", http_level: str = "info", log_requests: bool = True) -> None:
    """The process's logs on stderr: rapidserve's at `level`, the HTTP server's own (aiohttp's loggers; vLLM's
    --uvicorn-log-level, "trace" read as debug) at `http_level`, and the per-request line only if `log_requests`."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    logging.getLogger("rapidserve").setLevel(level.upper())
    http = logging.DEBUG if http_level == "trace" else getattr(logging, http_level.upper())
    for name in HTTP_LOGGERS:
        logging.getLogger(name).setLevel(http)
    logging.getLogger(REQUEST_LOG).setLevel(logging.NOTSET if log_requests else logging.WARNING)


class StartupGate:
    """What the port answers from the moment it is bound until the engine is ready (module docstring).

    The gate accepts connections itself (a reader on each listening socket, `loop.add_reader`) and hands each
    to its runner's HTTP server (`loop.connect_accepted_socket`). `stop_accepting` removes the readers, which
    takes effect at once (no accept can follow it), and waits for the connections accepted so far to be
    handed over; a connection not accepted yet waits in the socket's backlog for the server proper, which
    then listens on the same sockets. (Closing or cancelling an asyncio accept instead can lose a
    just-accepted connection, leaving its client hanging.)"""

    def __init__(self) -> None:
        self.step = "starting"
        self.runner: web.BaseRunner | None = None
        self._fds: list[int] = []
        self._handing: set[asyncio.Task[Any]] = set()

    def set_step(self, step: str) -> None:
        """Say (in the log and in /health's reason) which start-up step runs now."""
        self.step = step
        log.info("start-up: %s", step)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._answer)
        return app

    async def open(self, runner: web.BaseRunner, sockets: list[socket.socket]) -> None:
        """Answer on `sockets` (listening, non-blocking) through `runner` (made over `app()`; set up here)."""
        await runner.setup()
        self.runner = runner
        loop = asyncio.get_running_loop()
        for sock in sockets:
            loop.add_reader(sock.fileno(), self._accept, loop, sock)
            self._fds.append(sock.fileno())

    def _accept(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        for _ in range(BACKLOG):
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors...: the connection stays in the backlog
                log.warning("start-up: accepting a connection failed (%s)", e)
                return
            conn.setblocking(False)
            task = loop.create_task(self._hand_over(loop, conn))
            self._handing.add(task)
            task.add_done_callback(self._handing.discard)

    async def _hand_over(self, loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
        assert self.runner is not None and self.runner.server is not None
        try:
            await loop.connect_accepted_socket(self.runner.server, conn)
        except OSError:  # the client left already
            conn.close()

    async def stop_accepting(self) -> None:
        """No new connection reaches the gate; the ones it accepted are handed to its server."""
        loop = asyncio.get_running_loop()
        for fd in self._fds:
            loop.remove_reader(fd)
        self._fds = []
        await asyncio.gather(*self._handing, return_exceptions=True)

    async def close(self) -> None:
        """Stop accepting and end the gate's connections (each answer closed its own already). Idempotent."""
        await self.stop_accepting()
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _answer(self, request: web.Request) -> web.Response:
        retry = {"Retry-After": "5"}
        if request.path in ("/health", "/ping"):
            resp = web.json_response({"status": "starting", "reason": f"the server is starting: {self.step}"},
                                     status=503, headers=retry)
        elif request.path == "/version" and request.method == "GET":
            resp = web.json_response({"version": __version__})
        else:
            err = APIError(503, f"the server is starting ({self.step}); retry when /health answers 200",
                           "server_error", code="server_starting", headers=retry)
            resp = web.json_response(err.body(), status=503, headers=err.headers)
        resp.force_close()
        return resp
