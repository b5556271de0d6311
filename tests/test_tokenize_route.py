"""vLLM's POST /tokenize and /detokenize (server/tokenize.py), in-process against a stand-in engine with the
embedded model's tokenizer: the shapes a router (vllm-router's cache-aware policy) and vLLM clients read, and
every bad input a 400 naming its field."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from rapidserve.config import ServerConfig
from rapidserve.server.app import Server
from rapidserve.server.serve import make_runner
from rapidserve.tokenizer import Tokenizer
from tests.server_fakes import ECFG as FAKE
from tests.server_fakes import FakeEngine

ECFG = dataclasses.replace(FAKE, model_config=FAKE.model_config.replace(vocab_size=49152))  # SmolLM2's vocabulary


@contextlib.asynccontextmanager
async def serving(tok: Tokenizer) -> AsyncIterator[str]:
    scfg = ServerConfig(port=0)
    server = Server(scfg, ECFG, FakeEngine(), tok, "m")  # type: ignore[arg-type]
    runner = make_runner(server.app(), scfg)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def post(tok: Tokenizer, path: str, body: Any) -> tuple[int, dict[str, Any]]:
    async def main() -> tuple[int, dict[str, Any]]:
        async with serving(tok) as url, aiohttp.ClientSession() as s, s.post(url + path, json=body) as r:
            return r.status, await r.json()

    return asyncio.run(main())


def test_tokenize_a_prompt_and_back(tok: Tokenizer) -> None:
    text = "The capital of France is Paris."
    code, got = post(tok, "/tokenize", {"model": "m", "prompt": text})
    assert code == 200 and got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == ECFG.max_model_len and got["token_strs"] is None
    code, plain = post(tok, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert code == 200 and plain["tokens"] == tok.encode(text, add_special_tokens=False)
    assert "".join(plain["token_strs"]) == text
    code, back = post(tok, "/detokenize", {"model": "m", "tokens": plain["tokens"]})
    assert code == 200 and back == {"prompt": text}


def test_tokenize_chat_messages_as_the_server_renders_them(tok: Tokenizer) -> None:
    """The router's chat probe: the ids of the prompt /v1/chat/completions would compute."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]
    code, got = post(tok, "/tokenize", {"model": "m", "messages": messages, "continue_final_message": False})
    assert code == 200 and got["tokens"] == tok.apply_chat_template(messages)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"model": "other", "prompt": "a"}, "model"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "continue_final_message": True},
     "continue_final_message"),
    ("/tokenize", {"messages": [{"role": "user", "content": "b"}], "add_generation_prompt": False},
     "add_generation_prompt"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/tokenize", {"prompt": "x" * (ECFG.max_model_len * 64 + 1)}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_bad_input_is_a_400_naming_the_field(tok: Tokenizer, path: str, body: Any, param: str) -> None:
    code, got = post(tok, path, body)
    assert code == 400 and got["error"]["param"] == param, got


def test_a_model_without_tokenizer_says_so() -> None:
    async def main() -> tuple[int, dict[str, Any]]:
        scfg = ServerConfig(port=0)
        server = Server(scfg, ECFG, FakeEngine(), None, "m")  # type: ignore[arg-type]
        runner = make_runner(server.app(), scfg)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            async with aiohttp.ClientSession() as s, s.post(f"http://127.0.0.1:{runner.addresses[0][1]}/tokenize",
                                                            json={"prompt": "a"}) as r:
                return r.status, await r.json()
        finally:
            await runner.cleanup()

    code, got = asyncio.run(main())
    assert code == 400 and "no tokenizer" in got["error"]["message"]
