"""OpenAI-compatible response shaping: the answers of the generation endpoints, as plain dicts.

Choices: `completion_choice` (completions and their chunks), `chat_choice`, `chat_chunk_choice`.
Envelopes: `*_response` (usage required) and `*_chunk` (`usage` only in the last event, choices=[]).
`final_response` / `stream_chunk` / `usage_chunk` build a whole answer of a `GenRequest` by its kind;
the logprobs builders (detokenizer.py) turn the engine's `TokenOut`s into the completions or chat
logprobs shape. Errors are answered by `errors.APIError`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rapidserve.engine.messages import TokenOut
from rapidserve.server import chat_output, tool_calls
from rapidserve.server.detokenizer import TopLogprobs, chat_logprobs, completion_logprobs
from rapidserve.server.requests import GenRequest
from rapidserve.tokenizer import Tokenizer


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI's: None while running, "length", otherwise "stop"."""
    return None if reason is None else "length" if reason == "length" else "stop"


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens served from the prefix cache, reported as
    `prompt_tokens_details.cached_tokens` (as OpenAI and vLLM do)."""
    d: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        d["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return d


def _envelope(obj: str, req_id: str, created: int, model: str, choices: list[dict[str, Any]],
              usage: dict[str, Any] | None) -> dict[str, Any]:
    d: dict[str, Any] = {"id": req_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        d["usage"] = usage
    return d


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage: dict[str, Any]) -> dict[str, Any]:
    return _envelope("text_completion", req_id, created, model, choices, usage)


def completion_chunk(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return _envelope("text_completion", req_id, created, model, choices, usage)


def chat_choice(index: int, content: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_response(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage: dict[str, Any]) -> dict[str, Any]:
    return _envelope("chat.completion", req_id, created, model, choices, usage)


def chat_chunk_choice(index: int, content: str | None = None, finish_reason: str | None = None,
                      logprobs: dict[str, Any] | None = None, role: str | None = None) -> dict[str, Any]:
    """One choice of a chat chunk: the first has role="assistant", content=""; the last an empty delta."""
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return _envelope("chat.completion.chunk", req_id, created, model, choices, usage)


def chat_role_chunk(req_id: str, created: int, model: str, index: int,
                    prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """The first chat chunk of choice `index`: delta {"role": "assistant", "content": ""} (with the prompt's
    token ids when the request asked for them, as vLLM's first chunks)."""
    chunk = chat_chunk(req_id, created, model, [chat_chunk_choice(index, "", role="assistant")])
    if prompt_token_ids is not None:
        chunk["prompt_token_ids"] = prompt_token_ids
    return chunk


def response_id(req: GenRequest, rid: str) -> str:
    """The id a response shows: the server's `rid` ("cmpl-..." / "chatcmpl-..."), or with the request's own
    request_id after that prefix, as vLLM builds it."""
    return rid if req.request_id is None else f"{rid.split('-', 1)[0]}-{req.request_id}"


def _prompt_ids(req: GenRequest, index: int) -> list[int]:
    return list(req.prompts[index // req.params.n])


def generate_response(text: str, meta: Mapping[str, Any], token_ids: Sequence[int] | None = None,
                      prompt_token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """/generate's answer (SGLang's shape) {"text", "meta_info"}; streams send one per delta. With `token_ids`
    (return_token_ids, or a model without a tokenizer, whose text is empty) the output's ids too, and with
    `prompt_token_ids` the prompt's (return_token_ids: in a stream's first event), named as completions' are."""
    out: dict[str, Any] = {"text": text, "meta_info": dict(meta)}
    if token_ids is not None:
        out["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt_token_ids)
    return out


# ---------------------------------------------------------------- whole responses of a GenRequest


class ChoiceLike(Protocol):
    """What `final_response` reads of one generated choice (the app's per-choice record)."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    finish_reason: str | None


def _logprobs_for(req: GenRequest, tokenizer: Tokenizer | None, ids: Sequence[int], lps: Sequence[float | None],
                  tops: Sequence[TopLogprobs], text_offset: int) -> dict[str, Any] | None:
    if tokenizer is None or req.logprobs_style is None:
        return None
    if req.logprobs_style == "chat":
        return chat_logprobs(tokenizer, ids, lps, tops)
    return completion_logprobs(tokenizer, ids, lps, tops, text_offset)


def _echo(req: GenRequest, index: int) -> str:
    return (req.prompt_texts[index // req.params.n] or "") if req.echo else ""


def final_response(req: GenRequest, req_id: str, created: int, model: str, choices: Sequence[ChoiceLike],
                   usage: dict[str, Any], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The non-streaming answer to `req`, by its kind (choices sorted by index; echo prepended)."""
    if req.kind == "generate":
        c = choices[0]
        return generate_response(c.text, {"id": req_id, "finish_reason": openai_finish_reason(c.finish_reason),
                                          **usage},
                                 c.token_ids if tokenizer is None or req.return_token_ids else None,
                                 _prompt_ids(req, c.index) if req.return_token_ids else None)
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        fr = openai_finish_reason(c.finish_reason)
        echo = _echo(req, c.index)
        lp = _logprobs_for(req, tokenizer, c.token_ids, c.logprobs, c.top_logprobs, len(echo))
        if req.kind == "chat" and chat_output.parses(req.tools, req.reasoning):
            out.append(_read_choice(req, c.index, c.text, fr, lp))
        else:
            out.append(chat_choice(c.index, c.text, fr, lp) if req.kind == "chat"
                       else completion_choice(c.index, echo + c.text, fr, lp))
        if tokenizer is None or req.return_token_ids:  # the output as ids (token-id-only serving: text is empty)
            out[-1]["token_ids"] = list(c.token_ids)
        if req.return_token_ids and req.kind == "completion":
            out[-1]["prompt_token_ids"] = _prompt_ids(req, c.index)
    build = chat_response if req.kind == "chat" else completion_response
    body = build(req_id, created, model, out, usage)
    if req.return_token_ids and req.kind == "chat":
        body["prompt_token_ids"] = list(req.prompts[0])
    return body


def _read_choice(req: GenRequest, index: int, text: str, fr: str | None,
                 logprobs: dict[str, Any] | None) -> dict[str, Any]:
    """A chat choice whose text is read for reasoning and/or tool calls (chat_output.chat_message)."""
    message, called = chat_output.chat_message(text, req.tools, req.reasoning)
    if req.tools is not None:
        fr = tool_calls.finish_reason(req.tools, called, fr)
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": fr}


def new_chat_streams(req: GenRequest, indices: Sequence[int]) -> dict[int, chat_output.ChatStream] | None:
    """One ChatStream per choice of a streamed chat request whose text is read (reasoning, tool calls); else None."""
    if req.kind != "chat" or not chat_output.parses(req.tools, req.reasoning):
        return None
    return {i: chat_output.ChatStream(req.tools, req.reasoning) for i in indices}


def chat_stream_chunks(req: GenRequest, req_id: str, created: int, model: str, index: int, delta: str,
                       tok: TokenOut, finish_reason: str | None, tokenizer: Tokenizer | None,
                       stream: chat_output.ChatStream) -> list[dict[str, Any]]:
    """The chat chunks of the token `tok` of choice `index` read through its stream: one per reasoning or
    content piece, call start or arguments fragment (the token's logprobs on the first; an empty delta carries
    them when the token made none), then at the end a chunk with the finish reason ("tool_calls" when
    calls were streamed in auto or required mode)."""
    deltas = stream.feed(delta, finish_reason is not None)
    lp = _logprobs_for(req, tokenizer, [tok.token_id], [tok.logprob], [tok.top_logprobs], 0)
    if not deltas and (lp is not None or req.return_token_ids):
        deltas = [{}]
    out = []
    for k, d in enumerate(deltas):
        choice: dict[str, Any] = {"index": index, "delta": d, "logprobs": lp if k == 0 else None,
                                  "finish_reason": None}
        if req.return_token_ids:
            choice["token_ids"] = [tok.token_id] if k == 0 else []
        out.append(chat_chunk(req_id, created, model, [choice]))
    if finish_reason is not None:
        fr = openai_finish_reason(finish_reason)
        fr = fr if req.tools is None else tool_calls.finish_reason(req.tools, stream.called, fr)
        out.append(chat_chunk(req_id, created, model, [chat_chunk_choice(index, finish_reason=fr)]))
    return out


def stream_chunk(req: GenRequest, req_id: str, created: int, model: str, index: int, delta: str, tok: TokenOut,
                 finish_reason: str | None, tokenizer: Tokenizer | None, text_offset: int = 0) -> dict[str, Any]:
    """One streamed event for the token `tok` of choice `index`: `delta` is its new text.

    Completions with echo get the prompt text before the first token's text. `text_offset` is the
    length of the choice's text sent before this event (for completions' logprobs.text_offset)."""
    fr = openai_finish_reason(finish_reason)
    if req.kind == "generate":
        return generate_response(delta, {"id": req_id, "finish_reason": fr},
                                 [tok.token_id] if tokenizer is None or req.return_token_ids else None,
                                 _prompt_ids(req, index) if req.return_token_ids and tok.index == 0 else None)
    lp = _logprobs_for(req, tokenizer, [tok.token_id], [tok.logprob], [tok.top_logprobs], text_offset)
    if req.kind == "chat":
        choice = chat_chunk_choice(index, delta, fr, lp)
    else:
        choice = completion_choice(index, (_echo(req, index) if tok.index == 0 and req.echo else "") + delta, fr, lp)
        if req.return_token_ids and tok.index == 0:
            choice["prompt_token_ids"] = _prompt_ids(req, index)
    if tokenizer is None or req.return_token_ids:  # each event carries its token id (token-id-only: text is empty)
        choice["token_ids"] = [tok.token_id]
    return (chat_chunk if req.kind == "chat" else completion_chunk)(req_id, created, model, [choice])


def usage_chunk(req: GenRequest, req_id: str, created: int, model: str, usage: dict[str, Any]) -> dict[str, Any]:
    """The last streamed event when usage was asked for: no choices, only `usage`."""
    if req.kind == "generate":
        return generate_response("", {"id": req_id, **usage})
    return (chat_chunk if req.kind == "chat" else completion_chunk)(req_id, created, model, [], usage)
