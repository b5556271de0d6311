"""The OpenAI-compatible HTTP server (aiohttp) over the engine's client API.

Routes: POST /v1/completions, /v1/chat/completions, /generate (plain native shape);
GET /v1/models, /health (200 only once the workers are ready; with data parallelism, while any engine
is, "degraded" when not all are), /metrics (Prometheus text),
/openapi.json (generated from the request types).

A request's way: headers and body are checked (server/body.py: JSON content type, size, UTF-8,
nesting; 415 / 413 / 400), the body is validated into a `GenRequest` (server/requests.py, types in
server/schemas.py: bad input -> OpenAI-style JSON error, 4xx, nothing else touched); admission is
bounded (each engine's seats, `batch_limits.seats`, + max_waiting queued, beyond that 503 with Retry-After; a request
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
`request_success_total`, on its engine: its finish reason, `abort` (client gone, shutdown, a sibling sample's
failure) or `error` (its engine failed it); with several engines one that never reached an engine on none
(server/generation.py `_count`); a request refused with a 503 before it reached the engine, in
`request_rejected_total` (server/metrics.py). The
request gauges are the server's own counts of the choices in flight (`Choice.state`).

`Server` is the route table; it composes the middleware (server/middleware.py: error mapping, the API key,
log redaction, the error bodies) and the generation path (server/generation.py: a request's choices run on
the engine, streamed or answered whole, with their usage).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from rapidserve.batch_limits import config_seats
from rapidserve.config import EngineConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.data_parallel import DataParallelEngine
from rapidserve.engine.errors import EngineError
from rapidserve.server.body import check_headers
from rapidserve.server.errors import APIError
from rapidserve.server.generation import Choice, Generation
from rapidserve.server.metrics import Metrics, request_gauges
from rapidserve.server.middleware import api_error, auth_middleware, error_middleware, redacting
from rapidserve.server.openapi import openapi_document
from rapidserve.server.requests import GenRequest, ProtocolContext, parse_request_async
from rapidserve.server.startup import REQUEST_LOG
from rapidserve.server.utility_routes import add_utility_routes
from rapidserve.server_config import ServerConfig
from rapidserve.structured import GrammarTrials
from rapidserve.tokenizer import Tokenizer

request_log = logging.getLogger(REQUEST_LOG)  # the one line per request (--disable-log-requests: off)


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
        engines = len(engine.engines) if isinstance(engine, DataParallelEngine) else 1
        self.metrics = Metrics(model_name, ecfg.max_model_len, ecfg.cache, engines)  # vLLM's series: one per engine
        if trials is None and tokenizer is not None:
            trials = grammar_trials(ecfg, tokenizer)
        self.ctx = ProtocolContext(tokenizer, self.model_names, ecfg.max_model_len, ecfg.model_config.vocab_size,
                                   cfg.max_tokens_default(ecfg.generation), tool_parser,
                                   cfg.trust_request_chat_template, cfg.reasoning_parser, ecfg.generation,
                                   trials=trials, default_template_kwargs=dict(cfg.default_chat_template_kwargs or {}),
                                   exclude_tools_when_none=cfg.exclude_tools_when_tool_choice_none,
                                   force_include_usage=cfg.force_include_usage)
        # the seats (max_num_seqs, at most the largest decode graph: batch_limits.seats) of each engine + the queue
        self.capacity = config_seats(ecfg) * ecfg.parallel.data_parallel_size + cfg.max_waiting
        self.inflight = 0
        self.draining = False
        self.gen = Generation(engine, tokenizer, self.metrics, model_name)  # running admitted requests
        self._requests: dict[str, list[Choice]] = {}  # the choices of each admitted request, by id, until its end
        self._seq = itertools.count()
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.cfg.max_body_bytes,
                              middlewares=[error_middleware(self.cfg.max_body_bytes),
                                           auth_middleware(self.cfg.api_key, self.cfg.metrics_public)])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/generate", self._native)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/openapi.json", self._openapi)
        add_utility_routes(app, self.ctx, self.cfg, self._health)  # /tokenize, /detokenize, /version, /ping
        app.cleanup_ctx.append(redacting(self.cfg.api_key))
        return app

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
        """Prometheus text. vLLM's series per engine, from its own Stats; the request gauges are the server's own
        counts now, of the requests each engine holds (`request_gauges`: the workers' periodic stats only say which
        requests without a token yet are being prefilled); rapidserve's from the whole server's Stats."""
        s = self.engine.stats  # with data parallelism the engines' combined (engine/dp_stats.py)
        dp = isinstance(self.engine, DataParallelEngine)
        per = self.engine.engine_stats if dp else [s]
        self.metrics.set_engine_counters(self.engine.restarts_total, self.engine.deaths_total)
        # with one engine a request not yet handed to it is its anyway; with several, on none until dispatched
        where = Counter((c.engine if dp else 0, c.state) for choices in self._requests.values() for c in choices)
        for i, e in enumerate(per):
            running, waiting = request_gauges(where[i, "queued"], where[i, "pending"], where[i, "decoding"],
                                              None if e is None else e.num_running + e.num_prefilling)
            if e is None:
                self.metrics.set_requests(running, waiting, i)
                self.metrics.engine_down(i)
            else:
                self.metrics.set_engine(i, running, waiting, e.kv_blocks_total, e.kv_blocks_free, e.num_preemptions,
                                        e.prefix_cache_queries, e.prefix_cache_hits)
        if s is not None:
            self.metrics.set_partition(s.partition, s.partition_switches, s.partition_steps)
            self.metrics.set_step_stats(s.step_kinds, s.step_correction)
            self.metrics.set_hand_overs(s.num_hand_overs)
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
                return await self.gen.stream(request, req, rid, created, choices)
            await self.gen.generate(rid, req, choices, None)
            return web.json_response(self.gen.final(req, rid, created, choices))
        except (EngineError, ValueError) as e:
            raise api_error(e, req.structured_param) from None
        finally:
            self.inflight -= n
            self._requests.pop(rid, None)
            out = sum(len(c.token_ids) for c in choices)
            ttft = min((c.ttft for c in choices if c.ttft is not None), default=float("nan"))
            request_log.info("request %s kind=%s prompt_tokens=%d generated_tokens=%d ttft=%.3fs total=%.3fs "
                             "finish=%s%s",
                             rid, kind, sum(len(p) for p in req.prompts), out, ttft, time.monotonic() - t0,
                             ",".join(str(c.finish_reason) for c in choices), _asked_ids(req))

    def end_all(self, reason: str) -> int:
        """End every request in flight now (shutdown grace over, engine gone): streams get an error
        event and [DONE], the others a 503. Returns how many were ended."""
        return self.gen.end_all(reason)


def _asked_ids(req: GenRequest) -> str:
    """The ids the request gave itself, for its log line: vLLM's request_id, OpenAI's user and safety_identifier
    (end-user ids for abuse monitoring: this log is where an operator finds them)."""
    ids = (("request_id", req.request_id), ("user", req.user), ("safety_identifier", req.safety_identifier))
    return "".join(f" {k}={json.dumps(v)}" for k, v in ids if v is not None)
