"""Tool calls out of generated text (issue 19): the formats of the model families we serve.

- `hermes` (Qwen2 / Qwen2.5 / Qwen3, Hermes): each call is `<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>`; text outside the tags is the message's content.
- `llama3_json` (Llama-3.1 / 3.2): the whole output is one JSON object `{"name": ..., "parameters":
  {...}}` (or several joined by `;`), optionally after `<|python_tag|>`.

`parse(text)` gives the final message (content and calls; text that does not parse stays content, as
vLLM's parsers do). `HermesStream` turns the text as it is generated into OpenAI-style deltas: content
pieces, then per call one delta with its id and name followed by fragments of its arguments' JSON text,
so the fragments of a call concatenate to a JSON object equal to the one `parse` returns.
Pure string handling; no model, no server.
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


def _call_from(obj: Any, args_key: str) -> ToolCall | None:
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
            body = body[: len(body) - _partial_suffix(body, TOOL_CLOSE)]
        try:
            call = _call_from(json.loads(body), "arguments")
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
        call = _call_from(obj, "parameters")
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


class HermesStream:
    """Incremental `<tool_call>` parsing for streamed responses. `feed` returns the deltas the new text
    makes certain; `finish` those left at the end (an unclosed or malformed call's text as content)."""

    def __init__(self) -> None:
        self._buf = ""  # text not yet emitted
        self._in_call = False
        self._index = -1
        self._sent_args = 0  # characters of the current call's arguments text already sent
        self._started = False  # the current call's id/name delta was sent

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if not self._in_call:
                start = self._buf.find(TOOL_OPEN)
                if start < 0:
                    keep = _partial_suffix(self._buf, TOOL_OPEN)  # may be the start of a tag
                    if len(self._buf) > keep:
                        out.append(Delta(content=self._buf[: len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if start > 0:
                    out.append(Delta(content=self._buf[:start]))
                self._buf = self._buf[start + len(TOOL_OPEN):]
                self._in_call, self._index, self._sent_args, self._started = True, self._index + 1, 0, False
                continue
            end = self._buf.find(TOOL_CLOSE)
            body = self._buf[: len(self._buf) - _partial_suffix(self._buf, TOOL_CLOSE)] if end < 0 else self._buf[:end]
            out += self._call_progress(body, closed=end >= 0)
            if end < 0:
                return out
            self._buf = self._buf[end + len(TOOL_CLOSE):]
            self._in_call = False

    def finish(self) -> list[Delta]:
        if self._in_call:  # a call whose closing tag never came still counts when its JSON is whole
            cut = _partial_suffix(self._buf, TOOL_CLOSE)
            body, tail = self._buf[: len(self._buf) - cut], self._buf[len(self._buf) - cut:]
            out = self._call_progress(body, closed=True, close_tag=tail)
        else:
            out = [Delta(content=self._buf)] if self._buf else []
        self._buf, self._in_call = "", False
        return out

    def _call_progress(self, body: str, closed: bool, close_tag: str = TOOL_CLOSE) -> list[Delta]:
        out: list[Delta] = []
        if closed:
            try:
                call = _call_from(json.loads(body), "arguments")
            except json.JSONDecodeError:
                call = None
            if call is None:  # not a call: its text is content (nothing of it was streamed as a call)
                if not self._started:
                    self._index -= 1
                    return [Delta(content=TOOL_OPEN + body + close_tag)]
                return out  # a started call that ends malformed: nothing more to add
            if not self._started:
                self._started = True
                out.append(Delta(index=self._index, id=call.id, name=call.name))
            rest = call.arguments if self._sent_args == 0 else _args_tail(body, self._sent_args)
            if rest:
                out.append(Delta(index=self._index, arguments=rest))
            return out
        name, args_at = _name_and_args_start(body)
        if name is None or args_at is None:
            return out
        if not self._started:
            self._started = True
            out.append(Delta(index=self._index, id=f"call_{uuid.uuid4().hex[:24]}", name=name))
        # stream the arguments' text, holding back what may be the outer object's closing brace
        args_text = body[args_at:].rstrip()
        while args_text.endswith("}") and _balance(args_text) < 0:
            args_text = args_text[:-1].rstrip()
        if _balance(args_text) == 0 and args_text.endswith("}"):
            args_text = args_text[:-1]  # the object itself may close now: keep its last brace for the end
        if len(args_text) > self._sent_args:
            out.append(Delta(index=self._index, arguments=args_text[self._sent_args:]))
            self._sent_args = len(args_text)
        return out


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _balance(text: str) -> int:
    """Open minus closed braces/brackets outside JSON strings."""
    depth, in_str, esc = 0, False, False
    for ch in text:
        if in_str:
            esc = not esc and ch == "\\"
            if ch == '"' and not esc:
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
    return depth


def _name_and_args_start(body: str) -> tuple[str | None, int | None]:
    """The call's name once its string is complete and it comes before "arguments", and where the
    arguments' value starts (after `"arguments":` and spaces, at its opening brace)."""
    i = body.find('"name"')
    j = body.find('"arguments"')
    if i < 0 or j < 0 or j < i:
        return None, None
    try:
        name, _ = json.JSONDecoder().raw_decode(body[body.index(":", i) + 1:].lstrip())
    except (json.JSONDecodeError, ValueError):
        return None, None
    k = body.find(":", j)
    if k < 0:
        return None, None
    start = k + 1
    while start < len(body) and body[start] in " \t\r\n":
        start += 1
    if start >= len(body) or body[start] != "{" or not isinstance(name, str):
        return None, None
    return name, start


def _args_tail(body: str, sent: int) -> str:
    """The rest of the arguments' text after `sent` characters, up to the object's end."""
    _, at = _name_and_args_start(body)
    if at is None:
        return ""
    _, end = json.JSONDecoder().raw_decode(body, at)
    return body[at:end][sent:]
