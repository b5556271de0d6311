"""Worker deaths and hangs seen from HTTP clients, with a real `rapidserve serve` on CPU (a tiny preset
model, token ids only, so a restart takes ~2 s).

Each death: the stream in flight ends with an OpenAI error event then `data: [DONE]` within 2 s,
/health answers 503 while the workers restart and 200 after, the log has one line for the death
(worker, pid, signal) and one for the restart (how long it took), and the counters move by one.
Deaths in a row (two of each worker) are each recovered; the next one is past the windowed restart
budget and the server exits non-zero for its supervisor (ten in a row through the engine alone:
tests/test_supervision.py). A SIGSTOPped worker is detected within the heartbeat
bound and handled the same way.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from pathlib import Path

import aiohttp

from tests.test_server import Srv, http, start
from tests.test_server_failures import counters, ended_with_error, read_events, worker_pids

TINY = ("--model", "preset:tiny-llama", "--max-model-len", "8192", "--num-kv-blocks", "1024")
# LONG runs past tiny-llama's 1024 positions: allowed (random weights: no text to spoil)
LONG_OK = {"RAPIDSERVE_ALLOW_LONG_MAX_MODEL_LEN": "1"}
LONG = {"prompt": [1, 2, 3, 4, 5], "max_tokens": 8000, "ignore_eos": True, "temperature": 0}
ROLES = ("decode", "prefill")  # workers start in this order: decode has the lower pid


async def health_until_ok(url: str, timeout: float = 60) -> list[tuple[int, str]]:
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, _, raw = http(url + "/health")
        seen.append((code, json.loads(raw)["status"]))
        if code == 200:
            return seen
        await asyncio.sleep(0.1)
    raise AssertionError(f"/health never answered 200: {seen[-5:]}")


async def all_workers(s: Srv, within_s: float = 20.0) -> list[int]:
    """The engine's worker pids once /proc lists one a role (a reading of /proc can miss a process that is being
    scanned as it forks or execs; under a loaded machine one read listed none while the stream was running)."""
    deadline = time.monotonic() + within_s
    while len(pids := worker_pids(s.proc.pid)) < len(ROLES) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert len(pids) >= len(ROLES), f"worker pids {pids} for roles {ROLES} after {within_s} s"
    return pids


async def kill_mid_stream(s: Srv, victim: str, sig: int = signal.SIGKILL) -> tuple[list[str], float]:
    """Start a long stream, then signal the `victim` worker; the stream's events and how long after
    the signal it ended."""
    async with aiohttp.ClientSession() as session:
        started = asyncio.Event()
        stream = asyncio.create_task(read_events(session, s.url, LONG, started))
        await asyncio.wait_for(started.wait(), 60)
        pid = (await all_workers(s))[ROLES.index(victim)]
        t0 = time.monotonic()
        os.kill(pid, sig)
        events, t_end = await asyncio.wait_for(stream, 30)
        return events, t_end - t0


RESTARTS = 4  # the budget: each worker dies twice, recovered each time; the next death is past it


def test_deaths_each_recovered_then_past_the_budget_the_server_exits_1(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    s = start(*TINY, "--max-restarts", str(RESTARTS), "--restart-window-s", "600", env=LONG_OK, log=str(log))
    try:
        async def main() -> None:
            for i in range(RESTARTS):
                victim = ROLES[i % 2]
                before = counters(s.url)
                events, took = await kill_mid_stream(s, victim)
                assert ended_with_error(events, "engine_unavailable"), events[-3:]
                assert f"the {victim} worker died" in json.loads(events[-2])["error"]["message"]
                assert took < 2.0, f"death {i}: the stream ended {took:.2f} s after the kill"
                seen = await health_until_ok(s.url)
                assert seen[0][0] == 503 or len(seen) == 1, seen
                after = counters(s.url)
                assert after["engine_worker_deaths_total"] - before["engine_worker_deaths_total"] == 1
                assert after["engine_restarts_total"] - before["engine_restarts_total"] == 1
                assert after["error"] - before["error"] == 1
            events, took = await kill_mid_stream(s, "decode")  # one more: past the budget
            assert ended_with_error(events, "engine_unavailable") and took < 2.0, events[-3:]

        asyncio.run(main())
        assert s.proc.wait(30) == 1
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
    text = log.read_text()
    deaths = re.findall(r"rapidserve.engine: the (decode|prefill) worker died \(killed by SIGKILL, pid \d+\); "
                        r"\d+ request\(s\) in flight failed", text)
    assert len(deaths) == RESTARTS + 1, text[-3000:]
    assert len(re.findall(r"workers restarted in \d+\.\d s \(restart \d+;", text)) == RESTARTS
    assert f"restart budget used up ({RESTARTS} in 600 s)" in text and "down for good" in text


def test_stopped_worker_is_detected_within_the_heartbeat_bound(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    s = start(*TINY, "--heartbeat-timeout-s", "3", env=LONG_OK, log=str(log))
    try:
        async def main() -> None:
            for victim in ROLES:
                events, took = await kill_mid_stream(s, victim, signal.SIGSTOP)
                assert ended_with_error(events, "engine_unavailable"), events[-3:]
                assert f"the {victim} worker stopped responding" in json.loads(events[-2])["error"]["message"]
                assert took < 3.0 + 1.0, f"{victim}: detected {took:.2f} s after SIGSTOP (bound 3 s)"
                await health_until_ok(s.url)
            code, _, raw = http(s.url + "/v1/completions", "POST",
                                json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode(),
                                {"Content-Type": "application/json"})
            assert code == 200, raw

        asyncio.run(main())
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(60) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
    assert len(re.findall(r"rapidserve.engine: the (?:decode|prefill) worker stopped responding \(no heartbeat "
                          r"for \d+\.\d s; pid \d+ killed\)", log.read_text())) == 2
