"""A real `rapidserve serve` process (embedded SmolLM2, CPU, both workers) on a free port."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Srv:
    proc: subprocess.Popen[str]
    url: str


def start(*args: str, env: dict[str, str] | None = None, log: str | None = None) -> Srv:
    """`rapidserve serve` with `args` on a free port; `env`: extra environment; `log`: a file for its stderr."""
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    full.pop("RAPIDSERVE_API_KEY", None)
    full.pop("RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN", None)
    full.update(env or {})
    err = open(log, "w") if log else subprocess.DEVNULL  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen([sys.executable, "-m", "rapidserve.cli", "serve", "--device", "cpu", "--port", "0",
                             "--max-model-len", "1024", *args],
                            stdout=subprocess.PIPE, stderr=err, text=True, env=full)
    if log:
        err.close()
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"server exited with {proc.wait()}")
        m = re.search(r"serving .* on (http://\S+)", line)
        if m:
            return Srv(proc, m.group(1))
    proc.kill()
    raise AssertionError("server did not start")


def stop(s: Srv) -> int:
    s.proc.send_signal(signal.SIGTERM)
    return s.proc.wait(60)


@pytest.fixture(scope="module")
def srv(smol_server: Srv) -> Srv:
    """The session's default-flag server (tests/conftest.py: stopped with SIGTERM at the end, it must exit 0)."""
    return smol_server


def http(url: str, method: str = "GET", body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def metric(url: str, name: str) -> float:
    _, _, body = http(url + "/metrics")
    for line in body.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def client(s: Srv):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_health_models(srv: Srv) -> None:
    assert http(srv.url + "/health")[0] == 200
    models = json.loads(http(srv.url + "/v1/models")[2])
    assert models["data"][0]["id"] == "SmolLM2-135M-Instruct"


def test_openai_client_chat_answers_paris(srv: Srv) -> None:
    r = client(srv).chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=32,
                                            messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.prompt_tokens > 5 and r.usage.completion_tokens > 0


def test_openai_client_completions_and_streaming_with_usage(srv: Srv) -> None:
    c = client(srv)
    full = c.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=12,
                                temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length") and full.usage.completion_tokens <= 12
    chunks = list(c.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                       max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    chat = list(c.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=16,
                                          messages=[{"role": "user", "content": "Say hi"}], stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chat if ch.choices)


def test_stop_strings_are_left_out(srv: Srv) -> None:
    r = client(srv).completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is",
                                       max_tokens=30, temperature=0, stop=["Paris"])
    assert "Paris" not in r.choices[0].text and r.choices[0].finish_reason == "stop"


def test_native_generate(srv: Srv) -> None:
    status, _, body = http(srv.url + "/generate", "POST",
                           json.dumps({"prompt": "Hello", "max_tokens": 5, "temperature": 0}).encode(),
                           {"Content-Type": "application/json"})
    assert status == 200 and isinstance(json.loads(body)["text"], str)


def test_32_concurrent_streams_equal_non_streaming(srv: Srv) -> None:
    import openai

    async def main() -> None:
        c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]

        async def streamed(p: str) -> str:
            s = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=16, temperature=0,
                                           stream=True)
            return "".join([ch.choices[0].text async for ch in s if ch.choices])

        async def whole(p: str) -> str:
            r = await c.completions.create(model="SmolLM2-135M-Instruct", prompt=p, max_tokens=16, temperature=0)
            return r.choices[0].text

        try:
            got = await asyncio.gather(*(streamed(p) for p in prompts))
            want = await asyncio.gather(*(whole(p) for p in prompts))
        finally:
            await c.close()  # on this loop: left to the garbage collector, it logs errors in a later test
        assert got == want

    asyncio.run(main())


