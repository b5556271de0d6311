"""vLLM's utility routes: POST /tokenize, POST /detokenize, GET /version, GET|POST /ping.

- /tokenize takes `prompt` (a text; `add_special_tokens` default true) or `messages` (a chat, rendered by
  the server's chat template as /v1/chat/completions renders it, with the same inputs, checked by the same
  `chat_render.render_options`: `tools`, `add_generation_prompt` default true, `continue_final_message`
  default false, `documents`, `chat_template_kwargs`, a request's own `chat_template` only with
  --trust-request-chat-template, `add_special_tokens` default false), and answers
  `{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs`: the tokens' strings with
  `return_token_strs`, else null). A text longer than the context window is counted, not refused.
- /detokenize takes `tokens` (ids in the vocabulary) and answers `{"prompt": text}`.
- /version answers `{"version": rapidserve's}`; /ping answers what /health answers (vLLM's and SageMaker's
  liveness route). Both need no API key, as /health (app.PUBLIC_PATHS); /tokenize and /detokenize do.

The bodies are the msgspec Structs below (in /openapi.json, checked by server/body.py: bad input is a
400 naming the field); `model`, when given, must be one of the served names (404 otherwise, as on the
generation routes). Texts longer than requests.OFFLOAD_CHARS are tokenized off the event loop.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Annotated

from aiohttp import web
from msgspec import Meta

from rapidserve import __version__
from rapidserve.server.body import check_headers, decode_as
from rapidserve.server.chat_render import render_options, template_failure
from rapidserve.server.errors import APIError, bad_request, show
from rapidserve.server.requests import OFFLOAD_CHARS, ProtocolContext
from rapidserve.server.schema_parts import Strict, Unsupported
from rapidserve.server.schemas import (
    MAX_MESSAGES,
    MAX_TOOLS,
    AddGenerationPrompt,
    ChatCompletionRequest,
    ChatMessage,
    ChatTemplateKwargs,
    ContinueFinalMessage,
    Documents,
    RequestChatTemplate,
    TokenId,
    Tool,
)
from rapidserve.server.tools import template_messages, template_tools
from rapidserve.server.unsupported import refuse_nested
from rapidserve.server_config import ServerConfig

UTILITY_PUBLIC_PATHS = frozenset({"/ping", "/version"})  # answered without the API key (vLLM's too)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class TokenizeRequest(Strict, kw_only=True):
    """POST /tokenize: exactly one of `prompt` (a text) and `messages` (a chat)."""

    model: str | None = None
    prompt: Annotated[str, Meta(description="the text to tokenize (not with messages)")] | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES, description=(
        f"a chat of 1 to {MAX_MESSAGES} messages, rendered by the model's chat template (not with prompt)"))] \
        | None = None
    add_special_tokens: Annotated[bool, Meta(description="add the tokenizer's special tokens (BOS...); default "
                                                          "true for a prompt, false for messages (the chat "
                                                          "template writes them)")] | None = None
    # messages: the chat template's inputs, as the chat route takes them (None: not given)
    add_generation_prompt: AddGenerationPrompt | None = None
    continue_final_message: ContinueFinalMessage | None = None
    documents: Documents | None = None
    chat_template: RequestChatTemplate | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS, description=f"messages: at most {MAX_TOOLS} tools for "
                                                                         "the chat template")] | None = None
    return_token_strs: Annotated[bool, Meta(description="also answer each token's string (token_strs)")] = False
    media_io_kwargs: Unsupported = None  # vLLM's (multimodal): null or {} only, the models here take text
    mm_processor_kwargs: Unsupported = None


class DetokenizeRequest(Strict, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: Annotated[list[TokenId], Meta(description="the token ids to turn into text (each in the vocabulary)")]


def add_utility_routes(app: web.Application, ctx: ProtocolContext, cfg: ServerConfig, health: Handler) -> None:
    """Register the routes of this module on the server's `app`; `health`: the /health handler (for /ping)."""
    routes = UtilityRoutes(ctx, cfg)
    app.router.add_post("/tokenize", routes.tokenize)
    app.router.add_post("/detokenize", routes.detokenize)
    app.router.add_get("/version", routes.version)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)


