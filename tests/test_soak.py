"""bench/soak.py: its pure parts (Prometheus parser, flatness, capacity, request mix, /proc and /dev/shm
probes, arguments), a short soak of an in-process fake server (counts exact, aborts counted or not),
and one real soak of `rapidserve serve` on CPU that it launches, stops and checks /dev/shm after."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_server import ROOT

BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
import soak_client  # noqa: E402
import soak_lib as sl  # noqa: E402
import soak_proc as sp  # noqa: E402
import soak_report  # noqa: E402


def _load_soak() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_soak", os.path.join(BENCH, "soak.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


soak = _load_soak()


# ---------------------------------------------------------------- Prometheus text


def test_parse_prometheus_matches_prometheus_client() -> None:
    reg = CollectorRegistry()
    c = Counter("vllm:request_success", "x", ["model_name", "finished_reason"], registry=reg)
    c.labels('we"ird\\name', "stop").inc(3)
    c.labels("m", "abort").inc(2)
    Counter("vllm:generation_tokens", "x", ["model_name"], registry=reg).labels("m").inc(41)
    text = generate_latest(reg).decode()
    ours = sl.parse_prometheus(text)
    theirs = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert ours == theirs
    counters = sl.soak_counters(ours)
    assert counters["success_stop"] == 3 and counters["success_abort"] == 2
    assert counters["generation_tokens"] == 41 and counters["engine_restarts"] is None


def test_parse_prometheus_values_timestamps_and_errors() -> None:
    got = sl.parse_prometheus('# HELP a b\n\na_total 1.5 1700000000\nb{x="1",y="a,b"} NaN\nc +Inf\n')
    assert got[("a_total", ())] == 1.5 and got[("c", ())] == float("inf")
    assert got[("b", (("x", "1"), ("y", "a,b")))] != got[("b", (("x", "1"), ("y", "a,b")))]  # NaN
    with pytest.raises(ValueError, match="line 2"):
        sl.parse_prometheus("ok 1\nnot a sample line\n")
    with pytest.raises(ValueError, match="labels"):
        sl.parse_prometheus('x{a=1} 2\n')


def test_counter_delta_and_compare() -> None:
    before = {"success_stop": 1.0, "success_abort": 0.0, "engine_restarts": None}
    after = {"success_stop": 4.0, "success_abort": 2.0, "success_length": 5.0, "engine_restarts": None}
    d = sl.counter_delta(before, after)
    assert d == {"success_stop": 3.0, "success_abort": 2.0, "success_length": 5.0, "engine_restarts": None}
    cmp = sl.compare_counts({"stop": 3, "length": 5, "abort": 1}, d)
    assert cmp["stop"]["ok"] and cmp["length"]["ok"] and not cmp["abort"]["ok"] and cmp["abort"]["diff"] == 1
    assert sl.compare_counts({"error": 0}, d)["error"] == {"client": 0, "server": 0.0, "diff": 0.0, "ok": True}
    none = sl.compare_counts({"stop": 0}, {"generation_tokens": 5.0})["stop"]  # no request_success at all
    assert none == {"client": 0, "server": None, "diff": None, "ok": False}
    # a stream the client closed as the server finished it: the client's abort, the server's length
    raced = sl.compare_counts({"stop": 3, "length": 4, "abort": 3}, d, raced=1)
    assert all(c["ok"] for c in raced.values()) and raced["abort"]["raced"] == 1
    assert not sl.compare_counts({"stop": 3, "length": 4, "abort": 3}, d)["abort"]["ok"]  # none may race
    assert not sl.compare_counts({"stop": 3, "length": 3, "abort": 4}, d, raced=1)["abort"]["ok"]  # two moved
    assert not sl.compare_counts({"stop": 3, "length": 6, "abort": 3}, d, raced=1)["length"]["ok"]  # not balanced


# ---------------------------------------------------------------- flatness, capacity


def test_flatness_short_run_uses_fifths_and_skips_warmup() -> None:
    pts = [(float(t), 500.0 if t < 10 else 100.0) for t in range(0, 101)]  # a warm-up spike, then flat
    f = sl.flatness(pts, 0.0, 100.0, warmup_s=10.0)
    assert f["ok"] is True and f["first_mean"] == 100.0 and "fifth" in f["rule"]
    assert sl.flatness_windows(0.0, 100.0, 10.0)["first"] == (10.0, 28.0)
    growing = [(float(t), 100.0 + t) for t in range(0, 101)]  # a leak: ~+50% over the run
    g = sl.flatness(growing, 0.0, 100.0, warmup_s=10.0)
    assert g["ok"] is False and g["change"] > 0.4


def test_flatness_long_run_uses_five_minute_windows_and_tolerances() -> None:
    pts = [(float(t), 1000.0 + (30.0 if t > 1500 else 0.0)) for t in range(0, 1801, 10)]  # +3% at the end
    f = sl.flatness(pts, 0.0, 1800.0, warmup_s=120.0)
    assert f["rule"].startswith("first/last 300 s") and f["ok"] is True
    assert sl.flatness(pts, 0.0, 1800.0, 120.0, rel_tol=0.02)["ok"] is False
    fds = [(float(t), 10.0 + (2.0 if t > 1500 else 0.0)) for t in range(0, 1801, 10)]  # +20% but only 2 fds
    assert sl.flatness(fds, 0.0, 1800.0, 120.0)["ok"] is False
    assert sl.flatness(fds, 0.0, 1800.0, 120.0, abs_tol=2)["ok"] is True
    assert sl.flatness([], 0.0, 100.0, 10.0)["ok"] is None  # no samples: not computed
    assert sl.flatness([(1.0, 1.0)], 0.0, 100.0, 100.0)["ok"] is None  # nothing after the warm-up
    assert sl.flatness([(50.0, 1.0)], 0.0, 100.0, 10.0)["ok"] is None  # one sample: nothing to compare
    sparse = sl.flatness([(0.0, 9.0), (40.0, 100.0), (70.0, 104.0), (99.0, 103.0)], 0.0, 100.0, 10.0)
    assert sparse["ok"] is True and sparse["first_mean"] == 100.0 and "nearest" in sparse["rule"]


def test_capacity() -> None:
    finishes = [0.5, 1.0, 1.5] + [2.0 + 0.25 * i for i in range(33)]  # slow ramp, then 4/s from t=2 to 10
    assert sl.sustained_rate(finishes, 0.0, 10.0) == pytest.approx(4.0, abs=0.2)
    assert sl.target_rate(5.0, 0.8) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="nothing completed"):
        sl.target_rate(0.0, 0.8)
    with pytest.raises(ValueError):
        sl.target_rate(1.0, 1.5)
    with pytest.raises(ValueError):
        sl.sustained_rate([], 5.0, 5.0)


# ---------------------------------------------------------------- the request mix


def test_request_mix_fits_the_context_and_is_seeded() -> None:
    mix = sl.Mix(max_model_len=300, stream_fraction=0.5, chat_fraction=0.3, stop_fraction=0.2,
                 abort_stream_fraction=0.3, abort_timeout_fraction=0.3)
    specs = [sl.make_request(random.Random(7), mix) for _ in range(2)]
    assert specs[0] == specs[1]
    rng = random.Random(1)
    specs = [sl.make_request(rng, mix) for _ in range(600)]
    for s in specs:
        assert s.prompt_tokens + s.max_tokens <= 300 and s.max_tokens >= 1
        if not s.chat:
            assert all(100 <= t < 5000 for t in s.prompt) and len(s.prompt) == s.prompt_tokens
        if s.abort_after_tokens is not None:
            assert s.stream and s.ignore_eos and 1 <= s.abort_after_tokens <= s.max_tokens // 2
        if s.client_timeout_s is not None:
            assert not s.stream and s.ignore_eos and 0.1 <= s.client_timeout_s <= 0.5
        body = s.payload("m")
        assert ("messages" in body) == s.chat and ("stream_options" in body) == s.stream
    assert {s.bucket for s in specs} == set(sl.BUCKETS)
    assert any(s.chat for s in specs) and any(s.stop for s in specs)
    assert any(s.abort_after_tokens for s in specs) and any(s.client_timeout_s for s in specs)
    plain = sl.Mix(max_model_len=4096, max_prompt_tokens=50, max_output_tokens=20)
    rng = random.Random(2)
    for _ in range(200):
        s = sl.make_request(rng, plain, allow_aborts=False)
        assert not s.chat and not s.stop and s.abort_after_tokens is None and s.client_timeout_s is None
        assert s.prompt_tokens <= 50 and s.max_tokens <= 20


# ---------------------------------------------------------------- /proc and /dev/shm


def test_process_probes() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    lst = socket.socket()
    try:
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        tree = sp.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        st = sp.proc_stats(os.getpid())
        assert st is not None and st["rss_mb"] > 10 and st["fds"] >= st["sockets"] >= 1
        assert st["uss_mb"] is not None and 1 < st["uss_mb"] <= st["rss_mb"]  # private memory: part of RSS
        assert sp.pid_listening_on(lst.getsockname()[1]) == os.getpid()
        assert sp.label_processes(os.getpid(), tree)[os.getpid()] == "server"
    finally:
        lst.close()
        child.kill()
        child.wait()
    assert sp.proc_stats(child.pid) is None


def test_shm_attribution() -> None:
    entries = ["rapidserve-123-abc-r2d", "sem.rapidserve-123-abc-r2d.rd", "rapidserve-1234-x-r2d", "torch_123_9",
               "sem.mp-q1w2e3", "other-12345", "sem.foo"]
    assert sp.attributable(entries, [123]) == ["rapidserve-123-abc-r2d", "sem.rapidserve-123-abc-r2d.rd",
                                               "torch_123_9", "sem.mp-q1w2e3"]
    assert sp.attributable(entries, [123], mp_sems=False)[-1] == "torch_123_9"
    assert sp.attributable(entries, []) == ["sem.mp-q1w2e3"]
    assert sp.shm_summary(entries, [1234]) == {"total": 7, "sem": 3, "sem_mp": 1, "server": 1}


@pytest.mark.skipif(not os.path.isdir(sp.SHM_DIR), reason="needs /dev/shm")
def test_a_semaphore_another_process_holds_was_not_left_behind() -> None:
    """A sem.mp-* that a live process outside the server's pids has mapped is that process's (another test
    beside the soak, under pytest-xdist); one nobody maps is left behind, whoever made it."""
    import posix_ipc

    held = posix_ipc.Semaphore(f"/mp-held-{os.getpid()}", posix_ipc.O_CREX, mode=0o600)  # mapped by this process
    orphan = f"sem.mp-orphan-{os.getpid()}"
    open(os.path.join(sp.SHM_DIR, orphan), "wb").close()  # named like one, mapped by nobody
    try:
        sems = [f"sem.mp-held-{os.getpid()}", orphan]
        assert set(sems) <= set(sp.shm_entries())
        assert sp.held_elsewhere(sems, [os.getpid() + 10**7]) == {sems[0]}  # this process: another program
        assert sp.held_elsewhere(sems, [os.getpid()]) == set()  # this process is among the pids: its own
    finally:
        os.unlink(os.path.join(sp.SHM_DIR, orphan))
        held.unlink()
        held.close()


# ---------------------------------------------------------------- checks and verdict


def _synthetic_report(leak_mb_per_s: float, shared_mb_per_s: float = 0.0) -> dict[str, Any]:
    """A soak report whose worker1 grows its private memory by `leak_mb_per_s` and its RSS by that plus
    `shared_mb_per_s` (pages of a mapping shared with another process)."""
    settings = vars(soak.parse_args(["--rate", "1", "--duration-s", "100"]))

    def sample(t: float, phase: str) -> dict[str, Any]:
        procs = {"10": {"label": "server", "uss_mb": 250.0, "rss_mb": 300.0, "fds": 20, "sockets": 5, "start": 1},
                 "11": {"label": "worker1", "uss_mb": 800.0 + leak_mb_per_s * t,
                        "rss_mb": 1000.0 + (leak_mb_per_s + shared_mb_per_s) * t, "fds": 190, "sockets": 0,
                        "start": 2}}
        metrics = {"success_stop": 3.0, "success_length": 5.0, "success_abort": 2.0, "generation_tokens": 99.0,
                   "engine_restarts": 0.0, "worker_deaths": None}
        return {"t": t, "phase": phase, "health": 200, "metrics": metrics, "procs": procs,
                "shm": {"total": 21, "sem": 15, "sem_mp": 1, "server": 21}, "client": {}}

    samples = [sample(0.0, "idle-before")] + [sample(float(t), "load") for t in range(0, 101, 5)]
    samples.append(sample(105.0, "idle-after"))
    zero = {"success_stop": 0.0, "success_length": 0.0, "success_abort": 0.0, "generation_tokens": 0.0,
            "engine_restarts": 0.0, "worker_deaths": None}
    delta = sl.counter_delta(zero, samples[-1]["metrics"])
    return {"settings": settings, "url": "http://x", "rate_rps": 1.0, "samples": samples,
            "client": {"sent": 10, "failed": 0, "skipped_at_cap": 0, "completion_tokens": 90},
            "counters": {"delta": delta, "compare": sl.compare_counts({"stop": 3, "length": 5, "abort": 2}, delta)},
            "processes": {"seen": [10, 11], "gone": []}}


def test_evaluate_and_verdict() -> None:
    rep = _synthetic_report(0.0)
    rep["checks"] = soak_report.evaluate(rep)
    ok, reasons = soak_report.verdict(rep)
    assert ok and reasons[0].startswith("10 requests over 100 s") and "no worker deaths" in reasons[0]
    assert "| private memory flat: worker1 | pass |" in soak_report.markdown(rep)
    rep = _synthetic_report(2.0)  # worker1's private memory grows 2 MB/s: +~19% between the first and last fifth
    rep["counters"]["compare"]["abort"].update(server=1.0, diff=-1.0, ok=False)
    rep["checks"] = soak_report.evaluate(rep)
    ok, reasons = soak_report.verdict(rep)
    assert not ok and len(reasons) == 2
    assert reasons[0].startswith("request_success{abort} = client: server +1 vs client 2")
    assert reasons[1].startswith("private memory flat: worker1:")


def test_rss_growth_of_shared_pages_is_not_a_leak() -> None:
    """The issue's soak: the prefill worker's RSS grew 19% as it touched the KV pool it shares with the
    decode worker, while its private memory stayed flat. That passes, with the RSS quoted as information."""
    rep = _synthetic_report(0.0, shared_mb_per_s=2.5)
    rep["checks"] = soak_report.evaluate(rep)
    ok, reasons = soak_report.verdict(rep)
    assert ok, reasons
    check = next(c for c in rep["checks"] if c["name"] == "private memory flat: worker1")
    assert check["ok"] is True and "RSS 1" in check["detail"] and "not judged" in check["detail"]
    assert check["data"]["rss"]["change"] > 0.15
    assert not [c for c in rep["checks"] if c["name"].startswith("RSS")]


@pytest.mark.parametrize(("uss", "rss", "ok"), [
    ([(t, 500.0) for t in range(0, 101, 5)], [(t, 1000.0 + 2.5 * t) for t in range(0, 101, 5)], True),
    ([(t, 500.0 + t) for t in range(0, 101, 5)], [(t, 1000.0) for t in range(0, 101, 5)], False),  # +13%
    ([(t, 1.0 + 0.01 * t) for t in range(0, 101, 5)], [(t, 5.0) for t in range(0, 101, 5)], True),  # < 2 MB
    ([], [(t, 1000.0 + 9.0 * t) for t in range(0, 101, 5)], None),  # smaps_rollup unreadable: not judged
])
def test_memory_check_judges_private_memory_only(uss: list[tuple[float, float]], rss: list[tuple[float, float]],
                                                 ok: bool | None) -> None:
    settings = vars(soak.parse_args(["--rate", "1", "--duration-s", "100"]))
    check = soak_report.memory_check("worker2", uss, rss, settings)
    assert check["name"] == "private memory flat: worker2" and check["ok"] is ok, check
    assert "RSS" in check["detail"]


def test_private_memory_from_smaps_rollup() -> None:
    rollup = ("55d0-7ffd ---p 00000000 00:00 0   [rollup]\nRss:  204800 kB\nPss:  120000 kB\n"
              "Shared_Clean:  4000 kB\nShared_Dirty:  100000 kB\nPrivate_Clean:  800 kB\n"
              "Private_Dirty:  99200 kB\nAnonymous:  99000 kB\nShared_Hugetlb:  0 kB\nPrivate_Hugetlb:  1024 kB\n")
    assert sp.private_kb(rollup) == 800 + 99200 + 1024
    smaps = "Private_Clean:  4 kB\nPrivate_Dirty:  8 kB\n" * 3  # per mapping: summed
    assert sp.private_kb(smaps) == 36
    assert sp.private_kb("Rss:  10 kB\n") is None
    assert sp.private_mb(os.getpid()) is not None


# ---------------------------------------------------------------- arguments


BAD_ARGS = [
    ([], "--rate"),
    (["--rate", "1", "--capacity-probe"], "--capacity-probe"),
    (["--rate", "0"], "--rate"),
    (["--rate", "1", "--load-fraction", "0.5"], "--load-fraction"),
    (["--capacity-probe", "--load-fraction", "0"], "--load-fraction"),
    (["--rate", "1", "--check-shm-after-exit"], "--check-shm-after-exit"),
    (["--rate", "1", "--launch", "rapidserve serve", "--url", "http://127.0.0.1:9"], "--launch"),
    (["--rate", "1", "--launch", "rapidserve serve", "--server-pid", "1"], "--launch"),
    (["--rate", "1", "--launch", "  "], "--launch"),
    (["--rate", "1", "--launch", "'unclosed"], "--launch"),
    (["--rate", "1", "--duration-s", "10", "--sample-interval-s", "10"], "--sample-interval-s"),
    (["--rate", "1", "--duration-s", "10", "--warmup-s", "10"], "--warmup-s"),
    (["--rate", "1", "--server-pid", "999999999"], "--server-pid"),
    (["--rate", "1", "--stream-fraction", "1.5"], "--stream-fraction"),
    (["--rate", "1", "--abort-timeout-s", "0.5:0.1"], "--abort-timeout-s"),
    (["--rate", "1", "--url", "localhost:8000"], "--url"),
]


@pytest.mark.parametrize("argv,flag", BAD_ARGS, ids=[f"{i}-{b[1]}" for i, b in enumerate(BAD_ARGS)])
def test_bad_arguments_exit_2_naming_the_flag(argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        soak.parse_args(argv)
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_good_arguments_get_defaults() -> None:
    a = soak.parse_args(["--capacity-probe", "--duration-s", "600"])
    assert a.url == "http://127.0.0.1:8000" and a.load_fraction == 0.8 and a.warmup_s == 60.0
    a = soak.parse_args(["--rate", "2", "--launch", "rapidserve serve --port 0", "--check-shm-after-exit"])
    assert a.rate == 2.0 and a.warmup_s == 120.0 and a.abort_timeout_s == (0.1, 0.5)


# ---------------------------------------------------------------- a fake server in this process


@dataclass
class Fake:
    url: str
    app_state: dict[str, Any]


def _fake_app(state: dict[str, Any]) -> web.Application:
    """An OpenAI-ish server: ~2 ms a token; counts finished requests by reason like rapidserve does
    (an abort when the client goes away, unless state['count_aborts'] is False). Faults for the prompts
    [7] (HTTP 500), [11] (a stream without [DONE]) and [13] (an error event in the stream); the mix's
    token ids are >= 100."""
    reg = CollectorRegistry()
    success = Counter("vllm:request_success", "x", ["model_name", "finished_reason"], registry=reg)
    gen = Counter("vllm:generation_tokens", "x", ["model_name"], registry=reg).labels("fake")

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n, chat = int(body.get("max_tokens", 16)), "messages" in body
        fault = body["prompt"][0] if body.get("prompt") in ([7], [11], [13]) else None
        if fault == 7:
            return web.json_response({"error": {"message": "boom"}}, status=500)
        reason, made = "abort", 0
        resp: web.StreamResponse | None = None
        try:
            if body.get("stream"):
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                if chat:
                    await resp.write(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n')
            for i in range(n):
                await asyncio.sleep(0.002)
                made += 1
                fin = "length" if i == n - 1 else ("stop" if body.get("stop") and i == 2 else None)
                if resp is not None:
                    if fault == 13 and i == 1:
                        await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
                        return resp
                    choice = {"delta": {"content": "x"}} if chat else {"text": "x"}
                    await resp.write(b"data: " + json.dumps({"choices": [{**choice, "finish_reason": fin}]}).encode()
                                     + b"\n\n")
                if fin is not None:
                    reason = fin
                    break
            usage = {"completion_tokens": made}
            if resp is None:
                return web.json_response({"choices": [{"text": "x" * made, "finish_reason": reason}], "usage": usage})
            if fault != 11:
                await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
                await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            if reason != "abort" or state["count_aborts"]:
                success.labels("fake", reason).inc()
            gen.inc(made)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(reg), content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake", "max_model_len": 512}]})

    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


@pytest.fixture
def fake() -> Iterator[Fake]:
    state: dict[str, Any] = {"count_aborts": True}
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    box: dict[str, Any] = {}

    async def start() -> None:
        runner = web.AppRunner(_fake_app(state), handler_cancellation=True, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        box["runner"], box["port"] = runner, runner.addresses[0][1]
        ready.set()

    t = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()), daemon=True)
    t.start()
    assert ready.wait(10)
    yield Fake(f"http://127.0.0.1:{box['port']}", state)
    asyncio.run_coroutine_threadsafe(box["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    t.join(10)


def _spec(max_tokens: int, stream: bool, prompt: int = 101, **kw: Any) -> sl.RequestSpec:
    return sl.RequestSpec("small", False, stream, [prompt], 1, max_tokens, True, 0.0, 0, **kw)


def test_send_one_classifies_outcomes(fake: Fake) -> None:
    async def main() -> list[soak_client.Outcome]:
        target = soak_client.Target(fake.url, "fake", timeout_s=30)
        async with aiohttp.ClientSession() as s:
            specs = [_spec(5, True), _spec(5, False), _spec(9, True, stop=["."]), _spec(5, False, 7),
                     _spec(5, True, 11), _spec(5, True, 13), _spec(400, True, abort_after_tokens=3),
                     _spec(400, False, client_timeout_s=0.1)]
            return [await soak_client.send_one(s, target, spec) for spec in specs]

    got = asyncio.run(main())
    assert [(o.status, o.reason) for o in got[:3]] == [("completed", "length"), ("completed", "length"),
                                                       ("completed", "stop")]
    assert got[0].completion_tokens == 5 and got[1].completion_tokens == 5
    assert got[3].status == "failed" and got[3].reason == "HTTP 500: boom"
    assert got[4].status == "failed" and "without [DONE]" in got[4].reason
    assert got[5].status == "failed" and "engine died" in got[5].reason
    assert [(o.status, o.reason) for o in got[6:]] == [("aborted", "stream"), ("aborted", "timeout")]


def _fake_soak(fake: Fake, tmp: str, *extra: str) -> tuple[int, dict[str, Any], str]:
    argv = ["--url", fake.url, "--server-pid", str(os.getpid()), "--duration-s", "5", "--sample-interval-s", "1",
            "--drain-s", "5", "--settle-s", "3", "--max-output-tokens", "60", "--abort-stream-fraction", "0.4",
            "--abort-timeout-fraction", "0.4", "--abort-timeout-s", "0.05:0.08", "--flat-tolerance", "0.5",
            "--out-dir", tmp, *extra]
    rc = soak.main(argv)
    with open(os.path.join(tmp, "soak.json")) as f:
        return rc, json.load(f), open(os.path.join(tmp, "soak.md")).read()


def test_fake_soak_with_capacity_probe_passes(fake: Fake, tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    # the rate, and so the number of requests, follows this machine's measured capacity; the requests drawn do not
    # (seeded apart from the arrivals): with seed 2 a timeout abort and a stream abort are among the first four
    # drawn, with or without text prompts (seed 0 had its first stream abort at the 22nd, and a slow machine sent
    # fewer)
    rc, rep, md = _fake_soak(fake, str(tmp_path), "--capacity-probe", "--probe-s", "2", "--probe-concurrency", "4",
                             "--load-fraction", "0.1", "--seed", "2")
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("PASS: ") and rc == 0, out[-1]
    probe = rep["capacity_probe"]
    assert probe["capacity_rps"] > 1 and rep["rate_rps"] == pytest.approx(0.1 * probe["capacity_rps"])
    c = rep["client"]
    assert c["sent"] > 10 and c["failed"] == 0 and c["completed"] + c["aborted"] == c["sent"]
    assert c["aborted_by_kind"].get("stream", 0) > 0 and c["aborted_by_kind"].get("timeout", 0) > 0
    cmp = rep["counters"]["compare"]
    assert all(v["ok"] for v in cmp.values()) and cmp["abort"]["client"] == sum(c["aborted_by_kind"].values())
    assert len([s for s in rep["samples"] if s["phase"] == "load"]) >= 4
    names = {ch["name"]: ch["ok"] for ch in rep["checks"]}
    assert names["private memory flat: server"] is not None and names["/dev/shm not growing"] is True
    assert names["no engine restarts"] is None  # the fake has no such counter: not computed, not failed
    assert "| request_success{abort} = client | pass |" in md
    assert os.path.getsize(tmp_path / "soak.png") > 10_000


def test_fake_soak_fails_when_aborts_are_not_counted(fake: Fake, tmp_path: Any,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    fake.app_state["count_aborts"] = False
    # the aborts never settle here, so the soak reads the counters until --settle-s ends: long enough for the
    # requests' other counts to land on a loaded machine (2 s failed once under a full two-core suite run, 6 s once
    # with other tests beside that run, 2026-12-01)
    rc, rep, _ = _fake_soak(fake, str(tmp_path), "--rate", "20", "--settle-s", "10")
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("FAIL: ") and "request_success{abort} = client" in last
    cmp = rep["counters"]["compare"]
    assert cmp["abort"]["server"] == 0 < cmp["abort"]["client"]
    # stop and length agree but for the one race soak_lib.compare_counts documents: a stream the client closed
    # after the server had finished it is the client's abort and the server's stop or length. With the server's
    # aborts uncounted that race is not reconciled, so it may show here (more often on a loaded machine: it failed
    # once under two suites at once, 2026-12-01), never more than the client's stream aborts and never under.
    over = [cmp[r]["diff"] for r in ("stop", "length") if r in cmp]
    assert all(d is not None and d >= 0 for d in over), cmp
    assert sum(over) <= rep["client"]["aborted_by_kind"].get("stream", 0), (cmp, rep["client"])


def test_unreachable_server_is_a_fail_not_a_crash(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc = soak.main(["--url", f"http://127.0.0.1:{port}", "--rate", "1", "--duration-s", "5",
                    "--sample-interval-s", "1", "--health-timeout-s", "2", "--out-dir", str(tmp_path)])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert rc == 1 and last.startswith("FAIL: the soak ran:") and "/health" in last


# ---------------------------------------------------------------- the real server on CPU


@pytest.mark.slow
def test_real_server_soak_on_cpu(tmp_path: Any) -> None:
    serve = f"{sys.executable} -m rapidserve.cli serve --device cpu --port 0 --max-model-len 1024"
    cmd = [sys.executable, os.path.join(BENCH, "soak.py"), "--launch", serve, "--rate", "1", "--duration-s", "10",
           "--sample-interval-s", "0.5", "--warmup-s", "3", "--max-prompt-tokens", "64", "--max-output-tokens", "24",
           "--abort-stream-fraction", "0.5", "--abort-timeout-fraction", "0.3", "--abort-timeout-s", "0.2:1.0",
           "--drain-s", "30", "--check-shm-after-exit", "--out-dir", str(tmp_path)]
    # 10 s at 1/s, seed 0: the same 10 arrivals as 20 s at 0.5/s (the arrival gaps are drawn from their own seed and
    # scaled by the rate; the requests from another), among them a stream dropped after 5 tokens and a 24-token
    # request given up on after 0.22 s; a sample every 0.5 s: about 20 load samples
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-2000:]
    assert p.returncode in (0, 1), last
    assert last.startswith("PASS: " if p.returncode == 0 else "FAIL: "), last
    with open(tmp_path / "soak.json") as f:
        rep = json.load(f)
    assert {"settings", "server", "samples", "client", "counters", "checks", "verdict", "server_exit",
            "shm_after_exit"} <= set(rep), rep.get("error")
    assert rep["server"]["model"] == "SmolLM2-135M-Instruct" and rep["server"]["text_prompts"] is True
    load = [s for s in rep["samples"] if s["phase"] == "load"]
    assert len(load) >= 10
    labels = {p["label"] for p in load[0]["procs"].values()}
    assert {"server", "worker1", "worker2"} <= labels and all(p["rss_mb"] > 0 and p["uss_mb"] > 0
                                                               for p in load[0]["procs"].values())
    c = rep["client"]
    assert c["sent"] >= 5 and c["failed"] == 0, c["failure_samples"]
    assert sum(c["aborted_by_kind"].values()) >= 1
    checks = {ch["name"]: ch for ch in rep["checks"]}
    for name in ("request_success{stop} = client", "request_success{length} = client",
                 "request_success{abort} = client", "private memory flat: server", "private memory flat: worker1",
                 "private memory flat: worker2",
                 "non-socket fds flat: server", "sockets back to idle", "/dev/shm not growing"):
        assert checks[name]["ok"] is not None, checks[name]  # computed
    cmp = rep["counters"]["compare"]
    assert all(v["ok"] for v in cmp.values()), f"the server's counters differ from the client's: {cmp}"
    for name in ("/health 200 at every sample", "launched server exits 0 on SIGTERM", "/dev/shm clean after exit",
                 "server processes alive at the end", "no engine restarts", "sockets back to idle"):
        assert checks[name]["ok"] is True, checks[name]
    assert (tmp_path / "soak.png").exists() and (tmp_path / "soak.md").exists()
    print(f"real soak: {time.monotonic() - t0:.0f} s, {c['sent']} requests; {last}")
