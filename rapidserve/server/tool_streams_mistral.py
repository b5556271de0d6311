"""Streamed Mistral tool calls (`--tool-call-parser mistral`): OpenAI-style deltas as the text is generated.

The format is tool_parsers.py's (`parse_mistral`): content, then `[TOOL_CALLS]` and either a JSON list of
`{"name", "arguments"}` objects (read by a `JsonCallStream` in its "required" mode) or `name[ARGS]{...}` calls, each
after its own `[TOOL_CALLS]` (read here: the name is sent once `[ARGS]` or `{` ends it, then the arguments' JSON text
as it comes, up to its closing brace). Content is sent as it comes except what may begin `[TOOL_CALLS]`; after the
tag nothing is sent until it is certain to be a call. Text after the tag that is no call (none was sent yet) is
content, tag included; what follows the last call is ignored. The deltas reassemble to `parse_mistral`'s message
however the text is cut (but for a call whose arguments are cut short: sent as far as they came). Call ids are 9
letters and digits (`mistral_call_id`), or the `[CALL_ID]` the model gave. Pure string handling.
"""

from __future__ import annotations

from typing import Literal

from rapidserve.server.tool_parsers import (
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    MISTRAL_CALLS,
    Delta,
    mistral_call_id,
    mistral_name,
    partial_suffix,
)
from rapidserve.server.tool_streams import JsonCallStream, _Scan

State = Literal["content", "start", "list", "name", "args_start", "args", "after", "plain", "done"]
_NAME_BREAKS = (MISTRAL_ARGS, "{")


class MistralStream:
    """Incremental `[TOOL_CALLS]` parsing: `feed(text)` returns the deltas the new text makes certain, `finish()`
    the rest; `called` whether any call was streamed."""

    def __init__(self) -> None:
        self._text = ""
        self._pos = 0  # the text before it is dealt with
        self._state: State = "content"
        self._tag = 0  # where the first [TOOL_CALLS] starts
        self._items: JsonCallStream | None = None  # the JSON-list form's reader, fed from just past the tag
        self._list_fed = 0
        self._list_content = False  # the list form turned out content: its text was sent
        self._calls = 0
        self._named: tuple[str, str | None] = ("", None)  # the current call's name and id (name form)
        self._scan: _Scan | None = None  # its arguments
        self._args_at = 0
        self._sent = 0  # characters of its arguments sent

    @property
    def called(self) -> bool:
        return self._calls > 0

    def feed(self, text: str) -> list[Delta]:
        self._text += text
        return self._progress(final=False)

    def finish(self) -> list[Delta]:
        return self._progress(final=True)

    def _progress(self, final: bool) -> list[Delta]:
        out: list[Delta] = []
        while getattr(self, f"_{self._state}")(final, out):
            pass
        return out

    def _skip_space(self, at: int) -> int:
        return at + len(self._text[at:]) - len(self._text[at:].lstrip())

    def _fail(self, out: list[Delta]) -> bool:
        """What follows the tag is no call: with none sent, all of it is content (tag included); else ignored."""
        if self._calls:
            self._state = "done"
            return False
        out.append(Delta(content=self._text[self._tag:]))
        self._pos, self._state = len(self._text), "plain"
        return False

    # ---- the states: each returns whether to go on at once (False: wait for more text)
    def _content(self, final: bool, out: list[Delta]) -> bool:
        t = self._text
        i = t.find(MISTRAL_CALLS, self._pos)
        upto = i if i >= 0 else len(t) - (0 if final else partial_suffix(t[self._pos:], MISTRAL_CALLS))
        if upto > self._pos:
            out.append(Delta(content=t[self._pos:upto]))
        self._pos = upto
        if i < 0:
            return False
        self._tag, self._pos, self._state = i, i + len(MISTRAL_CALLS), "start"
        return True

    def _start(self, final: bool, out: list[Delta]) -> bool:
        at = self._skip_space(self._pos)
        if at >= len(self._text):
            return self._fail(out) if final else False
        if self._text[at] == "[":
            self._items, self._list_fed, self._state = JsonCallStream("required"), self._pos, "list"
        else:
            self._pos, self._state = at, "name"
        return True

    def _list(self, final: bool, out: list[Delta]) -> bool:
        assert self._items is not None
        deltas = self._items.feed(self._text[self._list_fed:])
        self._list_fed = len(self._text)
        if final:
            deltas += self._items.finish()
        for d in deltas:
            if d.index is None:  # the first item is no call: the list is content
                if not self._list_content:
                    out.append(Delta(content=self._text[self._tag:self._tag + len(MISTRAL_CALLS)]))
                    self._list_content = True
                out.append(d)
            elif d.id is not None:
                self._calls += 1
                out.append(Delta(index=d.index, id=mistral_call_id(), name=d.name, arguments=d.arguments))
            else:
                out.append(d)
        if final and not self._items.called and not self._list_content:  # e.g. a list of no objects
            return self._fail(out)
        return False

    def _name(self, final: bool, out: list[Delta]) -> bool:
        t = self._text
        cut = min((i for i in (t.find(b, self._pos) for b in _NAME_BREAKS) if i >= 0), default=-1)
        if cut < 0:
            head = t[self._pos:]
            for tag in (MISTRAL_ARGS, MISTRAL_CALL_ID):
                head = head[:len(head) - partial_suffix(head, tag)]
            if final or mistral_name(head.partition(MISTRAL_CALL_ID)[0].strip() or "x") is None:  # no name can come
                return self._fail(out)
            return False
        named = mistral_name(t[self._pos:cut])
        if named is None:
            return self._fail(out)
        self._named = named
        self._pos = cut + (len(MISTRAL_ARGS) if t.startswith(MISTRAL_ARGS, cut) else 0)
        self._state = "args_start"
        return True

    def _args_start(self, final: bool, out: list[Delta]) -> bool:
        """The call is sent once its arguments' opening brace came."""
        at = self._skip_space(self._pos)
        if at >= len(self._text):
            return self._fail(out) if final else False
        if self._text[at] != "{":
            return self._fail(out)
        self._calls += 1
        name, cid = self._named
        out.append(Delta(index=self._calls - 1, id=cid or mistral_call_id(), name=name))
        self._args_at, self._sent, self._scan, self._state = at, 0, _Scan(at), "args"
        return True

    def _args(self, final: bool, out: list[Delta]) -> bool:
        assert self._scan is not None
        end = self._scan.advance(self._text)
        upto = end if end > 0 else len(self._text)
        if upto - self._args_at > self._sent:
            out.append(Delta(index=self._calls - 1, arguments=self._text[self._args_at + self._sent:upto]))
            self._sent = upto - self._args_at
        if end < 0:
            return False
        self._pos, self._state = end, "after"
        return True

    def _after(self, final: bool, out: list[Delta]) -> bool:
        at = self._skip_space(self._pos)
        rest = self._text[at:]
        if rest.startswith(MISTRAL_CALLS):
            self._pos, self._state = at + len(MISTRAL_CALLS), "name"
            return True
        if not final and MISTRAL_CALLS.startswith(rest):  # nothing yet, or the next tag's beginning
            return False
        self._state = "done"
        return False

    def _plain(self, final: bool, out: list[Delta]) -> bool:
        if len(self._text) > self._pos:
            out.append(Delta(content=self._text[self._pos:]))
            self._pos = len(self._text)
        return False

    def _done(self, final: bool, out: list[Delta]) -> bool:
        return False
