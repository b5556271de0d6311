"""Tool calls out of generated text (issue 19): the formats of the model families we serve.

- `hermes` (Qwen2 / Qwen2.5 / Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the tags is the message's content.
- `llama3_json` (Llama-3.1 / 3.2): the whole output is one JSON object `{"name": ..., "parameters":
  {...}}` (or several joined by `;`), optionally after `<|python_tag|>`.
- `mistral` (Mistral, Mixtral, Mistral Small, Devstral...): content, then `[TOOL_CALLS]` and the calls: a JSON list
  `[{"name": ..., "arguments": {...}}, ...]` (tokenizers before v11), or `name[ARGS]{...}` per call, each after its
  own `[TOOL_CALLS]` (v11 on; `name[CALL_ID]id[ARGS]{...}` gives the call's id; an `[ARGS]` the tokenizer dropped:
  the name ends at `{`). What follows the last call is ignored. Its call ids are 9 letters and digits, the only ids
  Mistral's chat templates take back. The server keeps special tokens in the text for it (`[TOOL_CALLS]` is one).

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
MISTRAL_CALLS, MISTRAL_ARGS, MISTRAL_CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
FORMATS = ("hermes", "llama3_json", "mistral")


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


def mistral_call_id() -> str:
    """A call id Mistral's chat templates take back: 9 letters and digits."""
    return uuid.uuid4().hex[:9]


def mistral_name(head: str) -> tuple[str, str | None] | None:
    """(name, id or None) of the text between `[TOOL_CALLS]` and a call's arguments (`name` or
    `name[CALL_ID]id`), or None when it is no function name."""
    name, _, cid = head.partition(MISTRAL_CALL_ID)
    name, cid = name.strip(), cid.strip()
    if not name or any(c.isspace() or c in "[]{}\"" for c in name):
        return None
    return name, (cid if cid.isalnum() else None)


def _mistral_list(text: str, at: int) -> list[ToolCall]:
    """The calls of the JSON list starting at text[at] == "[", up to the first item that is not one."""
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    at += 1
    while True:
        while at < len(text) and text[at] in ",; \t\r\n":
            at += 1
        if not text.startswith("{", at):
            return calls
        try:
            obj, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return calls
        call = call_from(obj, "parameters")  # "arguments" or "parameters"
        if call is None:
            return calls
        calls.append(ToolCall(call.name, call.arguments, mistral_call_id()))


def _mistral_named(text: str, at: int) -> list[ToolCall]:
    """The `name[ARGS]{...}` calls from text[at] (just past the first [TOOL_CALLS]), each but the first after its
    own [TOOL_CALLS], up to the first that is not one."""
    calls: list[ToolCall] = []
    decoder = json.JSONDecoder()
    while True:
        cut = min((i for i in (text.find(MISTRAL_ARGS, at), text.find("{", at)) if i >= 0), default=-1)
        named = mistral_name(text[at:cut]) if cut >= 0 else None
        if named is None:
            return calls
        at = cut + (len(MISTRAL_ARGS) if text.startswith(MISTRAL_ARGS, cut) else 0)
        at += len(text[at:]) - len(text[at:].lstrip())
        try:
            args, at = decoder.raw_decode(text, at) if text.startswith("{", at) else (None, at)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            return calls
        calls.append(ToolCall(named[0], json.dumps(args, ensure_ascii=False), named[1] or mistral_call_id()))
        at += len(text[at:]) - len(text[at:].lstrip())
        if not text.startswith(MISTRAL_CALLS, at):
            return calls
        at += len(MISTRAL_CALLS)


def parse_mistral(text: str) -> Parsed:
    """The content before `[TOOL_CALLS]` and the calls after it, up to the first that is not one (none: all of the
    text is content); what follows the last call is ignored. As `tool_streams_mistral.MistralStream` streams it."""
    start = text.find(MISTRAL_CALLS)
    if start < 0:
        return Parsed(text or None, ())
    at = start + len(MISTRAL_CALLS)
    first = at + len(text[at:]) - len(text[at:].lstrip())
    calls = _mistral_list(text, first) if text.startswith("[", first) else _mistral_named(text, at)
    if not calls:
        return Parsed(text or None, ())
    return Parsed(text[:start].strip() or None, tuple(calls))


def parse(text: str, fmt: str) -> Parsed:
    if fmt == "hermes":
        return parse_hermes(text)
    if fmt == "llama3_json":
        return parse_llama3_json(text)
    if fmt == "mistral":
        return parse_mistral(text)
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
