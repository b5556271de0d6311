"""Streamed tool calls (issue 19): OpenAI-style deltas as the text is generated.

`HermesStream`: content outside `<tool_call>...</tool_call>` blocks, and in each block one call read
as `JsonCallStream` reads it (a block that is not a call is content, tags included).
`JsonCallStream` covers the outputs that are JSON from their first character:
- "named": the whole output is the arguments object of one known function (tool_choice naming it);
- "required": a JSON array of `{"name": ..., "parameters": {...}}` (tool_choice "required");
- "llama3_json": `{"name": ..., "parameters": {...}}` objects joined by `;`, after an optional
  `<|python_tag|>` (Llama 3.1 / 3.2 with tool_choice "auto").
Each call gets one delta with its index, id and name (once the name is whole), then fragments of its
arguments' JSON text as they come (never past the arguments' closing brace); the fragments of a call
concatenate to JSON equal to what `tool_parsers.parse` or `tool_calls.answer` gives for the whole
text, however the text was cut. Output that does not start as such JSON (or whose first object is not
a call of a known function) is streamed as content. Each character is scanned once (`_Scan`), so a
long output costs linear time. Pure string handling.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Literal

from rapidserve.server.tool_parsers import PYTHON_TAG, TOOL_CLOSE, TOOL_OPEN, Delta, call_from, partial_suffix

JsonMode = Literal["named", "required", "llama3_json"]
ARGS_KEYS = ("parameters", "arguments")
_SEARCH_EVERY_CHAR_UNTIL = 256  # past this, a call's keys are searched for when its length has doubled


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


class _Scan:
    """Where the JSON object or array starting at `start` ends, read incrementally as the text grows."""

    def __init__(self, start: int) -> None:
        self.i, self.depth, self.in_str, self.esc, self.end = start, 0, False, False, -1

    def advance(self, text: str) -> int:
        """The index after the value's closing bracket, or -1 while it is open."""
        i = self.i
        while self.end < 0 and i < len(text):
            ch = text[i]
            i += 1
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = i
        self.i = i
        return self.end


@dataclass
class _Call:
    """The call object being read: where it starts, its scan, and what is known of it so far."""

    start: int
    scan: _Scan
    name: str | None = None
    args_at: int | None = None
    args_scan: _Scan | None = None
    search_at: int = 0  # the object's length at which its keys are next searched for
    sent: int = 0  # characters of its arguments sent
    id: str | None = None  # set once its start was sent
    whole_args: str | None = None  # once the object is whole: its arguments (normalized JSON text)


