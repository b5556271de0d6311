"""bench/soak.py's HTTP client: one request of the mix and how it ended, the client's counts, the
open-loop (Poisson) load and the closed-loop capacity probe.

A request ends in one of three ways: completed (a finish reason of stop or length, with its
completion tokens from usage), aborted by the client (a stream closed after `abort_after_tokens`
tokens, a non-stream request past its `client_timeout_s`, or one cancelled at the end of the drain),
or failed (non-2xx, connection error, timeout, a stream without [DONE] or with an error event, a 200
without choices, any other finish reason).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import soak_lib as sl

from rapidserve.benchmark.client import Target, chunk_tokens, error_text

FAILURE_SAMPLES = 20


# ---------------------------------------------------------------- one request


@dataclass
class Outcome:
    status: str  # "completed" | "aborted" | "failed"
    reason: str  # the finish reason; how it was aborted (stream/timeout/drain); or the error
    completion_tokens: int = 0
    finish: str | None = None  # a failed request's finish reason, where the server gave one


def _finished(finish: Any, tokens: int) -> Outcome:
    if finish in ("stop", "length"):
        return Outcome("completed", str(finish), tokens)
    return Outcome("failed", f"finished with finish_reason={finish!r}", tokens, None if finish is None else str(finish))


async def _read_stream(resp: aiohttp.ClientResponse, spec: sl.RequestSpec) -> Outcome:
    tokens, finish, usage, done = 0, None, None, False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            err = event["error"]
            return Outcome("failed", "stream error event: " + str(err.get("message", err) if isinstance(err, dict)
                                                                   else err)[:300])
        u = event.get("usage")
        if isinstance(u, dict) and u.get("completion_tokens") is not None:
            usage = int(u["completion_tokens"])
        for ch in event.get("choices") or ():
            tokens += chunk_tokens(ch)[0]
            if ch.get("finish_reason") is not None:
                finish = ch["finish_reason"]
        if spec.abort_after_tokens is not None and finish is None and tokens >= spec.abort_after_tokens:
            resp.close()  # drop the connection: the server sees the client go away
            return Outcome("aborted", "stream")
    if not done:
        return Outcome("failed", f"the stream ended without [DONE] after {tokens} tokens")
    return _finished(finish, usage if usage is not None else tokens)


async def send_one(session: aiohttp.ClientSession, target: Target, spec: sl.RequestSpec) -> Outcome:
    """Send `spec` and say how it ended."""
    url = target.base_url + ("/v1/chat/completions" if spec.chat else "/v1/completions")
    timeout = aiohttp.ClientTimeout(total=spec.client_timeout_s or target.timeout_s)
    try:
        async with session.post(url, json=spec.payload(target.model), headers=target.headers(),
                                timeout=timeout) as resp:
            if resp.status != 200:
                return Outcome("failed", error_text(resp.status, await resp.text()))
            if spec.stream:
                return await _read_stream(resp, spec)
            body = json.loads(await resp.read())
            choices = body.get("choices") if isinstance(body, dict) else None
            if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
                return Outcome("failed", f"a 200 response without choices: {str(body)[:200]}")
            usage = body.get("usage") or {}
            return _finished(choices[0].get("finish_reason"), int(usage.get("completion_tokens") or 0))
    except asyncio.TimeoutError:  # before OSError: TimeoutError is one
        if spec.client_timeout_s is not None:
            return Outcome("aborted", "timeout")
        return Outcome("failed", f"timeout after {target.timeout_s:g} s")
    except (aiohttp.ClientError, ValueError, OSError) as e:
        return Outcome("failed", f"{type(e).__name__}: {e}"[:300])


@dataclass
class Tally:
    """The client's counts."""

    sent: int = 0
    inflight: int = 0
    skipped_at_cap: int = 0
    completion_tokens: int = 0
    completed: Counter[str] = field(default_factory=Counter)
    aborted: Counter[str] = field(default_factory=Counter)  # stream | timeout | drain
    failed: Counter[str] = field(default_factory=Counter)  # by kind (error text up to its first digit)
    failed_finish: Counter[str] = field(default_factory=Counter)  # finish reasons of failed requests
    failure_samples: list[dict[str, Any]] = field(default_factory=list)
    finish_times: list[float] = field(default_factory=list)

    def record(self, spec: sl.RequestSpec, out: Outcome, t: float) -> None:
        if out.status == "completed":
            self.completed[out.reason] += 1
            self.completion_tokens += out.completion_tokens
            self.finish_times.append(t)
        elif out.status == "aborted":
            self.aborted[out.reason] += 1
        else:
            self.failed[re.split(r"[\d:]", out.reason, maxsplit=1)[0].strip() or out.reason] += 1
            if out.finish is not None:
                self.failed_finish[out.finish] += 1
            if len(self.failure_samples) < FAILURE_SAMPLES:
                self.failure_samples.append({"t": round(t, 3), "error": out.reason, "request": spec.to_json()})

    def snapshot(self) -> dict[str, int]:
        return {"sent": self.sent, "inflight": self.inflight, "completed": sum(self.completed.values()),
                "aborted": sum(self.aborted.values()), "failed": sum(self.failed.values()),
                "skipped_at_cap": self.skipped_at_cap}

    def to_json(self) -> dict[str, Any]:
        return {**self.snapshot(), "completed_by_reason": dict(self.completed), "aborted_by_kind": dict(self.aborted),
                "failed_by_kind": dict(self.failed), "failed_finish_reasons": dict(self.failed_finish),
                "completion_tokens": self.completion_tokens, "failure_samples": self.failure_samples}


