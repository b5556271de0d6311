"""OpenAI-compatible request validation and response shaping.

`parse_request` turns the JSON body of `/v1/completions`, `/v1/chat/completions` or `/generate` into
one `GenRequest` (token ids + `SamplingParams`) or raises `APIError` (status 400 with `param` naming
the field, 404 for an unknown model). Unknown fields are ignored, as OpenAI and vLLM do; a known
field of the wrong type or out of range is an error. Features the engine lacks (penalties, logit
bias, tools, JSON mode, prompt logprobs) are refused when asked for rather than silently ignored.

The response builders return plain dicts in the OpenAI API's field names, ready for JSON; the
logprobs builders turn the engine's `TokenOut`s into the completions or chat logprobs shape.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import jinja2
import msgspec

from rapidserve.engine.messages import TokenOut
from rapidserve.sampling_params import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, SamplingParamsError
from rapidserve.server.detokenizer import TopLogprobs, chat_logprobs, completion_logprobs
from rapidserve.tokenizer import Tokenizer

Kind = Literal["completion", "chat", "generate"]
KINDS: tuple[str, ...] = ("completion", "chat", "generate")
MAX_N = 16
MAX_TEMPERATURE = 2.0
CHAT_ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool", "developer")
_SEED_RANGE = (-(2**63), 2**63)  # int64, as vLLM; msgspec carries it between processes


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers) if headers else None  # extra HTTP headers (e.g. Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ProtocolContext:
    """What validation needs to know about the served model."""

    tokenizer: Tokenizer | None  # None: the model has no tokenizer (presets); only token-id prompts
    served_model_names: tuple[str, ...]
    max_model_len: int
    vocab_size: int
    default_max_tokens: int


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request.

    - prompts: token ids, one list per prompt (completions accept a batch; chat/generate have one).
      Each prompt is generated `params.n` times; completions choice index = prompt_idx * n + i.
    - prompt_texts: the prompt's text where it was given as text (or, with `echo`, decoded from the
      ids); None otherwise.
    - include_usage: whether the response carries `usage` (always for non-streaming responses;
      for streams only with `stream_options.include_usage`).
    - logprobs_style: which logprobs shape to answer ("completion", "chat") or None for none.
    """

    kind: Kind
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str | None]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool = False
    user: str | None = None
    logprobs_style: Literal["completion", "chat"] | None = None


# ---------------------------------------------------------------- field readers


def _bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _show(v: object) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _field(d: Mapping[str, Any], name: str, default: Any, ok: Callable[[Any], bool], what: str) -> Any:
    v = d.get(name)
    if v is None:
        return default
    if not ok(v):
        raise _bad(name, f"'{name}' must be {what} or null, got {_show(v)}")
    return v


def _int(d: Mapping[str, Any], name: str, default: int | None, lo: int, hi: int | None = None) -> int | None:
    what = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
    return _field(d, name, default, lambda v: _is_int(v) and lo <= v and (hi is None or v <= hi), what)


def _num(d: Mapping[str, Any], name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    ok = lambda v: _is_num(v) and (v > lo if lo_open else v >= lo) and v <= hi
    return float(_field(d, name, default, ok, f"a number in {'(' if lo_open else '['}{lo:g}, {hi:g}]"))


def _bool(d: Mapping[str, Any], name: str, default: bool) -> bool:
    return _field(d, name, default, lambda v: isinstance(v, bool), "true or false")


def _token_ids(v: object, param: str, where: str, vocab_size: int, allow_empty: bool = False) -> list[int]:
    if not isinstance(v, list) or (not v and not allow_empty):
        raise _bad(param, f"'{where}' must be a non-empty list of token ids, got {_show(v)}")
    for t in v:
        if not (_is_int(t) and 0 <= t < vocab_size):
            raise _bad(param, f"'{where}' holds {_show(t)}: token ids must be integers in [0, {vocab_size})")
    return v


def _stop(d: Mapping[str, Any]) -> tuple[str, ...]:
    v = d.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if (not isinstance(items, list) or len(items) > MAX_STOP_STRINGS
            or not all(isinstance(s, str) and s for s in items)):
        raise _bad("stop", f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} "
                           f"non-empty strings, got {_show(v)}")
    return tuple(items)


