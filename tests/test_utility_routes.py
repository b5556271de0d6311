"""vLLM's utility routes (issue 38): POST /tokenize and /detokenize (vLLM's shapes, the SmolLM2 tokenizer, checked
against the tokenizer itself), GET /version, GET|POST /ping; bad input is a 4xx naming the field; the API key is
required on /tokenize and /detokenize but not on /ping and /version; the routes are in /openapi.json. The
engine is a stand-in (these routes never reach it)."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from rapidserve import __version__
from rapidserve.config import EngineConfig
from rapidserve.server.app import Server
from rapidserve.server.openapi import openapi_document
from rapidserve.server_config import ServerConfig
from rapidserve.tokenizer import Tokenizer
from tests.server_fakes import MODEL, FakeEngine

VOCAB = 49152  # SmolLM2's
ECFG = EngineConfig(model="smol", model_config=dataclasses.replace(MODEL, vocab_size=VOCAB))
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}]
Call = Callable[..., Awaitable[tuple[int, Any]]]


def with_client(tok: Tokenizer | None, check: Callable[[Call], Awaitable[None]], **cfg: Any) -> None:
    """Run `check(call)` against a Server over `tok`; `call(method, path, body=None, headers=None)` -> (status,
    JSON body)."""
    async def main() -> None:
        server = Server(ServerConfig(**cfg), ECFG, FakeEngine(), tok, "smol", aliases=("smol-alias",))  # type: ignore[arg-type]
        async with TestClient(TestServer(server.app())) as client:
            async def call(method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                           data: bytes | None = None) -> tuple[int, Any]:
                r = await client.request(method, path, json=body if data is None else None, data=data,
                                         headers=headers)
                return r.status, await r.json(content_type=None)

            await check(call)

    asyncio.run(main())


def test_tokenize_a_prompt(tok: Tokenizer) -> None:
    text = "The capital of France is"

    async def check(call: Call) -> None:
        status, out = await call("POST", "/tokenize", {"prompt": text})
        assert status == 200
        assert out == {"count": len(tok.encode(text)), "max_model_len": ECFG.max_model_len,
                       "tokens": tok.encode(text), "token_strs": None}
        status, out = await call("POST", "/tokenize", {"model": "smol-alias", "prompt": text,
                                                       "add_special_tokens": False, "return_token_strs": True})
        assert status == 200 and out["tokens"] == tok.encode(text, add_special_tokens=False)
        assert out["token_strs"] == tok.hf.convert_ids_to_tokens(out["tokens"])
        long = "word " * 2000  # longer than the context window: counted (off the event loop), not refused
        status, out = await call("POST", "/tokenize", {"prompt": long})
        assert status == 200 and out["count"] == len(tok.encode(long)) > 0

    with_client(tok, check)


def test_tokenize_a_chat_as_the_chat_route_renders_it(tok: Tokenizer) -> None:
    async def check(call: Call) -> None:
        status, out = await call("POST", "/tokenize", {"messages": MSGS})
        assert status == 200 and out["tokens"] == tok.apply_chat_template(MSGS)
        status, bare = await call("POST", "/tokenize", {"messages": MSGS, "add_generation_prompt": False})
        want = tok.encode(tok.render_chat(MSGS, add_generation_prompt=False), add_special_tokens=False)
        assert status == 200 and bare["tokens"] == want and bare["count"] < out["count"]
        partial = [*MSGS, {"role": "assistant", "content": "The capital is"}]
        status, cont = await call("POST", "/tokenize", {"messages": partial, "add_generation_prompt": False,
                                                        "continue_final_message": True})
        assert status == 200 and tok.decode(cont["tokens"], skip_special_tokens=False).endswith("The capital is")
        tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
        status, _ = await call("POST", "/tokenize", {"messages": MSGS, "tools": [tool]})
        assert status == 200

    with_client(tok, check)


def test_a_cache_aware_routers_round_trip(tok: Tokenizer) -> None:
    """What vllm-router's cache-aware policy (deploy/router/) does with a replica: tokenize a prompt, or a chat as
    /v1/chat/completions renders it, and turn the ids back into the same text."""
    text = "The capital of France is Paris."

    async def check(call: Call) -> None:
        status, plain = await call("POST", "/tokenize", {"model": "smol", "prompt": text, "add_special_tokens": False})
        assert status == 200 and plain["tokens"] == tok.encode(text, add_special_tokens=False)
        back = await call("POST", "/detokenize", {"model": "smol", "tokens": plain["tokens"]})
        assert back == (200, {"prompt": text})
        status, chat = await call("POST", "/tokenize", {"model": "smol", "messages": MSGS,
                                                       "continue_final_message": False})
        assert status == 200 and chat["tokens"] == tok.apply_chat_template(MSGS)
        for body in ({"tokens": [1, 10**9]}, {"tokens": [-1]}):  # far outside the vocabulary, or negative
            status, out = await call("POST", "/detokenize", body)
            assert status == 400 and out["error"]["param"] == "tokens", out

    with_client(tok, check)


MOOD_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if mood %}mood={{ mood }}\n"
                 "{% endif %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_tokenize_takes_the_chat_template_inputs_as_chat_does(tok: Tokenizer) -> None:
    """chat_template_kwargs (a template variable, or add_generation_prompt given there) and documents reach the
    server's template (--chat-template's here) as on /v1/chat/completions, which counts the same prompt tokens."""
    served = copy.copy(tok)
    served.chat_template = MOOD_TEMPLATE  # what serve's --chat-template does to the tokenizer (serving_tokenizer)

    async def check(call: Call) -> None:
        status, plain = await call("POST", "/tokenize", {"messages": MSGS})
        assert status == 200 and "mood=" not in tok.decode(plain["tokens"], skip_special_tokens=False)
        body = {"messages": MSGS, "chat_template_kwargs": {"mood": "calm", "add_generation_prompt": False},
                "documents": [{"title": "t", "text": "x"}]}
        status, out = await call("POST", "/tokenize", body)
        want = served.apply_chat_template(MSGS, template_kwargs={"mood": "calm"}, add_generation_prompt=False)
        assert status == 200 and out["tokens"] == want
        text = tok.decode(out["tokens"], skip_special_tokens=False)
        assert text.endswith("mood=calm\n") and "<assistant>" not in text
        status, chat = await call("POST", "/v1/chat/completions", {**body, "max_tokens": 1})
        assert status == 200 and chat["usage"]["prompt_tokens"] == out["count"]

    with_client(served, check)


def test_tokenize_a_requests_own_chat_template_needs_the_flag(tok: Tokenizer) -> None:
    own = "{{ messages[0].content }}|{{ extra }}"
    body = {"messages": MSGS, "chat_template": own, "chat_template_kwargs": {"extra": "e"}}

    async def trusted(call: Call) -> None:
        status, out = await call("POST", "/tokenize", body)
        assert status == 200 and out["tokens"] == tok.encode("Be brief.|e", add_special_tokens=False)
        status, out = await call("POST", "/tokenize", {"messages": MSGS, "chat_template": "{{ 1 / 0 }}"})
        assert status == 400 and out["error"]["param"] == "chat_template", out
        status, out = await call("POST", "/tokenize", {"messages": MSGS, "chat_template": "{% if %}"})
        assert status == 400 and out["error"]["param"] == "chat_template", out

    async def untrusted(call: Call) -> None:
        status, out = await call("POST", "/tokenize", body)
        assert status == 400 and out["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in out["error"]["message"]

    with_client(tok, trusted, trust_request_chat_template=True)
    with_client(tok, untrusted)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "hi", "messages": MSGS}, 400, "messages"),
    ({}, 400, "prompt"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": "hi", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ({"prompt": "hi", "tools": []}, 400, "tools"),
    ({"prompt": "hi", "continue_final_message": True}, 400, "continue_final_message"),
    ({"prompt": "hi", "add_generation_prompt": False}, 400, "add_generation_prompt"),  # was accepted and ignored
    ({"prompt": "hi", "add_generation_prompt": True}, 400, "add_generation_prompt"),
    ({"messages": MSGS, "chat_template": "{{ x }}"}, 400, "chat_template"),  # no --trust-request-chat-template
    ({"messages": MSGS, "chat_template_kwargs": {"tokenize": True}}, 400, "chat_template_kwargs"),
    ({"messages": MSGS, "chat_template_kwargs": [1]}, 400, "chat_template_kwargs"),
    ({"messages": MSGS, "add_generation_prompt": True, "chat_template_kwargs": {"add_generation_prompt": False}},
     400, "chat_template_kwargs"),
    ({"messages": MSGS, "documents": [{"title": 1}]}, 400, "documents"),
    ({"prompt": "hi", "chat_template_kwargs": {"x": 1}}, 400, "chat_template_kwargs"),
    ({"prompt": "hi", "model": "gpt-4"}, 404, "model"),
])
def test_tokenize_bad_input_names_the_field(tok: Tokenizer, body: dict[str, Any], status: int, param: str) -> None:
    async def check(call: Call) -> None:
        got, out = await call("POST", "/tokenize", body)
        assert got == status and out["error"]["param"] == param, out
        assert out["error"]["message"]

    with_client(tok, check)


def test_detokenize(tok: Tokenizer) -> None:
    ids = tok.apply_chat_template(MSGS)

    async def check(call: Call) -> None:
        status, out = await call("POST", "/detokenize", {"tokens": ids, "model": "smol"})
        assert status == 200 and out == {"prompt": tok.decode(ids, skip_special_tokens=False)}
        assert (await call("POST", "/detokenize", {"tokens": []})) == (200, {"prompt": ""})
        for body, param, needle in (({"tokens": [1, VOCAB]}, "tokens", f"[0, {VOCAB})"),
                                    ({"tokens": [-1]}, "tokens", "tokens"), ({"tokens": "1 2"}, "tokens", "tokens"),
                                    ({}, "tokens", "required"), ({"tokens": [1], "model": "x"}, "model", "x")):
            status, out = await call("POST", "/detokenize", body)
            assert status in (400, 404) and out["error"]["param"] == param and needle in out["error"]["message"], out

    with_client(tok, check)


def test_a_model_without_tokenizer_gets_400_not_a_crash() -> None:
    async def check(call: Call) -> None:
        for path, body, param in (("/tokenize", {"prompt": "hi"}, "prompt"), ("/tokenize", {"messages": MSGS},
                                                                               "messages"),
                                  ("/detokenize", {"tokens": [1]}, "tokens")):
            status, out = await call("POST", path, body)
            assert status == 400 and out["error"]["param"] == param and "no tokenizer" in out["error"]["message"]

    with_client(None, check)


def test_headers_are_checked_as_on_the_generation_routes(tok: Tokenizer) -> None:
    async def check(call: Call) -> None:
        status, out = await call("POST", "/tokenize", data=b'{"prompt": "hi"}', headers={"Content-Type": "text/plain"})
        assert status == 415 and out["error"]["code"] == "unsupported_media_type"
        status, out = await call("POST", "/detokenize", data=b'{"tokens": [' + b"1," * 800 + b"1]}",
                                 headers={"Content-Type": "application/json"})
        assert status == 413, out
        status, out = await call("POST", "/tokenize", data=b"{", headers={"Content-Type": "application/json"})
        assert status == 400 and "JSON" in out["error"]["message"]

    with_client(tok, check, max_body_bytes=1024)


def test_version_ping_and_the_api_key(tok: Tokenizer) -> None:
    key = {"Authorization": "Bearer sesame"}

    async def check(call: Call) -> None:
        assert await call("GET", "/version") == (200, {"version": __version__})
        assert await call("GET", "/ping") == (200, {"status": "ok"})
        assert await call("POST", "/ping") == (200, {"status": "ok"})
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
            status, out = await call("POST", path, body)
            assert status == 401 and out["error"]["code"] == "invalid_api_key"
            assert (await call("POST", path, body, headers=key))[0] == 200

    with_client(tok, check, api_key="sesame")


def test_ping_follows_health() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.state = "restarting"
        engine.dead_reason = "the decode worker died"
        server = Server(ServerConfig(), ECFG, engine, None, "smol")  # type: ignore[arg-type]
        async with TestClient(TestServer(server.app())) as client:
            health = await client.get("/health")
            ping = await client.get("/ping")
            assert ping.status == health.status == 503
            assert await ping.json() == await health.json()

    asyncio.run(main())


def test_openapi_describes_the_routes() -> None:
    doc = openapi_document()
    assert set(doc["paths"]["/ping"]) == {"get", "post"} and set(doc["paths"]["/version"]) == {"get"}
    for path, struct in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(struct)
        assert op["security"] == [{}, {"bearer": []}] and "400" in op["responses"]
    assert doc["paths"]["/version"]["get"]["security"] == [] and doc["paths"]["/ping"]["get"]["security"] == []
    props = doc["components"]["schemas"]["TokenizeRequest"]["properties"]
    assert {"prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"} <= set(props)
    assert doc["components"]["schemas"]["DetokenizeRequest"]["required"] == ["tokens"]
