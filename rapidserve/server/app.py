"""The OpenAI-compatible HTTP server (aiohttp) over the engine's client API.

Routes: POST /v1/completions, /v1/chat/completions, /generate (plain native shape);
GET /v1/models, /health (200 only once the workers are ready), /metrics (Prometheus text).

A request's way: the body is validated into a `GenRequest` (protocol.py: bad input -> OpenAI-style
JSON error, 4xx, nothing else touched); admission is bounded (max_num_seqs running + max_waiting
queued, beyond that 503 with Retry-After); each prompt x sample becomes one engine request whose
tokens are detokenized incrementally (stop strings matched on the text, left out of the output);
a stop-string match or a client that goes away aborts the engine request, which frees its KV
blocks. One log line per request when it ends.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from rapidserve.config import EngineConfig, ServerConfig
from rapidserve.engine.client import AsyncEngine, EngineError
from rapidserve.engine.messages import TokenOut
from rapidserve.sampling_params import SamplingParams
from rapidserve.server import protocol as proto
from rapidserve.server.detokenizer import IncrementalDetokenizer
from rapidserve.server.metrics import Metrics
from rapidserve.tokenizer import Tokenizer

log = logging.getLogger("rapidserve.server")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


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


class Server:
    def __init__(self, cfg: ServerConfig, ecfg: EngineConfig, engine: AsyncEngine, tokenizer: Tokenizer | None,
                 model_name: str) -> None:
        self.cfg, self.ecfg, self.engine, self.tok = cfg, ecfg, engine, tokenizer
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self.ctx = proto.ProtocolContext(tokenizer, (model_name,), ecfg.max_model_len,
                                         ecfg.model_config.vocab_size, cfg.default_max_tokens)
        self.capacity = ecfg.scheduler.max_num_seqs + cfg.max_waiting
        self.inflight = 0
        self.draining = False
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
        return app

    # ---- middleware: every failure is an OpenAI-style JSON error ----------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except proto.APIError as e:
            return web.json_response(e.body(), status=e.status, headers=e.headers)
        except web.HTTPException as e:
            kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                    413: "invalid_request_error"}.get(e.status, "invalid_request_error")
            msg = {404: f"no route {request.path}", 405: f"method {request.method} is not allowed on {request.path}",
                   413: f"request body is larger than {self.cfg.max_body_bytes} bytes"}.get(e.status, e.reason)
            return web.json_response(proto.APIError(e.status, msg, kind).body(), status=e.status)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception:  # a bug, not bad input: logged, and the client gets a 500 body
            log.exception("unhandled error on %s", request.path)
            err = proto.APIError(500, "internal server error", "server_error")
            return web.json_response(err.body(), status=500)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        key = self.cfg.api_key
        public = request.path in ("/health", "/metrics")
        if key is not None and not public and request.headers.get("Authorization", "") != f"Bearer {key}":
            raise proto.APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                                 "authentication_error", code="invalid_api_key")
        return await handler(request)

    # ---- simple routes ----------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        if self.engine.running and not self.draining:
            return web.json_response({"status": "ok"})
        return web.json_response({"status": "unavailable", "reason": self.engine.dead_reason or "starting"},
                                 status=503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "rapidserve",
            "max_model_len": self.ecfg.max_model_len}]})

    async def _metrics(self, request: web.Request) -> web.Response:
        s = self.engine.stats
        if s is not None:
            self.metrics.set_engine_stats(s.num_running + s.num_prefilling, s.num_waiting, s.kv_blocks_total,
                                          s.kv_blocks_free, s.num_preemptions, s.partition)
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    # ---- generation -------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "completion")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "chat")

    async def _native(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "generate")

    async def _serve(self, request: web.Request, kind: str) -> web.StreamResponse:
        if self.draining:
            raise proto.APIError(503, "the server is shutting down", "server_error", headers={"Retry-After": "5"})
        req = proto.parse_request(kind, await request.read(), self.ctx)
        n = len(req.prompts) * req.params.n
        if self.inflight + n > self.capacity:
            raise proto.APIError(503, f"the server is at capacity ({self.capacity} requests); retry later",
                                 "server_error", code="overloaded", headers={"Retry-After": "1"})
        self.inflight += n
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex[:24]}"
        t0 = time.monotonic()
        choices = [Choice(i * req.params.n + j, list(p)) for i, p in enumerate(req.prompts)
                   for j in range(req.params.n)]
        try:
            if req.stream:
                return await self._stream(request, req, rid, choices)
            await asyncio.gather(*(self._run(rid, req, c, None) for c in choices))
            return web.json_response(self._final(req, rid, choices))
        except EngineError as e:
            raise proto.APIError(503, f"the engine could not complete the request: {e}", "server_error",
                                 headers={"Retry-After": "5"}) from None
        finally:
            self.inflight -= n
            out = sum(len(c.token_ids) for c in choices)
            ttft = min((c.ttft for c in choices if c.ttft is not None), default=float("nan"))
            log.info("request %s kind=%s prompt_tokens=%d generated_tokens=%d ttft=%.3fs total=%.3fs finish=%s",
                     rid, kind, sum(len(p) for p in req.prompts), out, ttft, time.monotonic() - t0,
                     ",".join(str(c.finish_reason) for c in choices))

    async def _run(self, rid: str, req: proto.GenRequest, c: Choice,
                   on_delta: Callable[[Choice, str, TokenOut], Awaitable[None]] | None) -> None:
        """Generate one choice: detokenize, match stop strings, time tokens; abort on stop/cancel."""
        p = req.params
        params = _sub_params(p, c.index % p.n)
        detok = IncrementalDetokenizer(self.tok, c.prompt_ids, p.skip_special_tokens, p.stop)
        self.metrics.add_prompt_tokens(len(c.prompt_ids))
        t0 = last = time.monotonic()
        stream = self.engine.generate(f"{rid}-{c.index}", c.prompt_ids, params)
        try:
            async for tok in stream:
                now = time.monotonic()
                if c.ttft is None:
                    c.ttft = now - t0
                    self.metrics.observe_first_token(c.ttft)
                else:
                    self.metrics.observe_token(now - last)
                last = now
                c.token_ids.append(tok.token_id)
                c.logprobs.append(tok.logprob)
                c.top_logprobs.append(tok.top_logprobs)
                delta = detok.add(tok.token_id)
                if detok.stopped:
                    c.finish_reason = "stop"
                elif tok.finish_reason is not None:
                    c.finish_reason = tok.finish_reason
                    delta += detok.flush()
                c.text += delta
                if on_delta is not None:
                    await on_delta(c, delta, tok)
                if c.finish_reason is not None:
                    break
        finally:
            await stream.aclose()  # aborts the engine request if it had not finished
        self.metrics.observe_finished(time.monotonic() - t0, len(c.prompt_ids), len(c.token_ids),
                                      c.finish_reason or "abort", ttft_s=c.ttft)

    def _final(self, req: proto.GenRequest, rid: str, choices: list[Choice]) -> dict[str, Any]:
        usage = proto.usage_dict(sum(len(p) for p in req.prompts), sum(len(c.token_ids) for c in choices))
        return proto.final_response(req, rid, self.created, self.model_name, choices, usage, self.tok)

    async def _stream(self, request: web.Request, req: proto.GenRequest, rid: str,
                      choices: list[Choice]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        lock = asyncio.Lock()
        created = int(time.time())

        async def send(obj: dict[str, Any]) -> None:
            async with lock:
                await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        for c in choices if req.kind == "chat" else []:
            await send(proto.chat_role_chunk(rid, created, self.model_name, c.index))

        async def on_delta(c: Choice, delta: str, tok: TokenOut) -> None:
            await send(proto.stream_chunk(req, rid, created, self.model_name, c.index, delta, tok,
                                          c.finish_reason, self.tok, text_offset=len(c.text) - len(delta)))

        await asyncio.gather(*(self._run(rid, req, c, on_delta) for c in choices))
        if req.include_usage:
            usage = proto.usage_dict(sum(len(p) for p in req.prompts), sum(len(c.token_ids) for c in choices))
            await send(proto.usage_chunk(req, rid, created, self.model_name, usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _sub_params(p: SamplingParams, j: int) -> SamplingParams:
    """The engine runs one sample per request: n=1, and sample j of a seeded request gets seed + j."""
    import msgspec

    return msgspec.structs.replace(p, n=1, seed=None if p.seed is None else p.seed + j)
