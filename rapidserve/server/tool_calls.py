"""Tool calling, the answer side (issue 19): generated text -> the assistant message's `tool_calls`.

`answer(text, plan)` gives a whole message's content and calls by the plan's mode (`tools.ToolPlan`):
- "auto": the server's parser (`tool_parsers.parse`: hermes `<tool_call>`, llama3_json or mistral `[TOOL_CALLS]`);
- "required": the JSON array of `{"name", "parameters"}` the constraint asks for;
- "named": the output is the forced function's arguments object;
- "none": the text as it is.
Text that does not parse (possible only while the constraint is not enforced, or when `max_tokens` cut
the output) stays the message's content with no calls, as vLLM's parsers leave text they cannot
read. `ToolStream` gives the same calls as OpenAI-style deltas while the text is generated;
`finish_reason` is "tool_calls" when "auto" or "required" produced calls (a named function's answer
keeps the engine's "stop", as OpenAI's and vLLM's do). With parallel_tool_calls false (`ToolPlan.parallel`) only
the first call is answered, whole and streamed, as vLLM's answer keeps it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rapidserve.server.tool_parsers import Delta, ToolCall, parse
from rapidserve.server.tool_streams import HermesStream, JsonCallStream
from rapidserve.server.tool_streams_mistral import MistralStream
from rapidserve.server.tools import ToolPlan


@dataclass(frozen=True)
class ToolAnswer:
    content: str | None
    calls: tuple[ToolCall, ...]


def _required_calls(text: str, names: tuple[str, ...]) -> tuple[ToolCall, ...] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for it in items:
        if not (isinstance(it, dict) and it.get("name") in names and isinstance(it.get("parameters"), dict)):
            return None
        calls.append(ToolCall(it["name"], json.dumps(it["parameters"], ensure_ascii=False)))
    return tuple(calls)


def _named_call(text: str, function: str) -> ToolCall | None:
    try:
        args = json.loads(text)
    except json.JSONDecodeError:
        return None
    return ToolCall(function, json.dumps(args, ensure_ascii=False)) if isinstance(args, dict) else None


def answer(text: str, plan: ToolPlan) -> ToolAnswer:
    """The message's content and tool calls for the whole generated `text`."""
    if plan.mode == "auto":
        assert plan.parser is not None
        parsed = parse(text, plan.parser)
        calls = parsed.calls if plan.parallel else parsed.calls[:1]
        return ToolAnswer(parsed.content, calls) if calls else ToolAnswer(text, ())
    if plan.mode == "required":
        calls = _required_calls(text, plan.names)
        return ToolAnswer(None, calls) if calls else ToolAnswer(text, ())
    if plan.mode == "named":
        assert plan.function is not None
        call = _named_call(text, plan.function)
        return ToolAnswer(None, (call,)) if call is not None else ToolAnswer(text, ())
    return ToolAnswer(text, ())


def finish_reason(plan: ToolPlan, called: bool, reason: str | None) -> str | None:
    """OpenAI's finish reason of a choice: "tool_calls" when auto or required produced calls, else `reason`."""
    if reason is not None and called and plan.mode in ("auto", "required"):
        return "tool_calls"
    return reason


def call_dict(c: ToolCall) -> dict[str, Any]:
    """One entry of a message's `tool_calls` (OpenAI's shape)."""
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def message(a: ToolAnswer) -> dict[str, Any]:
    """The assistant message of a whole answer (`tool_calls` only when there are calls)."""
    m: dict[str, Any] = {"role": "assistant", "content": a.content}
    if a.calls:
        m["tool_calls"] = [call_dict(c) for c in a.calls]
    return m


def delta_dict(d: Delta) -> dict[str, Any]:
    """A streamed chunk's `delta` for one piece: content, a call's start (index, id, type, name) or a
    fragment of its arguments."""
    if d.index is None:
        return {"content": d.content or ""}
    call: dict[str, Any] = {"index": d.index}
    if d.id is not None:
        call.update(id=d.id, type="function", function={"name": d.name, "arguments": d.arguments or ""})
    else:
        call["function"] = {"arguments": d.arguments or ""}
    return {"tool_calls": [call]}


class ToolStream:
    """The deltas of one choice's text under `plan` (which must parse: mode other than "none")."""

    def __init__(self, plan: ToolPlan) -> None:
        self._stream: HermesStream | JsonCallStream | MistralStream
        if plan.mode == "auto" and plan.parser == "hermes":
            self._stream = HermesStream()
        elif plan.mode == "auto" and plan.parser == "mistral":
            self._stream = MistralStream()
        elif plan.mode == "auto":
            self._stream = JsonCallStream("llama3_json")
        elif plan.mode == "required":
            self._stream = JsonCallStream("required", names=plan.names)
        elif plan.mode == "named":
            self._stream = JsonCallStream("named", plan.function)
        else:
            raise ValueError("tool_choice \"none\" streams plain content: no ToolStream")
        self._parallel = plan.parallel

    @property
    def called(self) -> bool:
        """Whether a call was streamed."""
        return self._stream.called

    def feed(self, text: str) -> list[Delta]:
        return self._kept(self._stream.feed(text))

    def finish(self) -> list[Delta]:
        return self._kept(self._stream.finish())

    def _kept(self, deltas: list[Delta]) -> list[Delta]:
        """The deltas with something in them; without parallel calls, none of a second call (vLLM keeps index 0)."""
        return [d for d in deltas if (d.index is not None and (self._parallel or d.index == 0))
                or (d.index is None and d.content)]
