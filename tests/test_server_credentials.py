"""No credential leaves the server: a real `rapidserve serve` on CPU (the tiny preset) started with --api-key and
--hf-token at debug log levels with a step trace, asked every way a credential could come back (401s with a missing,
a wrong and a malformed key, 404/405, /metrics, /version, /health, /openapi.json, heads aiohttp cannot parse): no
answer, no log line, no trace line and nothing printed holds the key, the wrong key or the token. And in process: a
credential sent to the start-up gate (before the server proper runs) and a start-up failure whose message shows the
config tree reach no log record."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from rapidserve.config_base import ConfigError
from rapidserve.server.serve import serve
from rapidserve.server.startup import bind_sockets
from rapidserve.server_config import ServerConfig
from tests.test_server import http, start, stop
from tests.test_server_security import Capture, malformed_heads, send_raw

KEY = "sk-Creds-Server-0123456789abcdef"
WRONG = "sk-Wrong-Guess-fedcba9876543210"
HF = "hf_CredsTokenABCDEFGHIJKLMNOP"
SECRETS = (KEY, WRONG, HF, KEY[:8], KEY[-8:], WRONG[-8:])


def _clean(where: str, text: str) -> None:
    for s in SECRETS:
        assert s not in text, (where, s, text[max(0, text.find(s) - 300):text.find(s) + 100])


def test_a_cpu_server_with_a_key_never_shows_it(tmp_path: Path) -> None:
    log, trace = tmp_path / "server.log", tmp_path / "steps.jsonl"
    s = start("preset:tiny-llama", "--num-kv-blocks", "64", "--api-key", KEY, "--hf-token", HF, "--log-level",
              "debug", "--uvicorn-log-level", "debug", "--step-trace", str(trace), log=str(log))
    answers: dict[str, tuple[int, str]] = {}
    try:
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
        js = {"Content-Type": "application/json"}
        ok = {**js, "Authorization": f"Bearer {KEY}"}
        table: list[tuple[str, str, str, bytes | None, dict[str, str], int]] = [
            ("no key", "POST", "/v1/completions", body, js, 401),
            ("wrong key", "POST", "/v1/completions", body, {**js, "Authorization": f"Bearer {WRONG}"}, 401),
            ("no scheme", "POST", "/v1/completions", body, {**js, "Authorization": WRONG}, 401),
            ("key as a prefix", "POST", "/v1/completions", body, {**js, "Authorization": f"Bearer {KEY}x"}, 401),
            ("basic", "GET", "/v1/models", None, {"Authorization": f"Basic {WRONG}"}, 401),
            ("right key", "POST", "/v1/completions", body, ok, 200),
            ("stream", "POST", "/v1/completions",
             json.dumps({"prompt": [1, 2], "max_tokens": 2, "stream": True}).encode(), ok, 200),
            ("bad body", "POST", "/v1/completions", b"{not json", ok, 400),
            ("no route, key in the query", "GET", f"/v1/nope?api_key={KEY}", None, ok, 404),
            ("wrong method", "GET", "/v1/completions", None, ok, 405),
            ("metrics", "GET", "/metrics", None, ok, 200),
            ("metrics without the key", "GET", "/metrics", None, {"Authorization": f"Bearer {WRONG}"}, 401),
            ("models", "GET", "/v1/models", None, ok, 200),
            ("version", "GET", "/version", None, {"Authorization": f"Bearer {WRONG}"}, 200),
            ("health", "GET", "/health", None, {"Authorization": f"Bearer {WRONG}"}, 200),
            ("openapi", "GET", "/openapi.json", None, {}, 200),
        ]
        for name, method, path, data, headers, want in table:
            code, hdrs, raw = http(s.url + path, method, data, headers)
            assert code == want, (name, code, raw[:300])
            answers[name] = (code, f"{dict(hdrs)!r} {raw.decode('utf-8', 'replace')}")

        async def raw_heads() -> None:
            for name, data in malformed_heads(KEY).items():
                answers["raw " + name] = (0, (await send_raw(s.url, data)).decode("utf-8", "replace"))

        asyncio.run(raw_heads())
    finally:
        assert stop(s) == 0
    assert s.proc.stdout is not None
    printed = s.proc.stdout.read()
    for name, (_, text) in answers.items():
        _clean(f"answer {name}", text)
    _clean("stdout", printed)
    text = log.read_text()
    assert "DEBUG" in text and "401" not in printed  # debug logging was on; nothing printed per request
    _clean("server log", text)
    _clean("step trace", trace.read_text() if trace.exists() else "")


class _Engine:
    events: list[str] = []


def test_the_start_up_gate_and_a_start_up_failure_log_no_key(caplog: pytest.LogCaptureFixture) -> None:
    """While the engine starts (the gate answers 503) a client sends the key in well-formed and malformed heads;
    then the build fails with a message showing the server's config (its repr): no record, at any level, holds the
    key, and the failure's message does not either."""
    building = threading.Event()
    late = Capture()
    answers: list[bytes] = []

    def build() -> tuple[Any, Any]:
        assert building.wait(30), "the test never let the build finish"
        raise ConfigError(f"a bad flag; the server's config was {scfg!r}")

    scfg = ServerConfig(port=0, api_key=KEY)

    async def scenario() -> None:
        sockets = bind_sockets("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        task = asyncio.create_task(serve(scfg, build, sockets, "preset:fake", time.monotonic()))
        logging.getLogger().addHandler(late)
        try:
            deadline = time.monotonic() + 20
            while b" 503 " not in (first := await send_raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")):
                assert time.monotonic() < deadline, first
                await asyncio.sleep(0.05)
            for data in malformed_heads(KEY).values():
                answers.append(await send_raw(url, data))
            for level in (logging.DEBUG, logging.INFO, logging.ERROR):  # what anything logs meanwhile
                logging.getLogger("aiohttp.server").log(level, "head %s", f"Authorization: Bearer {KEY}")
                logging.getLogger("rapidserve.server").log(level, "config %r", scfg)
            building.set()
            with pytest.raises(ConfigError) as e:
                await asyncio.wait_for(task, 30)
            _clean("the failure's message", str(e.value))
            assert "ServerConfig(" in str(e.value)
        finally:
            logging.getLogger().removeHandler(late)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(scenario())
    assert len(answers) == len(malformed_heads(KEY)) and len(late.lines) >= 6
    for answer in answers:
        _clean("gate answer", answer.decode("utf-8", "replace"))
    for line in [*late.lines, caplog.text, *(f"{r.getMessage()} {vars(r)!r}" for r in caplog.records)]:
        _clean("log", line)
