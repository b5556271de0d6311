"""vLLM's POST /tokenize and POST /detokenize.

A router in front of several servers uses them: vllm-router's cache-aware policy tokenizes each prompt through
a worker's /tokenize (its fallback when a worker has no `/v1/completions/render`) and routes on those tokens;
without the route it has no prefix to compare and routes by load alone (deploy/router/README.md). The shapes
are vLLM's (vllm/entrypoints/openai/protocol.py): a prompt (`add_special_tokens` default true) or chat
`messages` rendered by the model's chat template (`add_generation_prompt`, default true; `add_special_tokens`
default false, since the template writes them) -> `{count, max_model_len, tokens, token_strs}`; `{tokens}` ->
`{prompt}`. What the chat template cannot do here (`continue_final_message`, `add_generation_prompt: false`) is
refused by name.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from rapidserve.server.body import decode_as
from rapidserve.server.errors import bad_request
from rapidserve.server.requests import CHARS_PER_TOKEN_BOUND, ProtocolContext
from rapidserve.server.schemas import MAX_MESSAGES, ChatCompletionRequest, ChatMessage
from rapidserve.server.tools import template_messages

MAX_TOKENS_IN = 1 << 20  # token ids a /detokenize body may carry


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /tokenize: exactly one of `prompt` and `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Meta(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """POST /detokenize."""

    model: str | None = None
    tokens: Annotated[list[Annotated[int, Meta(ge=0)]], Meta(max_length=MAX_TOKENS_IN)]


def _model(name: str | None, ctx: ProtocolContext) -> None:
    if name is not None and name not in ctx.served_model_names:
        raise bad_request("model", f"model {name!r} is not served here; this server serves "
                                   f"{', '.join(map(repr, ctx.served_model_names))}")


def tokenize(body: bytes, ctx: ProtocolContext) -> dict[str, Any]:
    """The /tokenize answer for `body` (400 naming the field for bad input). Slow for long inputs: off the loop."""
    r = decode_as(TokenizeRequest, body)
    _model(r.model, ctx)
    tok = ctx.tokenizer
    if tok is None:
        raise bad_request(None, "this model has no tokenizer (a preset?): nothing to tokenize")
    if (r.prompt is None) == (r.messages is None):
        raise bad_request("prompt", "give exactly one of 'prompt' (a string) and 'messages' (chat messages)")
    if r.prompt is not None:
        limit = ctx.max_model_len * CHARS_PER_TOKEN_BOUND  # more text than the context window could hold
        if len(r.prompt) > limit:
            raise bad_request("prompt", f"'prompt' has {len(r.prompt)} characters: more than {limit} cannot fit "
                                        f"this model's context of {ctx.max_model_len} tokens",
                              code="context_length_exceeded")
        ids = tok.encode(r.prompt, add_special_tokens=r.add_special_tokens is not False)
    else:
        if r.continue_final_message:
            raise bad_request("continue_final_message", "'continue_final_message' is not supported: the chat "
                                                        "template always opens a new assistant turn")
        if not r.add_generation_prompt:
            raise bad_request("add_generation_prompt", "'add_generation_prompt: false' is not supported: the chat "
                                                       "template always adds the assistant's turn header")
        assert r.messages is not None
        messages = template_messages(ChatCompletionRequest(messages=r.messages))
        chars = sum(len(m["content"]) for m in messages)
        if chars > ctx.max_model_len * CHARS_PER_TOKEN_BOUND:
            raise bad_request("messages", f"'messages' have {chars} characters: more than "
                                          f"{ctx.max_model_len * CHARS_PER_TOKEN_BOUND} cannot fit this model's "
                                          f"context of {ctx.max_model_len} tokens", code="context_length_exceeded")
        try:
            text = tok.render_chat(messages)
        except ValueError as e:
            raise bad_request("messages", str(e)) from None
        ids = tok.encode(text, add_special_tokens=bool(r.add_special_tokens))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": None}
    if r.return_token_strs:
        out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
    return out


def detokenize(body: bytes, ctx: ProtocolContext) -> dict[str, Any]:
    """The /detokenize answer for `body`."""
    r = decode_as(DetokenizeRequest, body)
    _model(r.model, ctx)
    if ctx.tokenizer is None:
        raise bad_request(None, "this model has no tokenizer (a preset?): nothing to detokenize")
    bad = next((t for t in r.tokens if t >= ctx.vocab_size), None)
    if bad is not None:
        raise bad_request("tokens", f"'tokens' holds {bad}: token ids must be integers in [0, {ctx.vocab_size})")
    return {"prompt": ctx.tokenizer.decode(r.tokens, skip_special_tokens=False)}


async def answer(kind: str, body: bytes, ctx: ProtocolContext) -> dict[str, Any]:
    """`tokenize` or `detokenize` off the event loop (a long text takes a while to tokenize)."""
    fn = tokenize if kind == "tokenize" else detokenize
    return await asyncio.get_running_loop().run_in_executor(None, fn, body, ctx)
