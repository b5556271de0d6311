"""The OpenAI-compatible HTTP server (aiohttp) over the engine's client API.

Routes: POST /v1/completions, /v1/chat/completions, /generate (plain native shape);
GET /v1/models, /health (200 only once the workers are ready; with data parallelism, while any engine
is, "degraded" when not all are), /metrics (Prometheus text),
/openapi.json (generated from the request types).

A request's way: headers and body are checked (server/body.py: JSON content type, size, UTF-8,
nesting; 415 / 413 / 400), the body is validated into a `GenRequest` (server/requests.py, types in
server/schemas.py: bad input -> OpenAI-style JSON error, 4xx, nothing else touched); admission is
bounded (max_num_seqs running per engine + max_waiting queued, beyond that 503 with Retry-After; a request
that could never fit is a 400); each prompt x sample becomes one engine request whose tokens are
detokenized incrementally (stop strings matched on the text, left out of the output unless
include_stop_str_in_output, as is the text of the stop token that ended it); a
stop-string match or a client that goes away aborts the engine request, which frees its KV
blocks (a client gone is one DEBUG line, whenever it left). One log line per request when it ends;
while the app runs, every log record is scrubbed of the API key and Authorization values
(server/redact.py).

Failures never cut a connection or answer twice: an engine failure (a worker died) or the end of
the shutdown grace (`end_all`) ends a stream with an OpenAI-style error event and `data: [DONE]`,
and a non-stream request with 503 + Retry-After. Every engine request is counted once in
`request_success_total`: its finish reason, `abort` (client gone, shutdown) or `error` (engine); a request
refused with a 503 before it reached the engine, in `request_rejected_total` (server/metrics.py). The
request gauges are the server's own counts of the choices in flight (`Choice.state`).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from rapidserve.config import EngineConfig, ServerConfig
from rapidserve.engine.client import AsyncEngine, ConstraintFailed, EngineError
from rapidserve.engine.data_parallel import DataParallelEngine
from rapidserve.engine.messages import TokenOut
from rapidserve.server.body import check_headers
from rapidserve.server.detokenizer import IncrementalDetokenizer
from rapidserve.server.errors import APIError
from rapidserve.server.metrics import Metrics, request_gauges
from rapidserve.server.openapi import openapi_document
from rapidserve.server.redact import Redactor, install
from rapidserve.server.requests import GenRequest, ProtocolContext, parse_request_async
from rapidserve.server.responses import (
    chat_role_chunk,
    chat_stream_chunks,
    final_response,
    new_chat_streams,
    stream_chunk,
    usage_chunk,
    usage_dict,
)
from rapidserve.server.startup import REQUEST_LOG
from rapidserve.server.utility_routes import UTILITY_PUBLIC_PATHS, add_utility_routes
from rapidserve.structured import GrammarTrials
from rapidserve.tokenizer import Tokenizer

log = logging.getLogger("rapidserve.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
OnDelta = Callable[["Choice", str, TokenOut], Awaitable[None]]
PUBLIC_PATHS = frozenset({"/health", "/openapi.json", *UTILITY_PUBLIC_PATHS})  # answered without the API key
request_log = logging.getLogger(REQUEST_LOG)  # the one line per request (--disable-log-requests: off)
# a stream's response once prepared (web.RequestKey from aiohttp 3.13; a plain key before)
_STREAM_KEY: Any = (web.RequestKey("rapidserve_stream", web.StreamResponse) if hasattr(web, "RequestKey")
                    else "rapidserve_stream")


class ServerStopping(EngineError):
    """The server ended the request: the shutdown grace is over, or the engine gave up."""


@dataclass
class Choice:
    """One prompt x sample of a request, as it is generated."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None
    ttft: float | None = None
    t_end: float | None = None  # when its engine request ended (monotonic)
    cached_tokens: int | None = None  # prompt tokens the engine found in its prefix cache
    queue: float | None = None  # arrival to its first prompt chunk queued on the device (engine's PhaseTimes)
    # where it is, for the request gauges: "queued" (admitted, not yet handed to the engine), "pending" (in the
    # engine, no token yet), "decoding" (a token came), "done" (its engine request ended)
    state: Literal["queued", "pending", "decoding", "done"] = "queued"


