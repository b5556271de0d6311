"""The HTTP middleware around every route, and the error bodies a request that failed is answered with.

`error_middleware`: every failure is an OpenAI-style JSON error (a bug is a logged 500), a client gone is one
DEBUG line, and a response that has begun is never answered twice (a stream's prepared response sits under
`STREAM_KEY`). `auth_middleware`: the API key, compared in constant time, on every route but `PUBLIC_PATHS`
(and /metrics with `--metrics-public`). `redacting`: while the app runs, every log record is scrubbed of the
API key and Authorization values (server/redact.py). `api_error` / `error_body` map an exception that ended a
request to its OpenAI-style error (400 for the client's, 503 + Retry-After for the engine's or the server's).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from rapidserve.engine.errors import ConstraintFailed, EngineError
from rapidserve.server.errors import APIError
from rapidserve.server.redact import Redactor, install
from rapidserve.server.utility_routes import UTILITY_PUBLIC_PATHS

log = logging.getLogger("rapidserve.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", *UTILITY_PUBLIC_PATHS})  # answered without the API key
# a stream's response once prepared (web.RequestKey from aiohttp 3.13; a plain key before)
STREAM_KEY: Any = (web.RequestKey("rapidserve_stream", web.StreamResponse) if hasattr(web, "RequestKey")
                   else "rapidserve_stream")


class ServerStopping(EngineError):
    """The server ended the request: the shutdown grace is over, or the engine gave up."""


def redacting(api_key: str | None) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's cleanup context: while the app runs, no log record carries the API key or an Authorization
    value (server/redact.py)."""

    async def scrub(app: web.Application) -> AsyncIterator[None]:
        undo = install(Redactor([api_key] if api_key is not None else []))
        try:
            yield
        finally:
            undo()

    return scrub


# ---- every failure is an OpenAI-style JSON error ----------------------------------------------
def error_middleware(max_body_bytes: int) -> Middleware:
    """`max_body_bytes`: named in the 413 of a body over it."""

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except ConnectionError as e:
            # the client went away (its body cut short, a response it no longer reads): its own doing, one DEBUG
            # line; aiohttp would log the exception with an ERROR traceback. What is returned goes nowhere.
            log.debug("client went away during %s %s: %s", request.method, request.path, type(e).__name__)
            started = request.get(STREAM_KEY)
            return started if started is not None else _client_gone()
        except Exception as e:
            started = request.get(STREAM_KEY)
            if started is None:
                return error_response(request, e, max_body_bytes)
            # the response has begun: a second one would corrupt the body; end the one under way
            log.exception("unhandled error on %s after its response began", request.path)
            return started

    return errors


def error_response(request: web.Request, e: Exception, max_body_bytes: int) -> web.Response:
    if isinstance(e, APIError):
        return web.json_response(e.body(), status=e.status, headers=e.headers)
    if isinstance(e, web.HTTPException):
        kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "invalid_request_error"}.get(e.status, "invalid_request_error")
        msg = {404: f"no route {request.path}", 405: f"method {request.method} is not allowed on {request.path}",
               413: f"request body is larger than {max_body_bytes} bytes"}.get(e.status, e.reason)
        return web.json_response(APIError(e.status, msg, kind).body(), status=e.status)
    # a bug, not bad input: logged, and the client gets a 500 body
    log.error("unhandled error on %s", request.path, exc_info=e)
    err = APIError(500, "internal server error", "server_error")
    return web.json_response(err.body(), status=500)


# ---- the API key ------------------------------------------------------------------------------
def auth_middleware(api_key: str | None, metrics_public: bool) -> Middleware:
    """Every route but the public ones needs `Authorization: Bearer <api_key>` (none when `api_key` is None);
    `metrics_public`: /metrics is public too."""
    key = api_key.encode() if api_key is not None else None

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        if key is not None and not is_public(request.path, metrics_public) and not key_ok(request, key):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
        return await handler(request)

    return auth


def is_public(path: str, metrics_public: bool) -> bool:
    return path in PUBLIC_PATHS or (path == "/metrics" and metrics_public)


def key_ok(request: web.Request, key: bytes) -> bool:
    """Whether the request carries `Authorization: Bearer <the key>`, the key compared in constant time.
    aiohttp decodes header bytes that are not UTF-8 into lone surrogates; "surrogatepass" turns them
    back into bytes that can never equal the (UTF-8) key, so any malformed credential is a plain no."""
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"), key)


# ---- the error bodies -------------------------------------------------------------------------
def _client_gone() -> web.Response:
    """The answer to a request whose client went away before its response began (nginx's 499): only
    sent if the connection was, against all likelihood, still open; then closed."""
    resp = web.json_response(APIError(499, "the client closed the connection", code="client_closed_request").body(),
                             status=499)
    resp.force_close()
    return resp


def error_body(e: Exception, structured_param: str | None = None) -> dict[str, Any]:
    """The `error` object of an OpenAI-style error for an exception that ended a request."""
    if isinstance(e, (APIError, EngineError, ValueError)):
        return api_error(e, structured_param).body()["error"]
    return APIError(500, "internal server error", "server_error").body()["error"]


def api_error(e: APIError | EngineError | ValueError, structured_param: str | None = None) -> APIError:
    """A prompt the engine refused (RequestRejected, a ValueError; the parser checks first) is the
    client's error, 400, and so is a structured-output constraint the grammar engine could not serve while
    generating (ConstraintFailed: 400 naming the request's field, `structured_param`); any other engine
    failure is 503 (`_unavailable`)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ConstraintFailed):
        return APIError(400, f"'{structured_param}' could not be enforced: {e}" if structured_param else str(e),
                        param=structured_param, code="structured_output_failed")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param="prompt")
    return _unavailable(e)


def _unavailable(e: EngineError) -> APIError:
    """503 + Retry-After for a request the engine could not complete, or the server ended."""
    if isinstance(e, ServerStopping):
        return APIError(503, f"the request was ended: {e}", "server_error", code="server_shutting_down",
                              headers={"Retry-After": "5"})
    return APIError(503, f"the engine could not complete the request: {e}", "server_error",
                          code="engine_unavailable", headers={"Retry-After": "5"})
