"""Reasoning parsers (vLLM's --reasoning-parser; rapidserve/server/reasoning_parsers.py, chat_output.py): tables of
whole answers, the same answers streamed cut at every pair of points (so every tag arrives in every possible set
of pieces), which plan a chat request gets, and tool calls read from the content alone."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from rapidserve.server.chat_output import ChatStream, chat_message
from rapidserve.server.reasoning_parsers import (
    ReasoningPlan,
    ReasoningStream,
    Split,
    plan_reasoning,
    split,
    tag_problem,
    thinks_first,
)
from rapidserve.server.tools import ToolPlan

# (text, thinking) -> (reasoning, content)
CASES: list[tuple[str, bool, str | None, str | None]] = [
    ("Let me think.</think>\n\nIt is 4.", True, "Let me think.", "\n\nIt is 4."),  # R1: <think> is in the prompt
    ("<think>\nhmm\n</think>\n\nYes.", True, "\nhmm\n", "\n\nYes."),  # Qwen3's older template: the model opens it
    ("  \n<think>x</think>y", True, "x", "y"),  # whitespace before the opening tag goes with it
    ("no closing tag, cut by max_tokens", True, "no closing tag, cut by max_tokens", None),
    ("</think>only content", True, "", "only content"),
    ("reasoning</think>", True, "reasoning", None),  # nothing after the tag: no content
    ("", True, "", None),  # EOS first
    ("a < b and </thin is not a tag</think>c", True, "a < b and </thin is not a tag", "c"),
    ("x<think>y</think>z", True, "x<think>y", "z"),  # an opening tag after text is text
    ("<thinking>x</think>y", True, "<thinking>x", "y"),  # not the tag
    ("r</think>c</think>d", True, "r", "c</think>d"),  # the first closing tag ends the reasoning; later ones are text
    ("<think>", True, "", None),
    ("<thi", True, "<thi", None),  # the answer ended inside what could have been the tag: reasoning
    ("r</thi", True, "r</thi", None),
    ("<think><think>x</think>", True, "<think>x", None),
    ("\n</think>x", True, "\n", "x"),
    ("Plain answer.", False, None, "Plain answer."),  # qwen3 with enable_thinking false: all content
    ("<think>x</think>y", False, None, "<think>x</think>y"),
    ("", False, None, ""),
]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_split_a_whole_answer(text: str, thinking: bool, reasoning: str | None, content: str | None) -> None:
    assert split(text, thinking) == Split(reasoning, content)


def _stream(pieces: list[str], thinking: bool) -> tuple[str, str, list[Split]]:
    s = ReasoningStream(thinking)
    out = [s.feed(p) for p in pieces] + [s.finish()]
    return "".join(p.reasoning or "" for p in out), "".join(p.content or "" for p in out), out


def _cuts(text: str) -> list[list[str]]:
    """`text` cut at every pair of points (empty pieces included), and one character at a time."""
    out = [[text[:i], text[i:j], text[j:]] for i, j in itertools.combinations_with_replacement(range(len(text) + 1), 2)]
    return [*out, list(text)]


@pytest.mark.parametrize(("text", "thinking", "reasoning", "content"), CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_streamed_at_every_cut_gives_the_whole_answer(text: str, thinking: bool, reasoning: str | None,
                                                      content: str | None) -> None:
    for pieces in _cuts(text):
        got_r, got_c, out = _stream(pieces, thinking)
        assert (got_r, got_c) == (reasoning or "", content or ""), pieces
        # reasoning never comes after content, and nothing is empty-but-present
        first_content = next((i for i, p in enumerate(out) if p.content is not None), len(out))
        assert all(p.reasoning is None for p in out[first_content + 1:]), pieces
        assert all(p.reasoning != "" and p.content != "" for p in out), pieces


@pytest.mark.parametrize(("pieces", "thinking", "want"), [
    (["abc"], True, [Split("abc", None)]),  # sent at once: "abc" cannot become a tag
    (["abc</th", "ink>xy"], True, [Split("abc", None), Split(None, "xy")]),  # only "</th" is held
    (["ab<", "c"], True, [Split("ab", None), Split("<c", None)]),  # held "<" released once it is no tag
    (["  ", "<thi", "nk>r"], True, [Split(None, None), Split(None, None), Split("r", None)]),
    (["r</think>", "c", "d"], True, [Split("r", None), Split(None, "c"), Split(None, "d")]),
    (["</think", "", ">"], True, [Split(None, None), Split(None, None), Split(None, None)]),
    (["<think>x"], False, [Split(None, "<think>x")]),  # not thinking: passed straight on
])
def test_stream_holds_back_only_what_may_be_a_tag(pieces: list[str], thinking: bool, want: list[Split]) -> None:
    s = ReasoningStream(thinking)
    assert [s.feed(p) for p in pieces] == want
    assert s.in_reasoning == (thinking and "</think>" not in "".join(pieces))


@pytest.mark.parametrize(("parser", "kwargs", "thinking"), [
    ("deepseek_r1", {}, True),
    ("deepseek_r1", {"enable_thinking": False}, True),  # R1's template always opens <think>
    ("qwen3", {}, True),  # Qwen3 thinks by default
    ("qwen3", {"enable_thinking": True}, True),
    ("qwen3", {"enable_thinking": False}, False),
    ("qwen3", {"enable_thinking": 0}, True),  # Qwen3's template turns it off only for `false` itself
    ("qwen3", {"enable_thinking": "false"}, True),
    ("qwen3", {"other": 1}, True),
])
def test_which_answers_begin_inside_the_reasoning(parser: str, kwargs: dict[str, Any], thinking: bool) -> None:
    assert thinks_first(parser, kwargs) is thinking
    assert plan_reasoning(parser, kwargs) == ReasoningPlan(parser, thinking, True)
    assert plan_reasoning(parser, kwargs, include=False) == ReasoningPlan(parser, thinking, False)
    assert plan_reasoning(None, kwargs) is None  # no parser: nothing is split


def test_unknown_parser_and_the_tokenizer_check_name_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        thinks_first("granite", {})
    assert tag_problem({"<think>", "</think>", "a"}) is None
    problem = tag_problem({"<think>", "a"})
    assert problem is not None and "no </think> token" in problem and "drop --reasoning-parser" in problem
    assert "<think> or </think>" in (tag_problem(set()) or "")


# ---------------------------------------------------------------- reasoning with tool calls (chat_output.py)

HERMES = ToolPlan("auto", ({"type": "function", "function": {"name": "get_weather"}},), ("get_weather",),
                  parser="hermes")
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
R1 = ReasoningPlan("deepseek_r1", True)
QWEN_OFF = ReasoningPlan("qwen3", False)


def _reassemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"reasoning": "", "reasoning_content": "", "content": "", "calls": {}}
    for d in deltas:
        assert d, "an empty delta is never made"
        for k in ("reasoning", "reasoning_content", "content"):
            out[k] += d.get(k) or ""
        for c in d.get("tool_calls", []):
            if "id" in c:
                out["calls"][c["index"]] = [c["function"]["name"], c["function"]["arguments"]]
            else:
                out["calls"][c["index"]][1] += c["function"]["arguments"]
    return out


@pytest.mark.parametrize(("text", "tools", "reasoning", "want"), [
    # the call after the reasoning is read; the content before it stays content
    (f"I should call it.</think>Checking.\n{CALL}", HERMES, R1,
     ("I should call it.", "Checking.", [("get_weather", {"city": "Paris"})])),
    # a call written inside the reasoning is reasoning, never a call (as vLLM: calls come from the content)
    (f"maybe {CALL}</think>It is sunny.", HERMES, R1, (f"maybe {CALL}", "It is sunny.", [])),
    (f"still thinking {CALL}", HERMES, R1, (f"still thinking {CALL}", None, [])),  # cut short inside the reasoning
    (f"{CALL}", HERMES, QWEN_OFF, (None, None, [("get_weather", {"city": "Paris"})])),  # thinking off: all content
    ("plan</think>Just words.", None, R1, ("plan", "Just words.", [])),
    ("plan</think>Just words.", HERMES, None, (None, "plan</think>Just words.", [])),  # no parser: as before
])
def test_tool_calls_are_read_from_the_content_only(text: str, tools: ToolPlan | None,
                                                   reasoning: ReasoningPlan | None, want: tuple[Any, ...]) -> None:
    message, called = chat_message(text, tools, reasoning)
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    got_reasoning = message.get("reasoning") if reasoning is not None else None
    assert (got_reasoning, message["content"], calls) == want and called == bool(calls)
    if reasoning is not None:
        assert message["reasoning_content"] == message["reasoning"]  # vLLM's old name and its new one
    else:
        assert "reasoning" not in message and "reasoning_content" not in message
    for pieces in _cuts(text):  # streamed: the same reasoning, content and calls, whatever the cuts
        stream = ChatStream(tools, reasoning)
        deltas = [d for k, p in enumerate(pieces) for d in stream.feed(p, k == len(pieces) - 1)]
        got = _reassemble(deltas)
        assert got["reasoning"] == got["reasoning_content"] == (want[0] or ""), pieces
        assert got["content"].strip() == (want[1] or ""), pieces
        assert [(n, json.loads(a)) for n, a in got["calls"].values()] == want[2], pieces
        assert stream.called == bool(want[2])


def test_include_reasoning_false_leaves_it_out() -> None:
    plan = ReasoningPlan("qwen3", True, include=False)
    message, _ = chat_message("secret plan</think>Answer.", None, plan)
    assert message == {"role": "assistant", "content": "Answer.", "reasoning": None, "reasoning_content": None}
    stream = ChatStream(None, plan)
    assert stream.feed("secret plan</think>", False) == [] and stream.feed("Answer.", True) == [{"content": "Answer."}]