def grammar_trials(ecfg: EngineConfig, tokenizer: Tokenizer) -> GrammarTrials:
    """Whether the grammar engine can serve a constraint with this model's tokenizer (structured/trial.py)."""
    return GrammarTrials(lambda: tokenizer.hf, ecfg.model_config.vocab_size, tokenizer.eos_token_ids)


class Server:
    def __init__(self, cfg: ServerConfig, ecfg: EngineConfig, engine: AsyncEngine | DataParallelEngine,
                 tokenizer: Tokenizer | None,
                 model_name: str, tool_parser: str | None = None, aliases: Sequence[str] = (),
                 trials: GrammarTrials | None = None) -> None:
        """`trials`: the admission checks of structured-output constraints (`grammar_trials`; made here
        when not given and the model has a tokenizer)."""
        self.cfg, self.ecfg, self.engine, self.tok = cfg, ecfg, engine, tokenizer
        self.model_name = model_name  # reported in responses; requests may name it or any of `aliases`
        self.model_names = (model_name, *aliases)
        self.metrics = Metrics(model_name, ecfg.max_model_len, ecfg.cache)
        if trials is None and tokenizer is not None:
            trials = grammar_trials(ecfg, tokenizer)
        self.ctx = ProtocolContext(tokenizer, self.model_names, ecfg.max_model_len, ecfg.model_config.vocab_size,
                                   cfg.max_tokens_default(ecfg.generation), tool_parser,
                                   cfg.trust_request_chat_template, cfg.reasoning_parser, ecfg.generation,
                                   trials=trials)
        self.capacity = ecfg.scheduler.max_num_seqs * ecfg.parallel.data_parallel_size + cfg.max_waiting
        self.inflight = 0
        self.draining = False
        self.ending: str | None = None  # set by end_all(): why every request still in flight was ended
        self._active: set[asyncio.Future[Any]] = set()  # the generation of each request in flight
        self._requests: dict[str, list[Choice]] = {}  # the choices of each admitted request, by id, until its end
        self._key = cfg.api_key.encode() if cfg.api_key is not None else None
        self._seq = itertools.count()
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes, middlewares=[self._errors, self._auth])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/generate", self._native)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/openapi.json", self._openapi)
        add_utility_routes(app, self.ctx, self.cfg, self._health)  # /tokenize, /detokenize, /version, /ping
        app.cleanup_ctx.append(self._redacting)
        return app

    async def _redacting(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs, no log record carries the API key or an Authorization value (server/redact.py)."""
        undo = install(Redactor([self.cfg.api_key] if self.cfg.api_key is not None else []))
        try:
            yield
        finally:
            undo()

    # ---- middleware: every failure is an OpenAI-style JSON error ----------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except ConnectionError as e:
            # the client went away (its body cut short, a response it no longer reads): its own doing, one DEBUG
            # line; aiohttp would log the exception with an ERROR traceback. What is returned goes nowhere.
            log.debug("client went away during %s %s: %s", request.method, request.path, type(e).__name__)
            started = request.get(_STREAM_KEY)
            return started if started is not None else _client_gone()
        except Exception as e:
            started = request.get(_STREAM_KEY)
            if started is None:
                return self._error_response(request, e)
            # the response has begun: a second one would corrupt the body; end the one under way
            log.exception("unhandled error on %s after its response began", request.path)
            return started

    def _error_response(self, request: web.Request, e: Exception) -> web.Response:
        if isinstance(e, APIError):
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        if isinstance(e, web.HTTPException):
            kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "invalid_request_error"}.get(e.status, "invalid_request_error")
            msg = {404: f"no route {request.path}", 405: f"method {request.method} is not allowed on {request.path}",
                   413: f"request body is larger than {self.cfg.max_body_bytes} bytes"}.get(e.status, e.reason)
            return web.json_response(APIError(e.status, msg, kind).body(), status=e.status)
        # a bug, not bad input: logged, and the client gets a 500 body
        log.error("unhandled error on %s", request.path, exc_info=e)
        err = APIError(500, "internal server error", "server_error")
        return web.json_response(err.body(), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._key is not None and not self._public(request.path) and not self._key_ok(request):
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
        return await handler(request)

    def _public(self, path: str) -> bool:
        return path in PUBLIC_PATHS or (path == "/metrics" and self.cfg.metrics_public)

    def _key_ok(self, request: web.Request) -> bool:
        """Whether the request carries `Authorization: Bearer <the key>`, the key compared in constant time.
        aiohttp decodes header bytes that are not UTF-8 into lone surrogates; "surrogatepass" turns them
        back into bytes that can never equal the (UTF-8) key, so any malformed credential is a plain no."""
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        assert self._key is not None
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("utf-8", "surrogatepass"),
                                                                  self._key)

    # ---- simple routes ----------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        """200 {"status": "ok"} while the engine is ready; else 503 with the status and why:
        starting, restarting, down (the engine gave up or stopped) or draining (the server stops).
        With data parallelism the body lists every engine (`engines`), and the server is ready while
        any engine is: 200 with status "degraded" and the reason while others are not."""
        state = self.engine.state
        per_engine = self.engine.health() if isinstance(self.engine, DataParallelEngine) else None
        extra: dict[str, Any] = {"engines": per_engine} if per_engine is not None else {}
        if state == "ready" and not self.draining:
            if per_engine is not None and any(e["state"] != "ready" for e in per_engine):
                return web.json_response({"status": "degraded", "reason": self.engine.dead_reason, **extra})
            return web.json_response({"status": "ok", **extra})
        status = "draining" if self.draining else state
        reason = {"starting": "the engine workers are starting",
                  "draining": "the server is shutting down and takes no new requests"}.get(status)
        return web.json_response({"status": status, "reason": reason or self.engine.dead_reason or status, **extra},
                                 status=503, headers={"Retry-After": "5"})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": self.created, "owned_by": "rapidserve",
            "max_model_len": self.ecfg.max_model_len} for name in self.model_names]})

    async def _metrics(self, request: web.Request) -> web.Response:
        """Prometheus text. The request gauges are the server's own counts now (`request_gauges`: the
        workers' periodic stats only say which requests without a token yet are being prefilled)."""
        s = self.engine.stats
        self.metrics.set_engine_counters(self.engine.restarts_total, self.engine.deaths_total)
        where = Counter(c.state for choices in self._requests.values() for c in choices)
        running, waiting = request_gauges(where["queued"], where["pending"], where["decoding"],
                                          None if s is None else s.num_running + s.num_prefilling)
        self.metrics.set_requests(running, waiting)
        if s is not None:
            self.metrics.set_engine_stats(running, waiting, s.kv_blocks_total,
                                          s.kv_blocks_free, s.num_preemptions, s.partition,
                                          s.prefix_cache_queries, s.prefix_cache_hits, s.partition_switches,
                                          s.partition_steps)
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def _openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI document of every route, generated from the request and error types."""
        return web.json_response(openapi_document())

    # ---- generation -------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _native(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        created = int(time.time())  # the request's arrival (unix s): in its response and every chunk of its stream
        if self.draining:
            self.metrics.observe_rejected("server_shutting_down")
            raise APIError(503, "the server is shutting down", "server_error", code="server_shutting_down",
                           headers={"Retry-After": "5"})
        check_headers(request.headers.get("Content-Type"), request.content_length, self.cfg.max_body_bytes)
        try:  # a body trickled in slowly holds a connection like slow headers do
            raw = await asyncio.wait_for(request.read(), self.cfg.header_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.cfg.header_timeout_s:g} s",
                           code="request_timeout") from None
        req = await parse_request_async(kind, raw, self.ctx, max_choices=self.capacity)
        n = len(req.prompts) * req.params.n
        if self.inflight + n > self.capacity:
            self.metrics.observe_rejected("overloaded")
            raise APIError(503, f"the server is at capacity ({self.capacity} requests); retry later",
                                 "server_error", code="overloaded", headers={"Retry-After": "1"})
        self.inflight += n
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        t0 = time.monotonic()
        choices = [Choice(i * req.params.n + j, list(p)) for i, p in enumerate(req.prompts)
                   for j in range(req.params.n)]
        self._requests[rid] = choices
        try:
            if req.stream:
                return await self._stream(request, req, rid, created, choices)
            await self._generate(rid, req, choices, None)
            return web.json_response(self._final(req, rid, created, choices))
        except (EngineError, ValueError) as e:
            raise _api_error(e, req.structured_param) from None
        finally:
            self.inflight -= n
            self._requests.pop(rid, None)
            out = sum(len(c.token_ids) for c in choices)
            ttft = min((c.ttft for c in choices if c.ttft is not None), default=float("nan"))
            request_log.info("request %s kind=%s prompt_tokens=%d generated_tokens=%d ttft=%.3fs total=%.3fs finish=%s",
                             rid, kind, sum(len(p) for p in req.prompts), out, ttft, time.monotonic() - t0,
                             ",".join(str(c.finish_reason) for c in choices))

    def end_all(self, reason: str) -> int:
        """End every request in flight now (shutdown grace over, engine gone): streams get an error
        event and [DONE], the others a 503. Returns how many were ended."""
        self.ending = reason
        active = list(self._active)
        for fut in active:
            fut.cancel()
        return len(active)

    async def _generate(self, rid: str, req: GenRequest, choices: list[Choice], on_delta: OnDelta | None,
                        prelude: Callable[[], Awaitable[None]] | None = None) -> None:
        """Run every choice of a request (after `prelude`, which a stream uses to begin its response);
        the first failure ends the others. Counts each choice once in the metrics, however it ends; a request
        refused before it reached the engine (not ready, ending) counts as rejected instead, with no prompt
        tokens. Raises EngineError (at once when the engine is not ready; ServerStopping after end_all)."""
        t0 = time.monotonic()
        refusal = self._refusal()
        if refusal is not None:  # before a stream's response begins: a plain 503
            raise refusal
        tasks: list[asyncio.Future[None]] = []
        group: asyncio.Future[Any] | None = None
        failure = "abort"  # a client that went away, a cancelled handler, end_all
        try:
            if prelude is not None:
                await prelude()
                refusal = self._refusal()  # (it may have changed while the response began)
                if refusal is not None:
                    raise refusal
            for c in choices:
                self.metrics.add_prompt_tokens(len(c.prompt_ids))
            for _ in req.prompts:
                self.metrics.observe_params(req.params.n, req.params.max_tokens)
            tasks = [asyncio.ensure_future(self._run(rid, req, c, on_delta)) for c in choices]
            group = asyncio.gather(*tasks)
            self._active.add(group)
            await group
        except ServerStopping:
            raise
        except asyncio.CancelledError:
            if self.ending is None or _cancelling():
                raise
            raise ServerStopping(self.ending) from None
        except ConnectionError:  # the client went away: an abort
            raise
        except Exception:
            failure = "error"
            raise
        finally:
            if group is not None:
                self._active.discard(group)
            for t in tasks:
                t.cancel()  # those still running after a failure; their engine requests are aborted
            now = time.monotonic()
            for c in choices if refusal is None else []:
                self.metrics.observe_finished((c.t_end or now) - t0, len(c.prompt_ids), len(c.token_ids),
                                              c.finish_reason or failure, ttft_s=c.ttft, queue_s=c.queue)
            n = req.params.n  # choice i * n + j is prompt i's sample j
            for i in range(len(req.prompts) if refusal is None else 0):
                self.metrics.observe_samples_done([len(c.token_ids) for c in choices[i * n:(i + 1) * n]])

    def _refusal(self) -> EngineError | None:
        """Why no request can go to the engine now (end_all ran, or the engine is not ready: starting,
        restarting, down), counted as a rejected request; None when one can."""
        if self.ending is not None:
            self.metrics.observe_rejected("server_shutting_down")
            return ServerStopping(self.ending)
        if self.engine.state != "ready":
            self.metrics.observe_rejected("engine_unavailable")
            return EngineError(f"the engine is not ready ({self.engine.state}): "
                               f"{self.engine.dead_reason or 'try again shortly'}")
        return None

    async def _run(self, rid: str, req: GenRequest, c: Choice, on_delta: OnDelta | None) -> None:
        """Generate one choice: detokenize, match stop strings, time tokens; abort on stop/cancel."""
        p = req.params
        params = p.for_sample(c.index % p.n)
        detok = IncrementalDetokenizer(self.tok, c.prompt_ids, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output)
        t0 = last = time.monotonic()
        stream = self.engine.generate(f"{rid}-{c.index}", c.prompt_ids, params)
        c.state = "pending"
        try:
            async for tok in stream:
                now = time.monotonic()
                if c.ttft is None:
                    c.state = "decoding"
                    c.ttft = now - t0
                    c.cached_tokens = tok.cached_tokens
                    self.metrics.observe_first_token(c.ttft)
                    if tok.times is not None:
                        ph = tok.times
                        c.queue = max(0.0, ph.started - t0)
                        self.metrics.observe_phases(t0, ph.admitted, ph.started, ph.sampled, now)
                else:
                    self.metrics.observe_token(now - last)
                last = now
                c.token_ids.append(tok.token_id)
                c.logprobs.append(tok.logprob)
                c.top_logprobs.append(tok.top_logprobs)
                # the engine's "stop" is EOS or a stop token id: its text only with include_stop_str_in_output (vLLM)
                stop_token = tok.finish_reason == "stop" and not p.include_stop_str_in_output
                delta = "" if stop_token else detok.add(tok.token_id)
                if detok.stopped:
                    c.finish_reason = "stop"
                elif tok.finish_reason is not None:
                    c.finish_reason = tok.finish_reason
                    delta += detok.flush()
                c.text += delta
                if c.finish_reason is not None:
                    c.t_end = time.monotonic()
                if on_delta is not None:
                    await on_delta(c, delta, tok)
                if c.finish_reason is not None:
                    break
        finally:
            c.t_end = c.t_end or time.monotonic()
            c.state = "done"
            await stream.aclose()  # aborts the engine request if it had not finished

    def _final(self, req: GenRequest, rid: str, created: int, choices: list[Choice]) -> dict[str, Any]:
        return final_response(req, rid, created, self.model_name, choices, _usage(req, choices), self.tok)

    async def _stream(self, request: web.Request, req: GenRequest, rid: str, created: int,
                      choices: list[Choice]) -> web.StreamResponse:
        """Server-sent events. Once the response has begun it always ends well-formed: an error becomes
        an error event, then `data: [DONE]` and the end of the chunked body, never a second response."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        lock = asyncio.Lock()

        async def send(obj: dict[str, Any]) -> None:
            async with lock:
                await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        reads = new_chat_streams(req, [c.index for c in choices])  # chat read for reasoning or tool calls

        async def on_delta(c: Choice, delta: str, tok: TokenOut) -> None:
            for chunk in (chat_stream_chunks(req, rid, created, self.model_name, c.index, delta, tok, c.finish_reason,
                                             self.tok, reads[c.index]) if reads is not None else
                          [stream_chunk(req, rid, created, self.model_name, c.index, delta, tok, c.finish_reason,
                                        self.tok, text_offset=len(c.text) - len(delta))]):
                await send(chunk)

        async def prelude() -> None:
            await resp.prepare(request)
            request[_STREAM_KEY] = resp
            for c in choices if req.kind == "chat" else []:
                await send(chat_role_chunk(rid, created, self.model_name, c.index))

        try:
            await self._generate(rid, req, choices, on_delta, prelude)
            if req.include_usage:
                await send(usage_chunk(req, rid, created, self.model_name, _usage(req, choices)))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away (or the handler was cancelled): nothing more can be sent
        except Exception as e:  # noqa: BLE001 - ended with an error event, never a second response
            if not resp.prepared:
                raise  # nothing sent yet: the error middleware answers it (503 for an engine error)
            if isinstance(e, EngineError):
                log.warning("request %s ended with an error: %s", rid, e)
            elif not isinstance(e, (ValueError, APIError)):
                log.exception("request %s failed", rid)
            await send({"error": _error_body(e, req.structured_param)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _client_gone() -> web.Response:
    """The answer to a request whose client went away before its response began (nginx's 499): only
    sent if the connection was, against all likelihood, still open; then closed."""
    resp = web.json_response(APIError(499, "the client closed the connection", code="client_closed_request").body(),
                             status=499)
    resp.force_close()
    return resp


def _error_body(e: Exception, structured_param: str | None = None) -> dict[str, Any]:
    """The `error` object of an OpenAI-style error for an exception that ended a request."""
    if isinstance(e, (APIError, EngineError, ValueError)):
        return _api_error(e, structured_param).body()["error"]
    return APIError(500, "internal server error", "server_error").body()["error"]


def _api_error(e: APIError | EngineError | ValueError, structured_param: str | None = None) -> APIError:
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


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (Python 3.11+; False before)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


def _usage(req: GenRequest, choices: list[Choice]) -> dict[str, Any]:
    """Usage of a whole request: each prompt counted once, its cached tokens as its first sample found them."""
    firsts = [c.cached_tokens for c in choices if c.index % req.params.n == 0]
    cached = None if any(x is None for x in firsts) else sum(x for x in firsts if x is not None)
    return usage_dict(sum(len(p) for p in req.prompts), sum(len(c.token_ids) for c in choices), cached)
