"""Connection limits aiohttp lacks: a request-head timeout and a cap on open connections.

aiohttp closes an idle keep-alive connection after `keepalive_timeout`, but a client that opens a
connection and trickles its request line and headers (slowloris) is held for as long as it keeps
sending, and every idle connection is held until then. `GuardedRunner` is a `web.AppRunner` whose
connections are `_GuardedHandler`s:

* head timeout: from the moment a connection is made, or from the first byte of a later request,
  the request line and headers must be complete within `header_timeout_s`, else the connection
  is closed (a request being handled is never cut: the timer only runs while the connection waits
  for a request head);
* cap: at `max_connections` open connections a new one makes room by closing the oldest idle one
  (one that waits for a request head); when every connection is busy with a request, the new one
  gets a 503 and is closed at once;
* malformed request heads (a header holding a NUL, DEL or bare CR, a line over aiohttp's 8190-byte
  limit, a bad request line): the client's error, so one DEBUG line naming the kind of fault, never the
  bytes (aiohttp's own path logs the raw header line, API key included, with an ERROR traceback), and
  an OpenAI-style JSON 400 that does not echo them either.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, BadStatusLine, LineTooLong
from aiohttp.web_protocol import RequestHandler

log = logging.getLogger("rapidserve.server")

_FULL_BODY = json.dumps({"error": {
    "message": "the server has too many open connections; retry later", "type": "server_error", "param": None,
    "code": "too_many_connections"}}).encode()
FULL_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                 b"Connection: close\r\nContent-Length: " + str(len(_FULL_BODY)).encode() + b"\r\n\r\n" + _FULL_BODY)


def malformed_head_response(exc: BadHttpMessage, status: int) -> web.Response:
    """The answer to a request head aiohttp could not parse: what kind of fault, never the bytes."""
    what = ("a request line or header is longer than the server accepts" if isinstance(exc, LineTooLong)
            else "the request line is malformed" if isinstance(exc, BadStatusLine)
            else "a header is malformed (a NUL, DEL or bare CR in it, or no ':')")
    body = {"error": {"message": f"malformed HTTP request: {what}", "type": "invalid_request_error",
                      "param": None, "code": "bad_http_request"}}
    resp = web.json_response(body, status=status)
    resp.force_close()
    return resp


class _GuardedHandler(RequestHandler):
    """aiohttp's connection protocol with the head timeout and the connection cap."""

    def __init__(self, manager: _GuardedServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._rejected = False
        self._head_timer: asyncio.TimerHandle | None = None

    def waits_for_head(self) -> bool:
        """True while no request is being handled or queued: the connection waits for a request head."""
        return self._waiter is not None and not self._messages

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        g = self._guard
        if len(g.live) >= g.max_connections and not g.evict_idle():
            self._rejected = True
            g.rejected_total += 1
            tr: Any = transport
            tr.write(FULL_RESPONSE)
            tr.close()
            return
        g.live[self] = None
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._rejected:
            return
        self._disarm()
        self._guard.live.pop(self, None)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        super().data_received(data)
        if self._messages:  # a whole request head arrived
            self._disarm()
        elif self._head_timer is None and self.waits_for_head():  # the first bytes of a later request
            self._arm()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, BadHttpMessage) or status >= 500 or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        log.debug("malformed request from %s: %s (%d)", request.remote, type(exc).__name__, status)
        return malformed_head_response(exc, status)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = self._loop.call_later(self._guard.header_timeout_s, self._on_head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _on_head_timeout(self) -> None:
        self._head_timer = None
        if self.transport is not None and self.waits_for_head():
            self._guard.head_timeouts_total += 1
            self.force_close()  # also closes the transport


class _GuardedServer(web.Server):
    """aiohttp's low-level server (one per runner) making `_GuardedHandler` connections."""

    def __init__(self, *args: Any, header_timeout_s: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout_s, self.max_connections = header_timeout_s, max_connections
        self.live: dict[_GuardedHandler, None] = {}  # open connections, oldest first
        self.rejected_total = self.evicted_total = self.head_timeouts_total = 0

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)

    def evict_idle(self) -> bool:
        """Close the oldest connection that waits for a request head; False if every one is busy."""
        for h in self.live:
            if h.waits_for_head():
                self.evicted_total += 1
                self.live.pop(h, None)
                h.force_close()
                return True
        return False


class GuardedRunner(web.AppRunner):
    """`web.AppRunner` with the head timeout and the connection cap (see the module docstring)."""

    def __init__(self, app: web.Application, *, header_timeout_s: float, max_connections: int,
                 **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._guard_args = {"header_timeout_s": header_timeout_s, "max_connections": max_connections}

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts the app; gives its handler and request factory
        kwargs = dict(self._kwargs)
        kwargs.pop("handler_cancellation", None)
        return _GuardedServer(plain.request_handler, request_factory=plain.request_factory,
                              handler_cancellation=plain.handler_cancellation, loop=asyncio.get_running_loop(),
                              **self._guard_args, **kwargs)

    @property
    def guard(self) -> _GuardedServer | None:
        server = self.server
        return server if isinstance(server, _GuardedServer) else None
