"""Tool calls out of generated text (issue 19): the formats of the model families we serve.

- `hermes` (Qwen2 / Qwen2.5 / Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the tags is the message's content.
- `llama3_json` (Llama-3.1 / 3.2): the whole output is one JSON object `{"name": ..., "parameters":
  {...}}` (or several joined by `;`), optionally after `<|python_tag|>`.

`parse(text)` gives the final message (content and calls; text that does not parse stays content, as
vLLM's parsers do); `call_from` reads one call object. The same formats as they stream, as OpenAI-style
`Delta`s, are tool_streams.py's. Pure string handling; no model, no server.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
FORMATS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Parsed:
    content: str | None  # None when only calls were generated
    calls: tuple[ToolCall, ...]


def call_from(obj: Any, args_key: str) -> ToolCall | None:
    """The call a decoded JSON object `{"name": ..., <args_key> or "arguments": {...} or its JSON text}`
    stands for (no arguments: {}), or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> Parsed:
    calls: list[ToolCall] = []
    content: list[str] = []
    pos = 0
    while True:
        start = text.find(TOOL_OPEN, pos)
        if start < 0:
            content.append(text[pos:])
            break
        end = text.find(TOOL_CLOSE, start)
        body = text[start + len(TOOL_OPEN): end if end >= 0 else len(text)]
        if end < 0:  # generation stopped inside the call, maybe inside its closing tag
            body = body[: len(body) - partial_suffix(body, TOOL_CLOSE)]
        try:
            call = call_from(json.loads(body), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is None:  # not a call after all: keep the text as it came
            content.append(text[pos:] if end < 0 else text[pos:end + len(TOOL_CLOSE)])
            if end < 0:
                break
        else:
            content.append(text[pos:start])
            calls.append(call)
        if end < 0:
            break
        pos = end + len(TOOL_CLOSE)
    rest = "".join(content).strip()
    return Parsed(rest or None, tuple(calls))


def parse_llama3_json(text: str) -> Parsed:
    body = text.strip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):].strip()
    if not body.startswith("{"):
        return Parsed(text or None, ())
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError:
            return Parsed(text, ())
        call = call_from(obj, "parameters")
        if call is None:
            return Parsed(text, ())
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return Parsed(None, tuple(calls))


def parse(text: str, fmt: str) -> Parsed:
    if fmt == "hermes":
        return parse_hermes(text)
    if fmt == "llama3_json":
        return parse_llama3_json(text)
    raise ValueError(f"tool-call format {fmt!r}; use one of {', '.join(FORMATS)}")


@dataclass(frozen=True)
class Delta:
    """One streamed piece: content text, or a call's start (index, id, name) or argument fragment."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
