"""A chat choice's text read for what the request asked of it: reasoning (`--reasoning-parser`) and tool calls.

The reasoning is split off first (reasoning_parsers.py); tool calls are then read out of the content alone, never
out of the reasoning, as vLLM does. `chat_message` gives a whole answer's assistant message; `ChatStream` gives
the same as a stream's deltas while the text is generated (one per piece: reasoning, content, a call's start or
a fragment of its arguments), which concatenate to that message whatever the token boundaries.

The reasoning travels in two fields with the same text: `reasoning` (vLLM's name since 0.11) and
`reasoning_content` (its earlier name, still the one DeepSeek's API and many clients read). On a server with a
reasoning parser every chat message carries both (null when there is no reasoning, or the request's
`include_reasoning` is false); a delta carries them only when it has reasoning. Pure; no model, no server.
"""

from __future__ import annotations

from typing import Any

from rapidserve.server import tool_calls
from rapidserve.server.reasoning_parsers import ReasoningPlan, ReasoningStream, Split, split
from rapidserve.server.tools import ToolPlan

REASONING_FIELDS = ("reasoning", "reasoning_content")


def parses(tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> bool:
    """Whether a chat choice's text is read for anything (else it is the message's content as it is)."""
    return reasoning is not None or (tools is not None and tools.parses)


def chat_message(text: str, tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole answer `text`, and whether it made tool calls."""
    parts = split(text, reasoning.thinking) if reasoning is not None else Split(None, text)
    called = False
    if tools is not None and tools.parses and parts.content is not None:
        answer = tool_calls.answer(parts.content, tools)
        message, called = tool_calls.message(answer), bool(answer.calls)
    else:
        message = {"role": "assistant", "content": parts.content}
    if reasoning is not None:
        message.update(dict.fromkeys(REASONING_FIELDS, parts.reasoning if reasoning.include else None))
    return message, called


class ChatStream:
    """The deltas of one streamed choice whose text is read (`parses`): `feed` each new piece of its text."""

    def __init__(self, tools: ToolPlan | None, reasoning: ReasoningPlan | None) -> None:
        self._reasoning = ReasoningStream(reasoning.thinking) if reasoning is not None else None
        self._include = reasoning is None or reasoning.include
        self._tools = tool_calls.ToolStream(tools) if tools is not None and tools.parses else None

    @property
    def called(self) -> bool:
        """Whether a tool call was streamed."""
        return self._tools is not None and self._tools.called

    def feed(self, text: str, last: bool) -> list[dict[str, Any]]:
        """The deltas `text` makes (`last`: the choice ends with it): its reasoning first, then its content or the
        tool calls read out of that content. Nothing of a think tag, and no empty piece, is sent."""
        if self._reasoning is None:
            reasoning, content = "", text
        else:
            parts = [self._reasoning.feed(text), *([self._reasoning.finish()] if last else [])]
            reasoning = "".join(p.reasoning or "" for p in parts)
            content = "".join(p.content or "" for p in parts)
        deltas: list[dict[str, Any]] = []
        if reasoning and self._include:
            deltas.append(dict.fromkeys(REASONING_FIELDS, reasoning))
        if self._tools is not None:
            pieces = self._tools.feed(content) + (self._tools.finish() if last else [])
            deltas += [tool_calls.delta_dict(p) for p in pieces]
        elif content:
            deltas.append({"content": content})
        return deltas