class JsonCallStream:
    """Incremental calls of one "named", "required" or "llama3_json" output: `feed(text)` returns the
    deltas the new text makes certain, `finish()` the rest; `called` whether any call was streamed."""

    def __init__(self, mode: JsonMode, function: str | None = None, names: tuple[str, ...] | None = None,
                 max_calls: int | None = None) -> None:
        """`function`: the named function ("named"); `names`: the functions a call may name (None: any);
        `max_calls`: the calls to read at most (what follows them is ignored)."""
        if mode == "named" and not function:
            raise ValueError("a named-function stream needs the function's name")
        self.mode, self.function, self.names = mode, function, names
        self.max_calls = 1 if mode == "named" else max_calls
        self._text = ""
        self._content: bool | None = None  # None: undecided; True: plain content; False: calls
        self._sent_content = 0
        self._next = 0  # calls mode: where the next call object may start
        self._cur: _Call | None = None
        self._calls = 0  # calls whose start was sent
        self._done = False  # the calls are over (closing bracket, or text that is not a call)

    @property
    def called(self) -> bool:
        return self._calls > 0

    @property
    def text(self) -> str:
        """All the text fed so far."""
        return self._text

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return self._progress(final=False)

    def finish(self) -> list[Delta]:
        return self._progress(final=True)

    def _decide(self, final: bool) -> None:
        """Whether the output is calls (and where their JSON starts) or content, once that is certain."""
        t = self._text
        at = len(t) - len(t.lstrip())
        if self.mode == "llama3_json":
            if t.startswith(PYTHON_TAG, at):
                at += len(PYTHON_TAG)
                at += len(t[at:]) - len(t[at:].lstrip())
            elif at < len(t) and PYTHON_TAG.startswith(t[at:]) and not final:
                return
        if at >= len(t):
            if final:
                self._content = True
            return
        self._content = t[at] != ("[" if self.mode == "required" else "{")
        if not self._content:
            self._next = at + 1 if self.mode == "required" else at
            if self.mode == "named":
                self._cur = _Call(at, _Scan(at), name=self.function, args_at=at, args_scan=_Scan(at))

    def _progress(self, final: bool) -> list[Delta]:
        if self._content is None:
            self._decide(final)
        if self._content:
            rest = self._text[self._sent_content:]
            self._sent_content = len(self._text)
            return [Delta(content=rest)] if rest else []
        out: list[Delta] = []
        while self._content is False and not self._done:
            cur = self._cur or self._start_call()
            if cur is None:
                break
            end = cur.scan.advance(self._text)
            self._learn(cur, end)
            allowed = bool(cur.name) and (self.names is None or cur.name in self.names)
            if not allowed and (end > 0 or cur.name is not None):
                if self._calls == 0:  # nothing streamed as a call yet: all of the text is content
                    self._content = True
                    return self._progress(final)
                self._done = True
                break
            if allowed and cur.id is None and (cur.args_at is not None or end > 0):
                cur.id = f"call_{uuid.uuid4().hex[:24]}"
                out.append(Delta(index=self._calls, id=cur.id, name=cur.name))
                self._calls += 1
            if cur.id is not None and cur.args_at is None and cur.whole_args is not None:
                out.append(Delta(index=self._calls - 1, arguments=cur.whole_args))  # not an inline object
                cur.whole_args = None
            if cur.id is not None and cur.args_at is not None and cur.args_scan is not None:
                args_end = cur.args_scan.advance(self._text)
                upto = args_end if args_end > 0 else len(self._text.rstrip()) if self.mode == "named" \
                    else len(self._text)
                if upto - cur.args_at > cur.sent:
                    out.append(Delta(index=self._calls - 1, arguments=self._text[cur.args_at + cur.sent:upto]))
                    cur.sent = upto - cur.args_at
            if end < 0:
                break
            self._cur, self._next = None, end
            if self.max_calls is not None and self._calls >= self.max_calls:
                self._done = True
        return out

    def _start_call(self) -> _Call | None:
        """The next call object's start, past separators; None while it has not begun. Sets `_done`
        at a closing bracket or at anything that is not an object."""
        t, i = self._text, self._next
        seps = ",; \t\r\n" if self.mode == "required" else "; \t\r\n"
        while i < len(t) and t[i] in seps:
            i += 1
        self._next = i
        if i >= len(t):
            return None
        if t[i] != "{":
            self._done = True
            return None
        self._cur = _Call(i, _Scan(i))
        return self._cur

    def _learn(self, cur: _Call, end: int) -> None:
        """The call's name and where its arguments start, once the text shows them (searched while the
        object is short, then each time its length doubles, and once it is whole)."""
        length = (end if end > 0 else len(self._text)) - cur.start
        if (cur.name is not None and cur.args_at is not None) or (
                end < 0 and length >= _SEARCH_EVERY_CHAR_UNTIL and length < cur.search_at):
            return
        cur.search_at = 2 * length
        obj = self._text[cur.start:cur.start + length]
        if end > 0:
            try:
                call = call_from(json.loads(obj), "parameters")
            except json.JSONDecodeError:
                call = None
            if call is None:
                cur.name = ""  # a whole object that is not a call: never allowed
                return
            cur.name, cur.whole_args = call.name, call.arguments
        elif cur.name is None:
            at = _key_value_start(obj, "name")
            if at is not None and obj[at] == '"':
                stop = _string_end(obj, at)
                if stop > 0:
                    cur.name = json.loads(obj[at:stop])
        if cur.args_at is None:
            for key in ARGS_KEYS:
                at = _key_value_start(obj, key)
                if at is not None and obj[at] == "{":
                    cur.args_at = cur.start + at
                    cur.args_scan = _Scan(cur.args_at)
                    break


class HermesStream:
    """Incremental `<tool_call>` parsing (hermes: Qwen2/2.5/3, Hermes). `feed` returns the deltas the new
    text makes certain, `finish` those left at the end: a call whose closing tag never came counts when
    its JSON is whole; a block that is not a call is content, tags included."""

    def __init__(self) -> None:
        self._buf = ""  # outside a block: what may begin a tag; inside: what may begin the closing tag
        self._block: JsonCallStream | None = None  # the block being read
        self._calls = 0  # calls streamed

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while True:
            if self._block is None:
                start = self._buf.find(TOOL_OPEN)
                if start < 0:
                    keep = partial_suffix(self._buf, TOOL_OPEN)
                    if len(self._buf) > keep:
                        out.append(Delta(content=self._buf[:len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if start > 0:
                    out.append(Delta(content=self._buf[:start]))
                self._buf = self._buf[start + len(TOOL_OPEN):]
                self._block = JsonCallStream("llama3_json", max_calls=1)
                continue
            end = self._buf.find(TOOL_CLOSE)
            if end < 0:
                keep = partial_suffix(self._buf, TOOL_CLOSE)
                out += self._of_block(self._block.feed(self._buf[:len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep:]
                return out
            out += self._of_block(self._block.feed(self._buf[:end])) + self._close(TOOL_CLOSE)
            self._buf = self._buf[end + len(TOOL_CLOSE):]

    def finish(self) -> list[Delta]:
        buf, self._buf = self._buf, ""
        if self._block is not None:
            return self._close(buf)  # the closing tag, cut short or missing
        return [Delta(content=buf)] if buf else []

    def _close(self, tag: str) -> list[Delta]:
        block, self._block = self._block, None
        assert block is not None
        out = self._of_block(block.finish())
        return out if block.called else [Delta(content=TOOL_OPEN + block.text + tag)]

    def _of_block(self, deltas: list[Delta]) -> list[Delta]:
        """The block's call deltas, numbered among all the calls (its content deltas are dropped: a block
        that is not a call is sent whole when it closes)."""
        out = []
        for d in deltas:
            if d.index is None:
                continue
            if d.id is not None:
                self._calls += 1
            out.append(Delta(index=self._calls - 1, id=d.id, name=d.name, arguments=d.arguments))
        return out