def _refuse_unsupported(d: Mapping[str, Any], chat: bool) -> None:
    for name, neutral in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
        v = d.get(name)
        if v is not None and (not _is_num(v) or v != neutral):
            raise _bad(name, f"'{name}' is not supported by this server: only {neutral} or null, got {_show(v)}")
    if d.get("logit_bias") not in (None, {}):
        raise _bad("logit_bias", "'logit_bias' is not supported by this server: only {} or null")
    if chat:
        if d.get("tools") not in (None, []):
            raise _bad("tools", "'tools' (function calling) is not supported by this server")
        if d.get("tool_choice") not in (None, "none", "auto"):
            raise _bad("tool_choice", "'tool_choice' may only be 'none', 'auto' or null on this server")
        rf = d.get("response_format")
        if rf is not None and rf != {"type": "text"}:
            raise _bad("response_format", "'response_format' may only be {\"type\": \"text\"} on this server")
    else:
        if d.get("suffix") not in (None, ""):
            raise _bad("suffix", "'suffix' is not supported by this server")


# ---------------------------------------------------------------- prompts


def _encode(text: str, param: str, where: str, ctx: ProtocolContext) -> list[int]:
    if not text:
        raise _bad(param, f"'{where}' must not be empty")
    if ctx.tokenizer is None:
        raise _bad(param, f"this model has no tokenizer: send '{where}' as a list of token ids")
    return ctx.tokenizer.encode(text)


def _completion_prompts(v: object, ctx: ProtocolContext) -> tuple[list[list[int]], list[str | None]]:
    allowed = "a string, a list of strings, a list of token ids or a list of lists of token ids"
    if isinstance(v, str):
        return [_encode(v, "prompt", "prompt", ctx)], [v]
    if not isinstance(v, list) or not v:
        raise _bad("prompt", f"'prompt' must be a non-empty {allowed}, got {_show(v)}")
    if all(_is_int(t) for t in v):
        return [_token_ids(v, "prompt", "prompt", ctx.vocab_size)], [None]
    if all(isinstance(p, str) for p in v):
        return [_encode(p, "prompt", f"prompt[{i}]", ctx) for i, p in enumerate(v)], list(v)
    if all(isinstance(p, list) for p in v):
        return [_token_ids(p, "prompt", f"prompt[{i}]", ctx.vocab_size) for i, p in enumerate(v)], [None] * len(v)
    raise _bad("prompt", f"'prompt' must be {allowed} (not a mix), got {_show(v)}")


def _message_content(v: object, where: str, role: str) -> str:
    if isinstance(v, str):
        return v
    if v is None and role == "assistant":
        return ""
    if isinstance(v, list):
        texts = []
        for j, part in enumerate(v):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise _bad("messages", f"'{where}.content[{j}]' must be {{\"type\": \"text\", \"text\": string}} "
                                       f"(only text content is supported), got {_show(part)}")
            texts.append(part["text"])
        return "\n".join(texts)
    raise _bad("messages", f"'{where}.content' must be a string or a list of text parts, got {_show(v)}")


def _chat_prompt(v: object, ctx: ProtocolContext) -> list[int]:
    if not isinstance(v, list) or not v:
        raise _bad("messages", f"'messages' must be a non-empty list of {{role, content}} objects, got {_show(v)}")
    messages: list[dict[str, str]] = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise _bad("messages", f"'messages[{i}]' must be an object with 'role' and 'content', got {_show(m)}")
        role = m.get("role")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad("messages", f"'messages[{i}].role' must be one of {', '.join(CHAT_ROLES)}, got {_show(role)}")
        content = _message_content(m.get("content"), f"messages[{i}]", role)
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    if ctx.tokenizer is None:
        raise _bad("messages", "this model has no tokenizer or chat template: use /v1/completions with token ids")
    try:
        return ctx.tokenizer.apply_chat_template(messages)
    except (ValueError, TypeError, jinja2.TemplateError) as e:
        raise _bad("messages", f"the chat template rejected 'messages': {e}") from None


