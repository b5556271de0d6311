"""Streamed tool calls written as bare JSON (issue 19): OpenAI-style deltas as the text is generated.

`JsonCallStream` covers the outputs that are JSON from their first character:
- "named": the whole output is the arguments object of one known function (tool_choice naming it);
- "required": a JSON array of `{"name": ..., "parameters": {...}}` (tool_choice "required");
- "llama3_json": `{"name": ..., "parameters": {...}}` objects joined by `;`, after an optional
  `<|python_tag|>` (Llama 3.1 / 3.2 with tool_choice "auto").
Each call gets one delta with its index, id and name (once the name is whole), then fragments of its
arguments' JSON text as they come (never past the arguments' closing brace); the fragments of a call
concatenate to JSON equal to what `tool_parsers.parse` or `tool_calls.answer` gives for the whole
text. Output that does not start as such JSON is streamed as content. The stream re-reads the text so
far at each step (outputs are short), so the result does not depend on how the text was cut. Pure string handling.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from rapidserve.server.tool_parsers import PYTHON_TAG, Delta

JsonMode = Literal["named", "required", "llama3_json"]


@dataclass(frozen=True)
class _Partial:
    """One call as far as the text goes: its name (None until whole), its arguments' text so far."""

    name: str | None
    args: str
    complete: bool


def _string_end(text: str, i: int) -> int:
    """The index after the JSON string starting at text[i] == '"', or -1 if it is not closed yet."""
    i += 1
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == '"':
            return i + 1
        i += 1
    return -1


def _value_end(text: str, i: int) -> int:
    """The index after the JSON object or array starting at text[i], or -1 if it is not closed yet."""
    depth = 0
    while i < len(text):
        ch = text[i]
        if ch == '"':
            i = _string_end(text, i)
            if i < 0:
                return -1
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def _args_so_far(args: str) -> str:
    """The arguments object's text as far as it goes: up to its closing brace once it has one (what
    follows belongs to the enclosing call), else all of it (a prefix of its final text)."""
    end = _value_end(args, 0)
    return args[:end] if end > 0 else args


def _key_value_start(obj: str, key: str) -> int | None:
    """Where the value of the top-level `key` of the (possibly partial) object `obj` starts."""
    i, depth = 1, 1
    while i < len(obj):
        ch = obj[i]
        if ch == '"':
            end = _string_end(obj, i)
            if end < 0:
                return None
            if depth == 1 and obj[i + 1:end - 1] == key:
                j = end
                while j < len(obj) and obj[j] in " \t\r\n":
                    j += 1
                if j < len(obj) and obj[j] == ":":
                    j += 1
                    while j < len(obj) and obj[j] in " \t\r\n":
                        j += 1
                    return j if j < len(obj) else None
            i = end
            continue
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        i += 1
    return None


def _partial_call(obj: str, args_keys: tuple[str, ...]) -> _Partial:
    """A call object `{"name": ..., <args key>: {...}}`, complete or cut off."""
    end = _value_end(obj, 0)
    if end > 0:
        try:
            whole = json.loads(obj[:end])
        except json.JSONDecodeError:
            return _Partial(None, "", True)
        name = whole.get("name") if isinstance(whole, dict) else None
        for key in args_keys:
            at = _key_value_start(obj[:end], key)
            if at is not None and obj[at] == "{":
                return _Partial(name if isinstance(name, str) else None, obj[at:_value_end(obj, at)], True)
        return _Partial(name if isinstance(name, str) else None, "", True)
    name = None
    at_name = _key_value_start(obj, "name")
    if at_name is not None and obj[at_name] == '"':
        stop = _string_end(obj, at_name)
        if stop > 0:
            name = json.loads(obj[at_name:stop])
    for key in args_keys:
        at = _key_value_start(obj, key)
        if at is not None and obj[at] == "{":
            return _Partial(name, _args_so_far(obj[at:]), False)
    return _Partial(name, "", False)


def _calls(body: str, seps: str, args_keys: tuple[str, ...]) -> list[_Partial]:
    """The call objects of `body`, separated by any of `seps` and whitespace, up to a closing bracket."""
    out: list[_Partial] = []
    i = 0
    while i < len(body):
        while i < len(body) and (body[i] in seps or body[i] in " \t\r\n"):
            i += 1
        if i >= len(body) or body[i] != "{":
            break
        end = _value_end(body, i)
        out.append(_partial_call(body[i:] if end < 0 else body[i:end], args_keys))
        if end < 0:
            break
        i = end
    return out


class JsonCallStream:
    """Incremental calls of one "named", "required" or "llama3_json" output: `feed(text)` returns the
    deltas the new text makes certain, `finish()` the rest; `called` whether any call was streamed."""

    def __init__(self, mode: JsonMode, function: str | None = None, names: tuple[str, ...] | None = None) -> None:
        """`function`: the named function ("named"); `names`: the functions a call may name (None: any)."""
        if mode == "named" and not function:
            raise ValueError("a named-function stream needs the function's name")
        self.mode, self.function, self.names = mode, function, names
        self._text = ""
        self._content: bool | None = None  # None: undecided; True: plain content; False: calls
        self._sent_content = 0
        self._ids: list[str] = []  # per call streamed: its id
        self._sent_args: list[int] = []

    @property
    def called(self) -> bool:
        return bool(self._ids)

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return self._progress(final=False)

    def finish(self) -> list[Delta]:
        return self._progress(final=True)

    def _body(self, final: bool) -> str | None:
        """The JSON part of the text once the output is known to be calls; None while undecided or content."""
        s = self._text.lstrip()
        if self.mode == "llama3_json":
            if s.startswith(PYTHON_TAG):
                s = s[len(PYTHON_TAG):].lstrip()
            elif PYTHON_TAG.startswith(s) and s and not final:
                return None
        if not s:
            if final:
                self._content = True
            return None
        opening = "[" if self.mode == "required" else "{"
        self._content = s[0] != opening
        return None if self._content else s

    def _progress(self, final: bool) -> list[Delta]:
        body = self._body(final) if self._content is not True else None
        if self._content:
            rest = self._text[self._sent_content:]
            self._sent_content = len(self._text)
            return [Delta(content=rest)] if rest else []
        if body is None:
            return []
        if self.mode == "named":
            end = _value_end(body, 0)
            partials = [_Partial(self.function, body[:end] if end > 0 else body.rstrip(), end > 0)]
        elif self.mode == "required":
            partials = _calls(body[1:], ",", ("parameters", "arguments"))
        else:
            partials = _calls(body, ";", ("parameters", "arguments"))
        out: list[Delta] = []
        for i, p in enumerate(partials):
            not_a_call = (p.complete and p.name is None) or (
                p.name is not None and self.names is not None and p.name not in self.names)
            if not_a_call and not self._ids:  # nothing streamed as a call yet: all of the text is content
                self._content = True
                return self._progress(final)
            if p.name is None or not_a_call:
                break
            if i == len(self._ids):
                self._ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self._sent_args.append(0)
                out.append(Delta(index=i, id=self._ids[i], name=p.name))
            if len(p.args) > self._sent_args[i]:
                out.append(Delta(index=i, arguments=p.args[self._sent_args[i]:]))
                self._sent_args[i] = len(p.args)
        return out
