"""Tool-call parsing (rapidserve/server/tool_parsers.py): final messages, and streamed deltas that
reassemble to the same calls however the text is cut."""

from __future__ import annotations

import json
import random

import pytest

from rapidserve.server.tool_parsers import parse, parse_hermes, parse_llama3_json
from rapidserve.server.tool_streams import HermesStream

W = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
NESTED = ('{"name": "book", "arguments": {"who": {"first": "A", "tags": ["x", "}{", "]"]}, '
          '"note": "a \\"quoted\\" } brace", "n": [1, [2, {"k": null}]]}}')

# text -> (content, [(name, arguments)])
HERMES = [
    ("Just words.", ("Just words.", [])),
    (f"<tool_call>{W}</tool_call>", (None, [("get_weather", {"city": "Paris", "days": 3})])),
    (f"Let me check.\n<tool_call>\n{W}\n</tool_call>\n<tool_call>{NESTED}</tool_call>",
     ("Let me check.", [("get_weather", {"city": "Paris", "days": 3}),
                        ("book", json.loads(NESTED)["arguments"])])),
    ("<tool_call>{not json}</tool_call> after", ("<tool_call>{not json}</tool_call> after", [])),
    (f"<tool_call>{W}", (None, [("get_weather", {"city": "Paris", "days": 3})])),  # no closing tag
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', (None, [("f", {"a": 1})])),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', (None, [("f", {"a": 1})])),  # args first
    ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),  # no name
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', ('<tool_call>{"name": "f", "arguments": [1]}'
                                                              '</tool_call>', [])),
    ('<tool_call>{"name": "f", "arguments": {}}</tool_call>', (None, [("f", {})])),
    ("ends with a partial tag <tool_c", ("ends with a partial tag <tool_c", [])),
    (f"<tool_call>{W}</tool_ca", (None, [("get_weather", {"city": "Paris", "days": 3})])),  # cut in the tag
]


def summary(p: object) -> tuple[str | None, list[tuple[str, object]]]:
    return p.content, [(c.name, json.loads(c.arguments)) for c in p.calls]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("text", "want"), HERMES, ids=[f"h{i}" for i in range(len(HERMES))])
def test_parse_hermes(text: str, want: tuple[str | None, list[tuple[str, object]]]) -> None:
    got = parse_hermes(text)
    assert summary(got) == want
    assert len({c.id for c in got.calls}) == len(got.calls) and all(c.id.startswith("call_") for c in got.calls)


@pytest.mark.parametrize(("text", "want"), [
    ('{"name": "f", "parameters": {"a": 1}}', (None, [("f", {"a": 1})])),
    ('<|python_tag|>{"name": "f", "parameters": {}}', (None, [("f", {})])),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "arguments": {"b": [2]}}',
     (None, [("f", {"a": 1}), ("g", {"b": [2]})])),
    ("Hello there", ("Hello there", [])),
    ('{"name": "f", "parameters": {"a": 1}', ('{"name": "f", "parameters": {"a": 1}', [])),  # cut off
    ('{"no_name": 1}', ('{"no_name": 1}', [])),
])
def test_parse_llama3_json(text: str, want: tuple[str | None, list[tuple[str, object]]]) -> None:
    assert summary(parse_llama3_json(text)) == want
    assert summary(parse(text, "llama3_json")) == want


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral"):
        parse("x", "pythonic")


def stream(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]], list[object]]:
    """Feed `text` cut at `cuts`; (content, [(name, arguments text)], deltas)."""
    s = HermesStream()
    deltas: list[object] = []
    prev = 0
    for c in [*cuts, len(text)]:
        deltas += s.feed(text[prev:c])
        prev = c
    deltas += s.finish()
    content = "".join(d.content for d in deltas if d.content is not None)  # type: ignore[attr-defined]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is None:  # type: ignore[attr-defined]
            continue
        if d.name is not None:  # type: ignore[attr-defined]
            assert d.index not in calls and d.id.startswith("call_")  # type: ignore[attr-defined]
            calls[d.index] = [d.name, ""]  # type: ignore[attr-defined]
        if d.arguments is not None:  # type: ignore[attr-defined]
            calls[d.index][1] += d.arguments  # type: ignore[attr-defined]
    assert sorted(calls) == list(range(len(calls)))
    return content.strip() or None, [(n, a) for n, a in (calls[i] for i in sorted(calls))], deltas


@pytest.mark.parametrize(("text", "_"), HERMES, ids=[f"h{i}" for i in range(len(HERMES))])
def test_streamed_deltas_reassemble_to_the_parsed_message(text: str, _: object) -> None:
    want = summary(parse_hermes(text))
    rng = random.Random(len(text))
    cuttings = [[], list(range(1, len(text)))]  # whole, and character by character
    cuttings += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
                 for _ in range(20)]
    for cuts in cuttings:
        content, calls, deltas = stream(text, cuts)
        assert (content, [(n, json.loads(a)) for n, a in calls]) == want, (cuts, deltas)


def test_arguments_stream_as_they_are_generated() -> None:
    """The arguments of a long call arrive in several fragments, not all at the closing tag."""
    text = f"<tool_call>{NESTED}</tool_call>"
    _, calls, deltas = stream(text, list(range(1, len(text))))
    fragments = [d for d in deltas if d.arguments is not None]  # type: ignore[attr-defined]
    assert len(fragments) > 10
    assert json.loads(calls[0][1]) == json.loads(NESTED)["arguments"]