def _resolve_max_tokens(requested: int | None, name: str, prompts: list[list[int]], prompt_param: str,
                        ctx: ProtocolContext) -> int:
    limit = ctx.max_model_len
    for i, p in enumerate(prompts):
        if len(p) >= limit:
            where = prompt_param if len(prompts) == 1 else f"{prompt_param}[{i}]"
            raise _bad(prompt_param, f"This model's maximum context length is {limit} tokens, but '{where}' has "
                                     f"{len(p)} tokens (it must leave room for at least one generated token)",
                       code="context_length_exceeded")
    longest = max(len(p) for p in prompts)
    room = limit - longest
    if requested is None:
        return max(1, min(ctx.default_max_tokens, room))
    if requested > room:
        raise _bad(name, f"'{name}'={requested} plus the prompt's {longest} tokens is more than this model's maximum "
                         f"context length of {limit} tokens: ask for at most {room}", code="context_length_exceeded")
    return requested


# ---------------------------------------------------------------- parse_request


def _decode_body(body: bytes) -> dict[str, Any]:
    try:
        data = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise _bad(None, f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise _bad(None, f"the request body must be a JSON object, got {type(data).__name__}")
    return data


def _resolve_model(d: Mapping[str, Any], ctx: ProtocolContext) -> str:
    v = d.get("model")
    names = ctx.served_model_names
    if v is None:
        if len(names) == 1:
            return names[0]
        raise _bad("model", f"'model' is required; this server serves {', '.join(names)}")
    if not isinstance(v, str):
        raise _bad("model", f"'model' must be a string, got {_show(v)}")
    if v not in names:
        raise APIError(404, f"The model '{v}' does not exist; this server serves {', '.join(names)}",
                       param="model", code="model_not_found")
    return v


def parse_request(kind: str, body: bytes, ctx: ProtocolContext) -> GenRequest:
    """Validate the JSON `body` of a request to the `kind` endpoint; raise `APIError` if it is invalid."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KINDS}")
    d = _decode_body(body)
    model = _resolve_model(d, ctx)
    _refuse_unsupported(d, chat=kind == "chat")

    logprobs: int | None = None
    style: Literal["completion", "chat"] | None = None
    echo = False
    max_name = "max_tokens"
    if kind == "chat":
        prompts, texts, prompt_param = [_chat_prompt(d.get("messages"), ctx)], [None], "messages"
        if d.get("max_completion_tokens") is not None:
            max_name = "max_completion_tokens"
        if _bool(d, "logprobs", False):
            logprobs, style = _int(d, "top_logprobs", 0, 0, MAX_LOGPROBS), "chat"
        elif d.get("top_logprobs") is not None:
            _int(d, "top_logprobs", 0, 0, MAX_LOGPROBS)
            raise _bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    elif kind == "completion":
        prompts, texts = _completion_prompts(d.get("prompt"), ctx)
        prompt_param = "prompt"
        logprobs = _int(d, "logprobs", None, 0, MAX_LOGPROBS)
        style = "completion" if logprobs is not None else None
        echo = _bool(d, "echo", False)
        if echo and logprobs is not None:
            raise _bad("echo", "'echo' with 'logprobs' would need prompt logprobs, which this server does not compute")
        if echo and ctx.tokenizer is not None:
            texts = [t if t is not None else ctx.tokenizer.decode(p) for t, p in zip(texts, prompts, strict=True)]
    else:
        v = d.get("prompt")
        if isinstance(v, list) and all(_is_int(t) for t in v):
            prompts, texts = [_token_ids(v, "prompt", "prompt", ctx.vocab_size)], [None]
        elif isinstance(v, str):
            prompts, texts = [_encode(v, "prompt", "prompt", ctx)], [v]
        else:
            raise _bad("prompt", f"'prompt' must be a non-empty string or list of token ids, got {_show(v)}")
        prompt_param = "prompt"
        if d.get("max_tokens") is None and d.get("max_new_tokens") is not None:
            max_name = "max_new_tokens"

    n = _int(d, "n", 1, 1, MAX_N if kind != "generate" else 1)
    if kind == "completion" and d.get("best_of") not in (None, n):
        raise _bad("best_of", f"'best_of' is not supported by this server: only null or equal to n ({n})")
    requested = _int(d, max_name, None, 1)
    max_tokens = _resolve_max_tokens(requested, max_name, prompts, prompt_param, ctx)
    stream = _bool(d, "stream", False)
    so = d.get("stream_options")
    include_usage = not stream
    if so is not None:
        if not stream:
            raise _bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
            raise _bad("stream_options", f"'stream_options' must be {{\"include_usage\": bool}}, got {_show(so)}")
        include_usage = so.get("include_usage", False)
    seed = _int(d, "seed", None, _SEED_RANGE[0], _SEED_RANGE[1] - 1)
    stop_ids = d.get("stop_token_ids")
    stop_token_ids = () if stop_ids is None else tuple(
        _token_ids(stop_ids, "stop_token_ids", "stop_token_ids", ctx.vocab_size, allow_empty=True))
    try:
        params = SamplingParams(
            n=n, temperature=_num(d, "temperature", 1.0, 0.0, MAX_TEMPERATURE),
            top_p=_num(d, "top_p", 1.0, 0.0, 1.0, lo_open=True), top_k=_int(d, "top_k", 0, -1),
            min_p=_num(d, "min_p", 0.0, 0.0, 1.0), seed=seed, max_tokens=max_tokens,
            min_tokens=_int(d, "min_tokens", 0, 0), stop_token_ids=stop_token_ids, stop=_stop(d),
            ignore_eos=_bool(d, "ignore_eos", False), logprobs=logprobs,
            skip_special_tokens=_bool(d, "skip_special_tokens", True))
    except SamplingParamsError as e:
        m = re.match(r"(\w+)=", str(e))
        raise _bad(m.group(1) if m else None, str(e)) from None
    if params.stop and ctx.tokenizer is None:
        raise _bad("stop", "this model has no tokenizer: stop strings cannot be matched; use 'stop_token_ids'")
    user = _field(d, "user", None, lambda v: isinstance(v, str), "a string")
    return GenRequest(kind=kind, model=model, prompts=prompts, prompt_texts=texts, params=params,  # type: ignore[arg-type]
                      stream=stream, include_usage=include_usage, echo=echo, user=user,
                      logprobs_style=style)


# ---------------------------------------------------------------- responses
# Choices: completion_choice (completions and their chunks), chat_choice, chat_chunk_choice.
# Envelopes: *_response (usage required) and *_chunk (`usage` only in the last event, choices=[]).


def openai_finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as OpenAI's: None while running, "length", otherwise "stop"."""
    return None if reason is None else "length" if reason == "length" else "stop"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _envelope(obj: str, req_id: str, created: int, model: str, choices: list[dict[str, Any]],
              usage: dict[str, int] | None) -> dict[str, Any]:
    d: dict[str, Any] = {"id": req_id, "object": obj, "created": created, "model": model, "choices": choices}
    if usage is not None:
        d["usage"] = usage
    return d


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
                        usage: dict[str, int]) -> dict[str, Any]:
    return _envelope("text_completion", req_id, created, model, choices, usage)


