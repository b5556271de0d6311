"""How many streamed tokens a second the HTTP front end (server/, one asyncio process) sustains, with no GPU.

The real `Server` (routes, validation, SSE chunks, metrics, the per-request log line) runs in a process of its own over
a stand-in engine that, every `--step-ms`, hands one token to every live stream (as the decode worker's TokenBatch
reaches `AsyncEngine._deliver`: one queue put per token); the client (this process) sends Poisson arrivals of
token-id completion requests with `stream: true` and reads every event. Per rate it reports the server's CPU share
of one core, its CPU time per streamed token, and the client's TTFT in the first and last quarter of the arrivals:
a front end that keeps up has the two alike and a CPU share well under 1; one that falls behind shows the TTFT of the
last quarter growing (its queue of events) with a share near 1.

Why: on 2 x H200 (2026-11-30, bench/results/h200x2_1130d/README.md) duet's TTFT at 33.5 req/s of 1024:256 grew to
3.8 s; this ruled the front end out (the TTFT phases put the time in the decode worker's queue: the GPU was full).

    python bench/frontend_load.py --rates 10,33.5,60 --requests 400 --output-len 256 [--out DIR]

The client shares the machine: on a small one (2 cores) its own parsing bounds the rates it can drive. Prints its
table last; `--out DIR` writes frontend_load.json and .md there.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from table_out import write_table_files  # noqa: E402


class StepEngine:
    """The parts of `AsyncEngine` the server reads, with one token per live stream every `step_s` seconds."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.state, self.dead_reason, self.stats = "ready", None, None
        self.restarts_total = self.deaths_total = 0
        self.fatal = asyncio.Event()
        self.live: dict[str, tuple[asyncio.Queue[Any], int, int]] = {}

    @property
    def running(self) -> bool:
        return True

    async def stepper(self) -> None:
        from rapidserve.engine.messages import TokenOut

        while True:
            await asyncio.sleep(self.step_s)
            for rid, (q, n, i) in list(self.live.items()):
                last = i == n - 1
                q.put_nowait(TokenOut(rid, i, 5 + i % 7, finish_reason="length" if last else None))
                if last:
                    del self.live[rid]
                else:
                    self.live[rid] = (q, n, i + 1)

    async def generate(self, req_id: str, prompt: list[int], params: Any) -> AsyncIterator[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.live[req_id] = (q, params.max_tokens or 16, 0)
        try:
            while True:
                tok = await q.get()
                yield tok
                if tok.finish_reason is not None:
                    return
        finally:
            self.live.pop(req_id, None)

    async def abort(self, req_id: str) -> None:
        self.live.pop(req_id, None)


def serve(step_s: float, port_out: Any, report: Any) -> None:
    """The server process: the real app over a StepEngine on a free loopback port; its CPU time on SIGTERM."""
    from aiohttp import web

    from rapidserve.config import EngineConfig, ModelConfig
    from rapidserve.server.app import Server
    from rapidserve.server.serve import make_runner
    from rapidserve.server_config import ServerConfig

    model = ModelConfig(arch="llama", vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                        num_kv_heads=1, head_dim=4, max_position_embeddings=8192)

    async def main() -> None:
        engine = StepEngine(step_s)
        scfg = ServerConfig(port=0, max_connections=100_000)
        server = Server(scfg, EngineConfig(model="preset:fake", model_config=model), engine, None,  # type: ignore[arg-type]
                        "fake")
        runner = make_runner(server.app(), scfg)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stepper = asyncio.ensure_future(engine.stepper())
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        port_out.send(runner.addresses[0][1])
        c0 = time.process_time()
        await stop.wait()
        report.send(time.process_time() - c0)
        stepper.cancel()
        await runner.cleanup()

    asyncio.run(main())


async def one(session: Any, url: str, prompt: list[int], output_len: int, delay: float) -> tuple[float, float, int]:
    await asyncio.sleep(delay)
    t0 = time.monotonic()
    first, events = float("nan"), 0
    body = {"model": "fake", "prompt": prompt, "max_tokens": output_len, "stream": True, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                events += 1
                if events == 1:
                    first = time.monotonic() - t0
    return delay, first, events


def run_rate(rate: float, n: int, input_len: int, output_len: int, step_s: float, seed: int) -> dict[str, Any]:
    import aiohttp

    ctx = mp.get_context("spawn")
    port_rx, port_tx = ctx.Pipe(duplex=False)
    rep_rx, rep_tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=serve, args=(step_s, port_tx, rep_tx), daemon=True)
    proc.start()
    if not port_rx.poll(60):
        proc.kill()
        raise RuntimeError("the server process did not start within 60 s")
    url = f"http://127.0.0.1:{port_rx.recv()}"
    rng = random.Random(seed)
    t, delays = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        delays.append(t)
    prompt = [1 + i % 60 for i in range(input_len)]

    async def drive() -> tuple[list[tuple[float, float, int]], float, float]:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as s:
            w0, c0 = time.monotonic(), time.process_time()
            got = await asyncio.gather(*(one(s, url, prompt, output_len, d) for d in delays))
            return list(got), time.monotonic() - w0, time.process_time() - c0

    got, wall, client_cpu = asyncio.run(drive())
    os.kill(proc.pid, signal.SIGTERM)
    server_cpu = rep_rx.recv() if rep_rx.poll(30) else float("nan")
    proc.join(10)
    got.sort()
    ttft = [f for _, f, _ in got]
    q = max(1, n // 4)
    tokens = sum(e for _, _, e in got)
    return {"rate": rate, "requests": n, "tokens": tokens, "wall_s": round(wall, 2),
            "server_cpu_share": round(server_cpu / wall, 3), "server_us_per_token": round(1e6 * server_cpu / tokens, 1),
            "client_cpu_share": round(client_cpu / wall, 3),
            "ttft_first_quarter_ms": round(1e3 * statistics.median(ttft[:q]), 1),
            "ttft_last_quarter_ms": round(1e3 * statistics.median(ttft[-q:]), 1),
            "ttft_max_ms": round(1e3 * max(ttft), 1), "short_streams": sum(e < output_len for _, _, e in got)}


COLUMNS = ("rate", "requests", "tokens", "server_cpu_share", "server_us_per_token", "client_cpu_share",
           "ttft_first_quarter_ms", "ttft_last_quarter_ms", "ttft_max_ms", "short_streams")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(str(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="10,33.5", help="Poisson arrival rates (req/s), comma-separated")
    ap.add_argument("--requests", type=int, default=300, help="arrivals per rate")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--step-ms", type=float, default=26.0, help="the stand-in engine's step (one token per stream)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write frontend_load.json and .md here")
    a = ap.parse_args(argv)
    try:
        rates = [float(x) for x in a.rates.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rates {a.rates!r}: give numbers separated by commas, e.g. 10,33.5")
    if not rates or min(rates) <= 0 or a.requests < 4 or a.input_len < 1 or a.output_len < 1 or a.step_ms <= 0:
        ap.error("--rates must be positive numbers; --requests >= 4; --input-len, --output-len >= 1; --step-ms > 0")
    rows = []
    for rate in rates:
        print(f"frontend_load: {a.requests} arrivals at {rate:g} req/s ...", file=sys.stderr, flush=True)
        rows.append(run_rate(rate, a.requests, a.input_len, a.output_len, a.step_ms / 1e3, a.seed))
    md = table(rows)
    write_table_files(a.out, "frontend_load", a, rows, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
