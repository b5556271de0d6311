"""The generation path of an admitted request: its choices run on the engine, streamed or answered whole.

`Generation.generate` runs every choice (one prompt x sample, `Choice`) of a request on the engine, the
first failure ending the others, and counts each choice once in the metrics however it ends (`_count`); `run` is one
choice (incremental detokenizing, stop strings, timings; closing its engine stream aborts the engine
request); `stream` sends server-sent events that always end well-formed; `final` is a non-stream body;
`usage` the request's usage. `end_all` ends every request in flight (shutdown grace over, engine gone).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.data_parallel import DataParallelEngine
from rapidserve.engine.errors import EngineError
from rapidserve.engine.messages import TokenOut
from rapidserve.server.detokenizer import IncrementalDetokenizer
from rapidserve.server.errors import APIError
from rapidserve.server.metrics import Metrics
from rapidserve.server.middleware import STREAM_KEY, ServerStopping, error_body
from rapidserve.server.requests import GenRequest
from rapidserve.server.responses import (
    chat_role_chunk,
    chat_stream_chunks,
    final_response,
    new_chat_streams,
    response_id,
    stream_chunk,
    usage_chunk,
    usage_dict,
)
from rapidserve.tokenizer import Tokenizer

log = logging.getLogger("rapidserve.server")
OnDelta = Callable[["Choice", str, TokenOut], Awaitable[None]]


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
    # the index of the engine it was handed to (with data parallelism, the one dispatch picked), for the metrics'
    # `engine` label; None until then (`Generation._count`: with several engines one that never reached an engine
    # is counted on none, as vLLM counts a request only on the engine core that ran it)
    engine: int | None = None


class Generation:
    """Runs admitted requests on `engine`, detokenizing with `tokenizer`, timed into `metrics`; responses name
    `model_name`."""

    def __init__(self, engine: AsyncEngine | DataParallelEngine, tokenizer: Tokenizer | None, metrics: Metrics,
                 model_name: str) -> None:
        self.engine, self.tok, self.metrics, self.model_name = engine, tokenizer, metrics, model_name
        self.ending: str | None = None  # set by end_all(): why every request still in flight was ended
        self._active: set[asyncio.Future[Any]] = set()  # the generation of each request in flight

    def end_all(self, reason: str) -> int:
        """End every request in flight now (shutdown grace over, engine gone): streams get an error
        event and [DONE], the others a 503. Returns how many were ended."""
        self.ending = reason
        active = list(self._active)
        for fut in active:
            fut.cancel()
        return len(active)

    async def generate(self, rid: str, req: GenRequest, choices: list[Choice], on_delta: OnDelta | None,
                       prelude: Callable[[], Awaitable[None]] | None = None) -> None:
        """Run every choice of a request (after `prelude`, which a stream uses to begin its response);
        the first failure ends the others. Counts each choice once in the metrics, however it ends; a request
        refused before it reached the engine (not ready, ending) counts as rejected instead, with no prompt
        tokens. Raises EngineError (at once when the engine is not ready; ServerStopping after end_all)."""
        t0 = time.monotonic()
        refusal = self.refusal()
        if refusal is not None:  # before a stream's response begins: a plain 503
            raise refusal
        tasks: list[asyncio.Future[None]] = []
        group: asyncio.Future[Any] | None = None
        failure = "abort"  # a client that went away, a cancelled handler, end_all
        try:
            if prelude is not None:
                await prelude()
                refusal = self.refusal()  # (it may have changed while the response began)
                if refusal is not None:
                    raise refusal
            if not isinstance(self.engine, DataParallelEngine):  # one engine: every choice is its from here
                for c in choices:
                    self._placed(c, 0)
            tasks = [asyncio.ensure_future(self.run(rid, req, c, on_delta)) for c in choices]
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
            # the choices whose own run raised (their engine failed them; a client gone is an abort)
            raised = {k for k, t in enumerate(tasks) if t.done() and not t.cancelled()
                      and t.exception() is not None and not isinstance(t.exception(), ConnectionError)}
            for t in tasks:
                t.cancel()  # those still running after a failure; their engine requests are aborted
            if refusal is None:
                self._count(req, choices, t0, raised, failure)

    def _count(self, req: GenRequest, choices: list[Choice], t0: float, raised: set[int], failure: str) -> None:
        """Count a request's choices once each in the metrics, each on the engine it went to, when the request ends.

        A choice that ended is counted with its finish reason; one whose own run raised (`raised`: its engine failed
        it) as "error"; one still running that the request's end cancels (its engine request aborted: a client that
        went away, or a sibling's failure) as "abort" on its own engine, as rapidserve counts every engine request
        the server aborts (vLLM 0.26 counts none of those: metrics.py). `failure` ("error" or "abort") is the
        request's when nothing it ran raised (its stream's prelude failed). With several engines a choice that never
        reached one (the client left while the response began; dispatch found no engine running) is counted
        nowhere: vLLM counts a request only on the engine core that ran it. With one engine every choice is engine
        0's, as before data parallelism (one whose prelude failed is an abort there, without its parameters).

        vLLM 0.26 (vllm/v1/metrics/loggers.py `record`, engine/output_processor.py, engine/parallel_sampling.py)
        observes ``request_params_max_tokens`` with each finished engine request (a sample) on its engine, and
        ``request_params_n`` and ``request_max_num_generation_tokens`` once per prompt (a parent request), when its
        last sample finishes, on the engine that finished it (the engine whose outputs carried that finish): here,
        the sample that ended last."""
        now = time.monotonic()
        p = req.params
        dp = isinstance(self.engine, DataParallelEngine)
        for k, c in enumerate(choices):
            engine = 0 if c.engine is None and not dp else c.engine
            if engine is None:
                continue
            reason = c.finish_reason or ("error" if k in raised or (failure == "error" and not raised) else "abort")
            self.metrics.observe_finished((c.t_end or now) - t0, len(c.prompt_ids), len(c.token_ids), reason,
                                          ttft_s=c.ttft, queue_s=c.queue,
                                          max_tokens=p.max_tokens if c.engine is not None else None, engine=engine)
        n = p.n  # choice i * n + j is prompt i's sample j
        for i in range(len(req.prompts)):
            samples = choices[i * n:(i + 1) * n]
            tokens = [len(c.token_ids) for c in samples]
            ends = [(c.t_end or now, c.engine) for c in samples if c.engine is not None]
            if ends:
                self.metrics.observe_samples_done(tokens, n, max(ends, key=lambda x: x[0])[1])
            elif not dp:  # one engine, its prelude failed: its most tokens (0) only, as before
                self.metrics.observe_samples_done(tokens, None, 0)

    def _placed(self, c: Choice, engine: int) -> None:
        """Choice `c` goes to engine `engine`: its prompt tokens count there."""
        c.engine = engine
        self.metrics.add_prompt_tokens(len(c.prompt_ids), engine)

    def refusal(self) -> EngineError | None:
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

    async def run(self, rid: str, req: GenRequest, c: Choice, on_delta: OnDelta | None) -> None:
        """Generate one choice: detokenize, match stop strings, time tokens; abort on stop/cancel."""
        p = req.params
        params = p.for_sample(c.index % p.n)
        detok = IncrementalDetokenizer(self.tok, c.prompt_ids, p.skip_special_tokens, p.stop,
                                       p.include_stop_str_in_output, p.min_tokens)
        t0 = last = time.monotonic()
        if isinstance(self.engine, DataParallelEngine):  # placed once dispatch picks the engine, before the hand-over
            stream = self.engine.generate(f"{rid}-{c.index}", c.prompt_ids, params,
                                          placed=lambda i: self._placed(c, i))
        else:  # (placed on engine 0 by generate)
            stream = self.engine.generate(f"{rid}-{c.index}", c.prompt_ids, params)
        c.state = "pending"
        try:
            async for tok in stream:
                now = time.monotonic()
                if c.ttft is None:
                    c.state = "decoding"
                    c.ttft = now - t0
                    c.cached_tokens = tok.cached_tokens
                    self.metrics.observe_first_token(c.ttft, c.engine or 0)  # (placed by now)
                    if tok.times is not None:
                        ph = tok.times
                        c.queue = max(0.0, ph.started - t0)
                        self.metrics.observe_phases(t0, ph.admitted, ph.started, ph.sampled, now, c.engine or 0)
                else:
                    self.metrics.observe_token(now - last, c.engine or 0)
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

    def final(self, req: GenRequest, rid: str, created: int, choices: list[Choice]) -> dict[str, Any]:
        return final_response(req, response_id(req, rid), created, self.model_name, choices, usage(req, choices),
                              self.tok)

    async def stream(self, request: web.Request, req: GenRequest, rid: str, created: int,
                     choices: list[Choice]) -> web.StreamResponse:
        """Server-sent events. Once the response has begun it always ends well-formed: an error becomes
        an error event, then `data: [DONE]` and the end of the chunked body, never a second response."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        lock = asyncio.Lock()
        sid = response_id(req, rid)

        async def send(obj: dict[str, Any], c: Choice | None = None) -> None:
            if c is not None and req.continuous_usage:  # vLLM's continuous_usage_stats: the choice's usage so far
                counts = usage_dict(len(c.prompt_ids), len(c.token_ids))
                if req.kind == "generate":  # /generate's events carry their counts in meta_info (SGLang's shape),
                    obj["meta_info"].update(counts)  # as its last event does (responses.usage_chunk)
                else:
                    obj["usage"] = counts
            async with lock:
                await resp.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n")

        reads = new_chat_streams(req, [c.index for c in choices])  # chat read for reasoning or tool calls

        async def on_delta(c: Choice, delta: str, tok: TokenOut) -> None:
            for chunk in (chat_stream_chunks(req, sid, created, self.model_name, c.index, delta, tok, c.finish_reason,
                                             self.tok, reads[c.index]) if reads is not None else
                          [stream_chunk(req, sid, created, self.model_name, c.index, delta, tok, c.finish_reason,
                                        self.tok, text_offset=len(c.text) - len(delta))]):
                await send(chunk, c)

        async def prelude() -> None:
            await resp.prepare(request)
            request[STREAM_KEY] = resp
            for c in choices if req.kind == "chat" else []:
                await send(chat_role_chunk(sid, created, self.model_name, c.index,
                                           list(c.prompt_ids) if req.return_token_ids else None), c)

        try:
            await self.generate(rid, req, choices, on_delta, prelude)
            if req.include_usage:
                await send(usage_chunk(req, sid, created, self.model_name, usage(req, choices)))
        except (asyncio.CancelledError, ConnectionError):
            raise  # the client went away (or the handler was cancelled): nothing more can be sent
        except Exception as e:  # noqa: BLE001 - ended with an error event, never a second response
            if not resp.prepared:
                raise  # nothing sent yet: the error middleware answers it (503 for an engine error)
            if isinstance(e, EngineError):
                log.warning("request %s ended with an error: %s", rid, e)
            elif not isinstance(e, (ValueError, APIError)):
                log.exception("request %s failed", rid)
            await send({"error": error_body(e, req.structured_param)})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _cancelling() -> bool:
    """Whether the current task itself is being cancelled (Python 3.11+; False before)."""
    task = asyncio.current_task()
    return bool(task is not None and getattr(task, "cancelling", lambda: 0)())


def usage(req: GenRequest, choices: list[Choice]) -> dict[str, Any]:
    """Usage of a whole request: each prompt counted once, its cached tokens as its first sample found them."""
    firsts = [c.cached_tokens for c in choices if c.index % req.params.n == 0]
    cached = None if any(x is None for x in firsts) else sum(x for x in firsts if x is not None)
    return usage_dict(sum(len(p) for p in req.prompts), sum(len(c.token_ids) for c in choices), cached)