def completion_chunk(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
                     usage: dict[str, int] | None = None) -> dict[str, Any]:
    return _envelope("text_completion", req_id, created, model, choices, usage)


def chat_choice(index: int, content: str, finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "message": {"role": "assistant", "content": content}, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_response(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage: dict[str, int]) -> dict[str, Any]:
    return _envelope("chat.completion", req_id, created, model, choices, usage)


def chat_chunk_choice(index: int, content: str | None = None, finish_reason: str | None = None,
                      logprobs: dict[str, Any] | None = None, role: str | None = None) -> dict[str, Any]:
    """One choice of a chat chunk: the first has role="assistant", content=""; the last an empty delta."""
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_chunk(req_id: str, created: int, model: str, choices: list[dict[str, Any]],
               usage: dict[str, int] | None = None) -> dict[str, Any]:
    return _envelope("chat.completion.chunk", req_id, created, model, choices, usage)


def chat_role_chunk(req_id: str, created: int, model: str, index: int) -> dict[str, Any]:
    """The first chat chunk of choice `index`: delta {"role": "assistant", "content": ""}."""
    return chat_chunk(req_id, created, model, [chat_chunk_choice(index, "", role="assistant")])


def generate_response(text: str, meta: Mapping[str, Any]) -> dict[str, Any]:
    """/generate's answer (SGLang's shape) {"text", "meta_info"}; streams send one per delta."""
    return {"text": text, "meta_info": dict(meta)}


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
                   usage: dict[str, int], tokenizer: Tokenizer | None) -> dict[str, Any]:
    """The non-streaming answer to `req`, by its kind (choices sorted by index; echo prepended)."""
    if req.kind == "generate":
        c = choices[0]
        return generate_response(c.text, {"id": req_id, "finish_reason": openai_finish_reason(c.finish_reason),
                                          **usage})
    out = []
    for c in sorted(choices, key=lambda c: c.index):
        fr = openai_finish_reason(c.finish_reason)
        echo = _echo(req, c.index)
        lp = _logprobs_for(req, tokenizer, c.token_ids, c.logprobs, c.top_logprobs, len(echo))
        out.append(chat_choice(c.index, c.text, fr, lp) if req.kind == "chat"
                   else completion_choice(c.index, echo + c.text, fr, lp))
        if tokenizer is None:  # token-id-only serving: the output as ids (text is empty)
            out[-1]["token_ids"] = list(c.token_ids)
    build = chat_response if req.kind == "chat" else completion_response
    return build(req_id, created, model, out, usage)


