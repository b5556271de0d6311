"""Security defaults: loopback bind, the API key (flag, file, environment; constant-time check; every
route but /health, /ping, /version and /openapi.json, /metrics unless --metrics-public), and the warning when the
server listens beyond loopback without a key."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from rapidserve.cli import build_parser
from rapidserve.cli_serve import API_KEY_ENV, api_key
from rapidserve.config_base import ConfigError
from rapidserve.server import middleware
from rapidserve.server.redact import Redactor, install
from rapidserve.server.serve import is_loopback, warn_if_exposed
from rapidserve.server_config import ServerConfig
from tests.server_fakes import FakeEngine, running_server


def serve_args(*argv: str):  # type: ignore[no-untyped-def]
    return build_parser().parse_args(["serve", *argv])


def test_binds_loopback_by_default() -> None:
    assert serve_args().host == "127.0.0.1"
    assert ServerConfig().host == "127.0.0.1"


def test_api_key_from_flag_file_or_environment(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("from-file\nignored second line\n")
    env = {API_KEY_ENV: " from-env \n"}
    assert api_key(serve_args("--api-key", "from-flag"), env) == "from-flag"
    assert api_key(serve_args("--api-key-file", str(key_file)), env) == "from-file"
    assert api_key(serve_args(), env) == "from-env"
    assert api_key(serve_args(), {}) is None
    assert api_key(serve_args(), {API_KEY_ENV: ""}) is None  # an empty variable (optional Secret): no key


@pytest.mark.parametrize("content", [None, "", "\n  \n"])
def test_missing_or_empty_key_file_is_a_clear_error(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match="--api-key-file") as e:
        api_key(serve_args("--api-key-file", str(path)), {})
    assert str(path) in str(e.value)


def test_unreadable_key_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        api_key(serve_args("--api-key-file", str(tmp_path)), {})  # a folder


def test_key_flag_and_key_file_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serve_args("--api-key", "a", "--api-key-file", "b")
    assert e.value.code == 2 and "--api-key-file" in capsys.readouterr().err


def test_cli_refuses_a_missing_key_file_with_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-key"
    r = subprocess.run([sys.executable, "-m", "rapidserve.cli", "serve", "--device", "cpu", "--api-key-file",
                        str(missing)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and str(missing) in r.stderr and "--api-key-file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.0.0.2", True), ("::1", True),
                                           ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("10.1.2.3", False), ("my-host.example", False)])
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_warns_when_listening_beyond_loopback_without_a_key(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="rapidserve.server"):
        assert warn_if_exposed(ServerConfig(host="0.0.0.0"))
    assert any(r.levelno == logging.WARNING and "NO API KEY" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert not warn_if_exposed(ServerConfig(host="0.0.0.0", api_key="k"))
    assert not warn_if_exposed(ServerConfig(host="127.0.0.1"))
    assert not caplog.records


ROUTES = [("GET", "/health"), ("GET", "/openapi.json"), ("GET", "/metrics"), ("GET", "/v1/models"),
          ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/generate"),
          ("GET", "/version"), ("GET", "/ping"), ("POST", "/tokenize"), ("POST", "/detokenize")]


async def statuses(metrics_public: bool, headers: dict[str, str]) -> dict[str, int]:
    async with running_server(FakeEngine(), api_key="s3cret", metrics_public=metrics_public) as (_, url), \
            aiohttp.ClientSession(headers=headers) as s:
        out = {}
        for method, path in ROUTES:
            body = None if method != "POST" else {"tokens": [1]} if path == "/detokenize" else {"prompt": [1, 2],
                                                                                                "max_tokens": 2}
            async with s.request(method, url + path, json=body) as r:
                out[path] = r.status
                if r.status == 401:
                    err = (await r.json())["error"]
                    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
        return out


def test_key_is_required_everywhere_but_health_and_openapi() -> None:
    public = {"/health", "/openapi.json", "/version", "/ping"}  # the last two public in vLLM too
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"},
                    {"Authorization": "Bearer s3cret-and-more"}):
        got = asyncio.run(statuses(False, headers))
        assert {p for p, code in got.items() if code != 401} == public, (headers, got)
    got = asyncio.run(statuses(True, {}))
    assert {p for p, code in got.items() if code != 401} == public | {"/metrics"}
    got = asyncio.run(statuses(False, {"Authorization": "Bearer s3cret"}))
    assert all(code != 401 for code in got.values()), got
    assert got["/v1/completions"] == got["/v1/models"] == got["/metrics"] == 200  # (chat: 400, no tokenizer)


def test_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    real = middleware.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    got = asyncio.run(statuses(False, {"Authorization": "Bearer nope"}))
    assert got["/v1/models"] == 401 and (b"nope", b"s3cret") in calls


async def raw_request(url: str, head: bytes) -> tuple[int, bytes]:
    """Send `head` (a whole request, no body) over a plain socket with Connection: close; (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


def models_request(authorization: bytes | None) -> bytes:
    auth = b"Authorization: " + authorization + b"\r\n" if authorization is not None else b""
    return b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" + auth + b"\r\n"


@pytest.mark.parametrize("authorization", [
    b"Bearer \xff", b"Bearer s3cret\xff", b"\xff\xfe s3cret", b"Bearer \xc3\xa9t\xc3\xa9",  # non-UTF-8, non-ASCII
    b"Bearer", b"Bearer ", b"", b"Basic s3cret", b"s3cret", b"Bearer\ts3cret", None,  # wrong scheme, empty, missing
])
def test_malformed_credentials_get_401_with_an_openai_error(authorization: bytes | None,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> tuple[int, bytes]:
        async with running_server(FakeEngine(), api_key="s3cret") as (_, url):
            return await raw_request(url, models_request(authorization))

    gc.collect()  # an earlier test's leaked client task is reported (ERROR, asyncio) when collected: not here
    with caplog.at_level(logging.DEBUG):
        status, body = asyncio.run(main())
    assert status == 401, body
    err = json.loads(body)["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key" and err["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.parametrize("authorization", [b"Bearer s3cret", b"bearer s3cret", b"Bearer  s3cret "])
def test_the_right_key_over_a_raw_socket_is_accepted(authorization: bytes) -> None:
    async def main() -> tuple[int, bytes]:
        async with running_server(FakeEngine(), api_key="s3cret") as (_, url):
            return await raw_request(url, models_request(authorization))

    status, body = asyncio.run(main())
    assert status == 200 and json.loads(body)["data"][0]["id"] == "fake"


LEAKY_KEY = "sk-Leak-0123456789abcdef"


class Capture(logging.Handler):
    """Every record at every level, formatted the way a handler would write it (traceback included)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record) + "".join(f" {k}={v!r}" for k, v in vars(record).items()
                                                         if k not in ("msg", "message", "exc_text")))


def malformed_heads(key: str) -> dict[str, bytes]:
    auth = b"Authorization: Bearer " + key.encode()
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    return {"nul": head + auth + b"\x00\r\n\r\n", "del": head + auth + b"\x7f\r\n\r\n",
            "bare-cr": head + auth + b"\rX-Next: y\r\n\r\n", "cr-before": head + b"X-A: \r" + auth + b"\r\n\r\n",
            "long-other": head + auth + b"\r\nX-Pad: " + b"a" * 9000 + b"\r\n\r\n",
            "long-auth": head + auth + b"a" * 9000 + b"\r\n\r\n",
            "long-auth-no-scheme": head + b"Authorization: " + key.encode() * 400 + b"\r\n\r\n",
            "nul-no-scheme": head + b"Authorization: " + key.encode() + b"\x00\r\n\r\n",
            "in-request-line": b"GET /v1/models?k=" + key.encode() + b"\x00 HTTP/1.1\r\nHost: x\r\n\r\n",
            "non-utf8": head + auth + b"\xff\r\n\r\n", "right-key": head + auth + b"\r\nConnection: close\r\n\r\n"}


async def send_raw(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        return await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)  # the status line and headers
    finally:
        writer.close()


def test_the_key_never_reaches_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    """Malformed request heads (aiohttp quotes the raw line in its parser errors) and a bug whose
    exception carries the key: at every level, neither the key nor a piece of it is in any record,
    whether caught by caplog (on the root before the server starts) or by a handler added while it runs."""
    late = Capture()
    answers: dict[str, bytes] = {}

    async def main() -> None:
        engine = FakeEngine()
        async with running_server(engine, api_key=LEAKY_KEY) as (server, url):
            logging.getLogger().addHandler(late)
            try:
                for name, data in malformed_heads(LEAKY_KEY).items():
                    answers[name] = await send_raw(url, data)
                # every logger the server has, at every level, with the key as an argument, in a traceback
                # and in an `extra` field, and one made after the server started
                err = RuntimeError(f"header Authorization: Bearer {LEAKY_KEY}")
                for name in ("rapidserve.server", "aiohttp.server", "aiohttp.access", "aiohttp.web", "asyncio",
                             f"made.after.start.{id(server)}"):
                    for level in (logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR):
                        logging.getLogger(name).log(level, "value %s", LEAKY_KEY, exc_info=err,
                                                    extra={"request_header": {"Authorization": LEAKY_KEY}})
            finally:
                logging.getLogger().removeHandler(late)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
    for name, answer in answers.items():
        want = b" 200 " if name == "right-key" else b" 401 " if name == "non-utf8" else b" 400 "
        assert want in answer.partition(b"\r\n")[0], (name, answer)
    assert len(late.lines) >= 6 * 4 and len(caplog.records) >= 6 * 4
    texts = late.lines + [caplog.text] + [f"{r.getMessage()} {vars(r)!r}" for r in caplog.records]
    for fragment in (LEAKY_KEY, LEAKY_KEY[:8], LEAKY_KEY[-8:]):
        leaks = [t for t in texts if fragment in t]
        assert not leaks, leaks[:2]
    assert "<redacted>" in caplog.text and "RuntimeError" in caplog.text  # the traceback is kept, redacted
    # malformed heads are the client's error: not logged at ERROR by aiohttp, one DEBUG line each
    assert not [r for r in caplog.records if r.name == "aiohttp.server" and r.levelno >= logging.ERROR
                and "value" not in r.getMessage()]
    assert sum("malformed request" in r.getMessage() for r in caplog.records) == 9


def test_malformed_heads_get_a_json_400_that_does_not_echo_them() -> None:
    async def main() -> list[tuple[int, bytes]]:
        async with running_server(FakeEngine(), api_key=LEAKY_KEY) as (_, url):
            heads = malformed_heads(LEAKY_KEY)
            return [await raw_request(url, heads[name]) for name in ("nul", "bare-cr", "long-auth")]

    for status, body in asyncio.run(main()):
        err = json.loads(body)["error"]
        assert status == 400 and err["code"] == "bad_http_request" and err["message"].startswith("malformed")
        assert LEAKY_KEY[:8].encode() not in body


@pytest.mark.parametrize(("text", "want"), [
    ("plain sk-Leak-0123456789abcdef here", "plain <redacted> here"),
    ("b'Authorization: Bearer anything\\x00'", "b'Authorization: <redacted>'"),
    ("authorization=whatever, next", "authorization=<redacted>"),
    ("{'Authorization': 'some-other-token'}", "{'Authorization': '<redacted>'}"),
    ("token Bearer abc.def-ghi; next", "token Bearer <redacted>; next"),
    ("b'sk-Leak-0123456789...'", "b'<redacted>...'"),  # cut at a length limit: its start
    ("...3456789abcdef'", "...<redacted>'"),  # its end
    ("json \"sk-Leak-0123456789abcdef\"", "json \"<redacted>\""),
    ("sk-Leak alone (7 characters) is too short a piece", "sk-Leak alone (7 characters) is too short a piece"),
    ("nothing secret: 200 OK", "nothing secret: 200 OK"),
])
def test_redact(text: str, want: str) -> None:
    assert Redactor([LEAKY_KEY]).redact(text) == want


def test_redactor_install_is_undone() -> None:
    factory, root = logging.getLogRecordFactory(), logging.getLogger()
    r = Redactor([LEAKY_KEY])
    undo = install(r)
    assert logging.getLogRecordFactory() is not factory and r in root.filters
    assert r in logging.getLogger("aiohttp.server").filters
    record = logging.getLogRecordFactory()("x", logging.INFO, "f", 1, "key %s", (LEAKY_KEY,), None)
    assert record.getMessage() == "key <redacted>"
    undo()
    assert logging.getLogRecordFactory() is factory and r not in root.filters
    assert r not in logging.getLogger("aiohttp.server").filters