async def run_one(session: aiohttp.ClientSession, target: Target, spec: sl.RequestSpec, tally: Tally,
                  t0: float) -> None:
    tally.sent += 1
    tally.inflight += 1
    try:
        out = await send_one(session, target, spec)
    except asyncio.CancelledError:  # cancelled at the end of the drain: the connection is dropped
        tally.record(spec, Outcome("aborted", "drain"), time.monotonic() - t0)
        raise
    finally:
        tally.inflight -= 1
    tally.record(spec, out, time.monotonic() - t0)


async def drain(tasks: set[asyncio.Task[None]], timeout_s: float) -> int:
    """Wait up to `timeout_s` for `tasks`, cancel what is left; returns how many were cancelled."""
    if not tasks:
        return 0
    _, pending = await asyncio.wait(set(tasks), timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    return len(pending)


# ---------------------------------------------------------------- load


async def open_loop(session: aiohttp.ClientSession, target: Target, mix: sl.Mix, rate: float, duration_s: float,
                    cap: int, drain_s: float, seed: int, tally: Tally, t0: float) -> None:
    """Poisson arrivals at `rate` for `duration_s`, at most `cap` in flight, then the drain."""
    arrivals, draws = random.Random(seed), random.Random(seed + 1)
    tasks: set[asyncio.Task[None]] = set()
    end = t0 + duration_s
    nxt = t0
    while True:
        nxt += arrivals.expovariate(rate)
        if nxt >= end:
            break
        await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        spec = sl.make_request(draws, mix)  # drawn even when skipped: a seed gives the same requests
        if len(tasks) >= cap:
            tally.skipped_at_cap += 1
            continue
        task = asyncio.create_task(run_one(session, target, spec, tally, t0))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.sleep(max(0.0, end - time.monotonic()))
    await drain(tasks, drain_s)


async def capacity_probe(session: aiohttp.ClientSession, target: Target, mix: sl.Mix, concurrency: int,
                         probe_s: float, drain_s: float, seed: int) -> dict[str, Any]:
    """Closed loop at `concurrency` for `probe_s` (no aborts): the sustained completion rate."""
    tally, draws = Tally(), random.Random(seed + 2)
    t0 = time.monotonic()

    async def worker() -> None:
        while time.monotonic() < t0 + probe_s:
            await run_one(session, target, sl.make_request(draws, mix, allow_aborts=False), tally, t0)

    print(f"capacity probe: closed loop at concurrency {concurrency} for {probe_s:g} s", flush=True)
    tasks = {asyncio.create_task(worker()) for _ in range(concurrency)}
    await drain(tasks, probe_s + drain_s)
    rate = sl.sustained_rate(tally.finish_times, 0.0, probe_s)
    res = {"concurrency": concurrency, "duration_s": probe_s, **tally.to_json(), "capacity_rps": rate}
    print(f"capacity probe: {res['completed']} completed, {res['failed']} failed: {rate:.3f} requests/s", flush=True)
    if res["failed"]:
        print(f"capacity probe failures: {dict(tally.failed)}", flush=True)
    return res


def client_expected(tally: Tally) -> dict[str, int]:
    """What request_success{finished_reason} should have grown by: completed by reason; aborts are the
    client's plus the responses in which the server itself said 'abort'."""
    return {"stop": tally.completed["stop"], "length": tally.completed["length"],
            "abort": sum(tally.aborted.values()) + tally.failed_finish["abort"]}


def counters_report(before: dict[str, Any] | None, after: dict[str, Any] | None, tally: Tally) -> dict[str, Any]:
    expected = client_expected(tally)
    if before is None or after is None:
        return {"before": before, "after": after, "delta": None, "client_expected": expected, "compare": None}
    delta = sl.counter_delta(before, after)
    return {"before": before, "after": after, "delta": delta, "client_expected": expected,
            "compare": sl.compare_counts(expected, delta, raced=tally.aborted["stream"])}