def stream_chunk(req: GenRequest, req_id: str, created: int, model: str, index: int, delta: str, tok: TokenOut,
                 finish_reason: str | None, tokenizer: Tokenizer | None, text_offset: int = 0) -> dict[str, Any]:
    """One streamed event for the token `tok` of choice `index`: `delta` is its new text.

    Completions with echo get the prompt text before the first token's text. `text_offset` is the
    length of the choice's text sent before this event (for completions' logprobs.text_offset)."""
    fr = openai_finish_reason(finish_reason)
    if req.kind == "generate":
        return generate_response(delta, {"id": req_id, "finish_reason": fr})
    lp = _logprobs_for(req, tokenizer, [tok.token_id], [tok.logprob], [tok.top_logprobs], text_offset)
    if req.kind == "chat":
        return chat_chunk(req_id, created, model, [chat_chunk_choice(index, delta, fr, lp)])
    if tok.index == 0 and req.echo:
        delta = _echo(req, index) + delta
    choice = completion_choice(index, delta, fr, lp)
    if tokenizer is None:  # token-id-only serving: each event carries its token id (text is empty)
        choice["token_ids"] = [tok.token_id]
    return completion_chunk(req_id, created, model, [choice])


def usage_chunk(req: GenRequest, req_id: str, created: int, model: str, usage: dict[str, int]) -> dict[str, Any]:
    """The last streamed event when usage was asked for: no choices, only `usage`."""
    if req.kind == "generate":
        return generate_response("", {"id": req_id, **usage})
    return (chat_chunk if req.kind == "chat" else completion_chunk)(req_id, created, model, [], usage)
