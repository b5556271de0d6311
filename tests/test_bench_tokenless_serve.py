"""Token-id-only serving: `rapidserve serve --model preset:...` (no tokenizer) serves token-id prompts.

Presets have real shapes and random weights but no tokenizer, and `rapidserve bench` measures them
with token-id prompts. Text prompts, chat and stop strings get a 400 that says to send token ids;
completions answer empty text plus `token_ids` (whole and streamed).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from rapidserve.server.detokenizer import IncrementalDetokenizer
from rapidserve.server.errors import APIError
from rapidserve.server.requests import ProtocolContext, parse_request
from tests.test_server import Srv, http, start, stop

VOCAB = 1280  # preset:tiny-llama


@pytest.fixture(scope="module")
def bare() -> Iterator[Srv]:
    s = start("--model", "preset:tiny-llama", "--num-kv-blocks", "64")
    yield s
    assert stop(s) == 0


def post(s: Srv, path: str, body: dict[str, object]) -> tuple[int, bytes]:
    status, _, data = http(s.url + path, "POST", json.dumps(body).encode(), {"Content-Type": "application/json"})
    return status, data


def test_detokenizer_without_tokenizer_gives_no_text() -> None:
    d = IncrementalDetokenizer(None, [5, 6, 7])
    assert d.add(9) == "" and d.add(10) == "" and d.flush() == "" and d.output_ids == [9, 10]


def test_stop_strings_refused_without_tokenizer() -> None:
    ctx = ProtocolContext(None, ("m",), 64, VOCAB, 8)
    with pytest.raises(APIError) as ei:
        parse_request("completion", json.dumps({"prompt": [1, 2], "stop": "x"}).encode(), ctx)
    assert ei.value.status == 400 and ei.value.param == "stop" and "tokenizer" in ei.value.message


def test_token_ids_in_token_ids_out(bare: Srv) -> None:
    prompt = list(range(100, 140))
    status, data = post(bare, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "min_tokens": 6,
                                                  "ignore_eos": True, "temperature": 0})
    assert status == 200, data
    body = json.loads(data)
    choice = body["choices"][0]
    assert choice["text"] == "" and len(choice["token_ids"]) == 6
    assert all(0 <= t < VOCAB for t in choice["token_ids"])
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 6, "total_tokens": 46,
                             "prompt_tokens_details": {"cached_tokens": 0}}  # a first request: nothing cached

    status, data = post(bare, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "ignore_eos": True,
                                                  "temperature": 0, "stream": True,
                                                  "stream_options": {"include_usage": True}})
    assert status == 200
    events = [json.loads(line[6:]) for line in data.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert streamed == choice["token_ids"]  # greedy: the same tokens as the whole answer
    assert events[-1]["usage"]["completion_tokens"] == 6


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": [1, 2, 3], "stop": ["x"]}, "stop"),
])
def test_text_gets_400_saying_send_token_ids(bare: Srv, path: str, body: dict[str, object], param: str) -> None:
    status, data = post(bare, path, body)
    err = json.loads(data)["error"]
    assert status == 400 and err["param"] == param and "no tokenizer" in err["message"]
    assert "token" in err["message"]