def test_disconnect_mid_stream_frees_kv_blocks(srv: Srv) -> None:
    import http.client

    host, port = srv.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": "Tell me a long story.", "max_tokens": 800,
                       "temperature": 0, "ignore_eos": True, "stream": True})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    for _ in range(5):
        resp.readline()
    deadline = time.monotonic() + 20
    while metric(srv.url, "vllm:kv_cache_usage_perc") == 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert metric(srv.url, "vllm:kv_cache_usage_perc") > 0  # the request holds blocks
    conn.close()  # the client goes away
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (metric(srv.url, "vllm:kv_cache_usage_perc") > 0
                                           or metric(srv.url, "vllm:num_requests_running") > 0):
        time.sleep(0.1)
    assert metric(srv.url, "vllm:kv_cache_usage_perc") == 0
    assert metric(srv.url, "vllm:num_requests_running") == 0


LONG = "word " * 1100
BAD = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", json.dumps({"prompt": 5}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": "many"}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "temperature": -1}).encode(), 400, "temperature"),
    ("/v1/completions", json.dumps({"prompt": "hi", "top_p": 0}).encode(), 400, "top_p"),
    ("/v1/completions", json.dumps({"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}).encode(), 400, "stop"),
    ("/v1/completions", json.dumps({"prompt": ""}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": LONG}).encode(), 400, "prompt"),
    ("/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 5000}).encode(), 400, "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "hi", "model": "gpt-9"}).encode(), 404, "model"),
    ("/v1/chat/completions", json.dumps({"messages": []}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400, "messages"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}], "n": 0}).encode(), 400, "n"),
    ("/generate", json.dumps({"max_tokens": 3}).encode(), 400, "prompt"),
]


@pytest.mark.parametrize("path,body,status,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_input_gets_openai_error(srv: Srv, path: str, body: bytes, status: int, param: str | None) -> None:
    code, _, raw = http(srv.url + path, "POST", body, {"Content-Type": "application/json"})
    assert code == status, raw
    err = json.loads(raw)["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_protocol_errors(srv: Srv) -> None:
    assert http(srv.url + "/v1/completions")[0] == 405  # wrong method
    code, _, raw = http(srv.url + "/v1/nothing-here")
    assert code == 404 and "error" in json.loads(raw)
    code, _, raw = http(srv.url + "/v1/completions", "POST", b"{" + b" " * (9 * 1024 * 1024) + b"}",
                        {"Content-Type": "application/json"})
    assert code == 413 and "error" in json.loads(raw)
    assert http(srv.url + "/health")[0] == 200  # nothing disturbed


def _running(url: str, headers: dict[str, str]) -> float:
    """The vllm:num_requests_running gauge (read with `headers`: the API key)."""
    _, _, raw = http(url + "/metrics", headers=headers)
    line = next(ln for ln in raw.decode().splitlines() if ln.startswith("vllm:num_requests_running{"))
    return float(line.rsplit(" ", 1)[1])


def test_api_key_and_overload() -> None:
    s = start("--max-num-seqs", "1", "--max-waiting", "0", env={"RAPIDSERVE_API_KEY": "sekrit"})
    try:
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
        hdr = {"Content-Type": "application/json"}
        assert http(s.url + "/v1/completions", "POST", body, hdr)[0] == 401
        assert http(s.url + "/v1/completions", "POST", body, {**hdr, "Authorization": "Bearer nope"})[0] == 401
        ok = {**hdr, "Authorization": "Bearer sekrit"}
        assert http(s.url + "/v1/completions", "POST", body, ok)[0] == 200
        assert http(s.url + "/health")[0] == 200  # health needs no key
        assert http(s.url + "/metrics")[0] == 401  # metrics do (unless --metrics-public)
        assert http(s.url + "/metrics", headers={"Authorization": "Bearer sekrit"})[0] == 200

        from http.client import HTTPConnection
        from urllib.parse import urlsplit

        long_body = json.dumps({"prompt": "hi", "max_tokens": 300, "ignore_eos": True}).encode()
        conn = HTTPConnection(urlsplit(s.url).netloc, timeout=120)
        try:  # the one slot taken by a long request, until this client goes away (not for its 300 tokens)
            conn.request("POST", "/v1/completions", long_body, ok)
            deadline = time.monotonic() + 60
            while _running(s.url, ok) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            code, headers, raw = http(s.url + "/v1/completions", "POST", body, ok)
            assert code == 503 and "Retry-After" in headers and json.loads(raw)["error"]["message"]
        finally:
            conn.close()
    finally:
        assert stop(s) == 0
