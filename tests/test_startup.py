"""Start-up as operators expect (issue 38): the port is bound first and answers 503 "starting" (/health, /ping)
and an OpenAI-style 503 (API routes) while the config is built and the engine starts (a slow build and a slow
engine start are simulated with a stand-in engine), then the server proper serves on the same port; a busy
port fails at once with one line and exit 1, before anything is loaded."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any
from unittest import mock

import aiohttp
import pytest

from rapidserve.config_base import ConfigError
from rapidserve.loader.source import ModelSource
from rapidserve.server.serve import serve
from rapidserve.server.startup import BindError, bind_sockets, process_age_s
from rapidserve.server_config import ServerConfig
from tests.server_fakes import ECFG, MODEL, FakeEngine

SOURCE = ModelSource(config=MODEL, weights=lambda: iter(()), num_tensors=0, tokenizer_dir=None, tokenizer_file=None,
                     chat_template=None, description="a stand-in model")


class StartedEngine(FakeEngine):
    """FakeEngine with what `serve` reads once the engine has started: its start-up events and shutdown."""

    events: list[str] = ["workers ready: (stand-in)"]

    async def shutdown(self) -> None:
        self.state = "down"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    names = ("rapidserve", "rapidserve.requests", "aiohttp.access", "aiohttp.server", "aiohttp.web",
             "aiohttp.internal")
    levels = {n: logging.getLogger(n).level for n in names}
    yield
    for n, level in levels.items():
        logging.getLogger(n).setLevel(level)


async def get(http: aiohttp.ClientSession, url: str, method: str = "GET", body: Any = None) -> tuple[int, Any, Any]:
    async with http.request(method, url, json=body) as r:
        return r.status, await r.json(content_type=None), r.headers


async def until(http: aiohttp.ClientSession, url: str, ok: Any, timeout: float = 30.0) -> Any:
    """GET `url` until `ok(status, body)`; the last answer."""
    deadline = time.monotonic() + timeout
    while True:
        status, body, _ = await get(http, url)
        if ok(status, body) or time.monotonic() > deadline:
            return status, body
        await asyncio.sleep(0.02)


def test_port_answers_503_starting_until_the_engine_is_ready(capsys: pytest.CaptureFixture[str]) -> None:
    building, engine_go = threading.Event(), None
    engine = StartedEngine()

    def build() -> tuple[Any, Any]:
        assert building.wait(30), "the test never let the build finish"
        return ECFG, SOURCE

    async def start(ecfg: Any) -> StartedEngine:
        assert engine_go is not None
        await engine_go.wait()
        return engine

    async def scenario() -> int:
        nonlocal engine_go
        engine_go = asyncio.Event()
        sockets = bind_sockets("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        scfg = ServerConfig(port=0, served_model_name=("fake", "alias"))
        task = asyncio.create_task(serve(scfg, build, sockets, "preset:fake", time.monotonic() - 100.0, start))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
            # the config is being built (on a thread): the loop answers meanwhile
            status, body = await until(http, url + "/health", lambda s, b: s == 503)
            assert status == 503 and body["status"] == "starting"
            assert "reading the model's configuration" in body["reason"]
            building.set()
            status, body = await until(http, url + "/health", lambda s, b: "starting the engine" in b["reason"])
            assert status == 503 and body["status"] == "starting", body
            for path, method in (("/v1/completions", "POST"), ("/v1/models", "GET"), ("/metrics", "GET"),
                                 ("/tokenize", "POST")):
                status, err, headers = await get(http, url + path, method, {"prompt": [1, 2], "max_tokens": 2})
                assert status == 503 and err["error"]["code"] == "server_starting", (path, err)
                assert err["error"]["type"] == "server_error" and headers["Retry-After"] == "5"
            assert (await get(http, url + "/ping"))[0] == 503
            assert (await get(http, url + "/version"))[:2] == (200, {"version": "0.1.0"})
            assert not task.done()
            engine_go.set()
            status, body = await until(http, url + "/health", lambda s, b: s == 200)
            assert (status, body) == (200, {"status": "ok"})
            status, out, _ = await get(http, url + "/v1/completions", "POST",
                                       {"model": "alias", "prompt": [1, 2, 3], "max_tokens": 2})
            assert status == 200 and out["model"] == "fake" and len(out["choices"][0]["token_ids"]) == 2, out
            models = (await get(http, url + "/v1/models"))[1]
            assert [m["id"] for m in models["data"]] == ["fake", "alias"]
            assert (await get(http, url + "/ping"))[:2] == (200, {"status": "ok"})
        engine.fatal.set()  # the engine gives up: the server ends, exit code 1
        return await asyncio.wait_for(task, 30)

    assert asyncio.run(scenario()) == 1
    out = capsys.readouterr().out
    assert "rapidserve: serving fake on http://127.0.0.1:" in out
    ready = float(out.split("(ready in ")[1].split(" s)")[0])
    assert ready >= 100.0  # counted from the given process start, not from when serving began


def test_no_connection_is_lost_when_the_server_takes_the_port_over() -> None:
    """Clients polling through the hand-over from the gate to the server proper: every request is answered, 503
    before, 200 after (none reset, none left hanging: the gate stops accepting before the server starts)."""
    engine = StartedEngine()

    async def scenario() -> dict[Any, int]:
        go = asyncio.Event()

        async def start(ecfg: Any) -> StartedEngine:
            await go.wait()
            return engine

        sockets = bind_sockets("127.0.0.1", 0)
        url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}/health"
        task = asyncio.create_task(serve(ServerConfig(port=0), lambda: (ECFG, SOURCE), sockets, None, None, start))
        seen: dict[Any, int] = {}
        done = asyncio.Event()

        async def client() -> None:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as http:
                while not done.is_set():
                    try:
                        async with http.get(url) as r:
                            await r.read()
                            key: Any = r.status
                    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                        key = repr(e)
                    seen[key] = seen.get(key, 0) + 1
                    if seen.get(503, 0) >= 40:
                        go.set()
                    if seen.get(200, 0) >= 200:
                        done.set()

        await asyncio.wait_for(asyncio.gather(*(client() for _ in range(8))), 120)
        engine.fatal.set()
        await asyncio.wait_for(task, 30)
        return seen

    seen = asyncio.run(scenario())
    assert set(seen) == {200, 503} and seen[503] >= 40 and seen[200] >= 200, seen


def test_a_failed_build_ends_start_up_and_frees_the_port() -> None:
    def build() -> tuple[Any, Any]:
        raise ConfigError("--max-model-len 9999 is more than the model's max_position_embeddings")

    async def scenario() -> None:
        sockets = bind_sockets("127.0.0.1", 0)
        port = sockets[0].getsockname()[1]
        with pytest.raises(ConfigError, match="max-model-len"):
            await serve(ServerConfig(port=0), build, sockets)
        for s in sockets:
            s.close()
        bind_sockets("127.0.0.1", port)[0].close()  # nothing listens there any more

    asyncio.run(scenario())


@pytest.fixture
def busy_port() -> Iterator[int]:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


def test_busy_port_fails_before_anything_loads(busy_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    from rapidserve.cli import main

    with mock.patch("rapidserve.config_builder.build_engine_config", side_effect=AssertionError("loaded a model")):
        assert main(["serve", "preset:tiny-llama", "--device", "cpu", "--port", str(busy_port)]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"rapidserve: error: cannot listen on 127.0.0.1:{busy_port}")
    assert "another process listens there" in lines[0]


def test_busy_port_in_a_real_process_one_line_exit_1(busy_port: int) -> None:
    r = subprocess.run([sys.executable, "-m", "rapidserve.cli", "serve", "preset:tiny-llama", "--device", "cpu",
                        "--port", str(busy_port)], capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and len(lines) == 1 and "cannot listen" in lines[0] and "Traceback" not in r.stderr, r
    assert r.stdout == ""


@pytest.mark.parametrize("host,needle", [("no-such-host.invalid", "--host no-such-host.invalid"),
                                         ("192.0.2.1", "no interface of this machine has that address")])
def test_unbindable_host_is_a_bind_error(host: str, needle: str) -> None:
    with pytest.raises(BindError, match=needle):
        bind_sockets(host, 0)


def test_port_0_binds_one_free_port_for_every_address() -> None:
    socks = bind_sockets("localhost", 0)
    try:
        assert len({s.getsockname()[1] for s in socks}) == 1 and socks[0].getsockname()[1] > 0
    finally:
        for s in socks:
            s.close()


def test_process_age_counts_from_the_process_start() -> None:
    a = process_age_s()
    b = process_age_s()
    if sys.platform.startswith("linux"):
        assert 0 < a <= b < 7 * 24 * 3600  # this test process has run for a while, not for days
    else:
        assert a == b == 0.0


def test_health_json_while_starting_names_the_step() -> None:
    from rapidserve.server.startup import StartupGate

    async def scenario() -> tuple[int, dict[str, Any]]:
        from aiohttp.test_utils import TestClient, TestServer

        gate = StartupGate()
        gate.set_step("capturing graphs")
        async with TestClient(TestServer(gate.app())) as client:
            r = await client.get("/health")
            return r.status, json.loads(await r.text())

    assert asyncio.run(scenario()) == (503, {"status": "starting",
                                             "reason": "the server is starting: capturing graphs"})


@pytest.mark.parametrize("log_requests", [True, False])
def test_disable_log_requests_silences_the_request_line(log_requests: bool, caplog: pytest.LogCaptureFixture) -> None:
    from rapidserve.server.startup import REQUEST_LOG, configure_logging
    from tests.server_fakes import running_server

    configure_logging("info", "info", log_requests)
    caplog.set_level(logging.INFO, logger="rapidserve.server")

    async def scenario() -> None:
        async with running_server(FakeEngine()) as (_, url), aiohttp.ClientSession() as http:
            r = await http.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert r.status == 200
            r.release()

    asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.name == REQUEST_LOG]
    assert (len(lines) == 1 and lines[0].startswith("request cmpl-")) if log_requests else lines == []


def test_readiness_line_comes_after_the_signal_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A supervisor that sends SIGTERM as soon as it reads the readiness line gets the graceful stop, not the
    default handler's exit 143: when the line is printed, SIGTERM and SIGINT are the server's own."""
    import signal

    from rapidserve.server import serve as serve_mod

    engine = StartedEngine()
    seen: list[tuple[Any, Any]] = []

    def spy_print(*args: Any, **kwargs: Any) -> None:
        if args and str(args[0]).startswith("rapidserve: serving"):
            seen.append((signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)))
            engine.fatal.set()  # ready: now end the server (the engine gives up)

    monkeypatch.setattr(serve_mod, "print", spy_print, raising=False)

    async def start(ecfg: Any) -> StartedEngine:
        return engine

    async def scenario() -> int:
        sockets = bind_sockets("127.0.0.1", 0)
        scfg = ServerConfig(port=0, served_model_name=("fake",))
        return await asyncio.wait_for(serve(scfg, lambda: (ECFG, SOURCE), sockets, "preset:fake", time.monotonic(),
                                            start), 30)

    default_term, default_int = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert asyncio.run(scenario()) == 1
    assert len(seen) == 1
    term, intr = seen[0]
    assert term is not default_term and intr is not default_int, seen  # asyncio's handlers, not the defaults