class UtilityRoutes:
    def __init__(self, ctx: ProtocolContext, cfg: ServerConfig) -> None:
        self.ctx, self.cfg = ctx, cfg

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": __version__})

    async def tokenize(self, request: web.Request) -> web.Response:
        r = decode_as(TokenizeRequest, await self._body(request))
        self._check_model(r.model)
        ids = await tokenize(r, self.ctx)  # 400 when the model has no tokenizer
        tok = self.ctx.tokenizer
        strs = [str(s) for s in tok.hf.convert_ids_to_tokens(ids)] if r.return_token_strs and tok else None
        return web.json_response({"count": len(ids), "max_model_len": self.ctx.max_model_len, "tokens": ids,
                                  "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        r = decode_as(DetokenizeRequest, await self._body(request))
        self._check_model(r.model)
        tok = self.ctx.tokenizer
        if tok is None:
            raise bad_request("tokens", "this model has no tokenizer (a preset): token ids cannot be turned into text")
        bad = next((t for t in r.tokens if t >= self.ctx.vocab_size), None)
        if bad is not None:
            raise bad_request("tokens", f"'tokens' holds {bad}: token ids must be integers in [0, "
                                        f"{self.ctx.vocab_size})")
        if len(r.tokens) > OFFLOAD_CHARS // 4:
            text = await asyncio.to_thread(tok.decode, r.tokens, False)
        else:
            text = tok.decode(r.tokens, skip_special_tokens=False)
        return web.json_response({"prompt": text})

    async def _body(self, request: web.Request) -> bytes:
        check_headers(request.headers.get("Content-Type"), request.content_length, self.cfg.max_body_bytes)
        try:  # a body trickled in slowly holds a connection like slow headers do (as the generation routes)
            return await asyncio.wait_for(request.read(), self.cfg.header_timeout_s)
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.cfg.header_timeout_s:g} s",
                           code="request_timeout") from None

    def _check_model(self, model: str | None) -> None:
        names = self.ctx.served_model_names
        if model is not None and model not in names:
            raise APIError(404, f"The model {show(model)} does not exist; this server serves {', '.join(names)}",
                           param="model", code="model_not_found")


async def tokenize(r: TokenizeRequest, ctx: ProtocolContext) -> list[int]:
    """The token ids of a /tokenize request (checked: one of prompt and messages, the fields that go with it)."""
    tok = ctx.tokenizer
    if (r.prompt is None) == (r.messages is None):
        raise bad_request("prompt" if r.prompt is None else "messages",
                          "give exactly one of 'prompt' (a text) and 'messages' (a chat)")
    if tok is None:
        raise bad_request("prompt" if r.prompt is not None else "messages",
                          "this model has no tokenizer (a preset): there is nothing to tokenize with")
    for name in ("media_io_kwargs", "mm_processor_kwargs"):
        if getattr(r, name) not in (None, {}):
            raise bad_request(name, f"'{name}' is not supported by this server (the models served here take text "
                                    "only): send null or {}, or leave it out")
    if r.prompt is not None:
        for name in ("tools", "continue_final_message", "documents", "chat_template", "chat_template_kwargs"):
            if getattr(r, name) not in (None, False):
                raise bad_request(name, f"'{name}' goes with 'messages', not with 'prompt'")
        if r.add_generation_prompt is not None:  # either value: a text is tokenized as it is, with no turn header
            raise bad_request("add_generation_prompt", "'add_generation_prompt' goes with 'messages' (it ends the "
                                                       "rendered chat with the assistant's turn header); a 'prompt' "
                                                       "is tokenized as it is: leave it out")
        special = True if r.add_special_tokens is None else r.add_special_tokens
        if len(r.prompt) > OFFLOAD_CHARS:
            return await asyncio.to_thread(tok.encode, r.prompt, special)
        return tok.encode(r.prompt, add_special_tokens=special)
    # 400 naming a bad field, as on the chat route; the messages and tools rendered as the chat route renders them
    refuse_nested(r)
    render = render_options(r, ctx.trust_request_chat_template, ctx.default_template_kwargs)
    messages = template_messages(ChatCompletionRequest(messages=r.messages or []))
    tools = list(template_tools(r.tools)) if r.tools else None

    def ids() -> list[int]:
        assert tok is not None
        try:
            return tok.apply_chat_template(messages, tools, **render)
        except Exception as e:  # the template's code failed on this request's inputs
            raise template_failure(e, render) from None

    work = sum(len(m["content"]) for m in messages) + len(json.dumps([render["documents"], render["template_kwargs"]]))
    if work > OFFLOAD_CHARS:
        return await asyncio.to_thread(ids)
    return ids()
