"""The bench client's own timing error: how far the gaps `rapidserve bench` measures lie from the server's.

A fake engine (an aiohttp server in a process of its own) streams every request one token per step of exactly
`--step-ms`, all streams on one step clock, as an engine's batch does; `rapidserve bench` (the client of every
frontier in bench/results) sends it the workload at each `--rates` (Poisson), and the table printed last gives, per
rate, the client's view of the gaps next to the truth (the step): the largest per-request p95 gap (what the goodput's
ITL rule reads) and the largest single gap. What the client adds there is not the engine's.

    python bench/client_clock.py [--step-ms 40] [--rates 8,17.8,24] [--input-len 2048] [--output-len 28]
        [--num-prompts 96] [--out DIR]

2026-11-30, this repository's 2-core CPU machine, 2048:28 at 17.8 req/s, 96 requests, 40-ms steps: largest p95 gap
41.6 ms, largest gap 42.4 ms (bench/results/h200x2_1130/README.md: the H200's 53-65 ms gaps were not the client's).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def serve(port: int, step_s: float) -> None:
    """The fake engine (runs in its own process: `--serve PORT`)."""
    from aiohttp import web

    async def clock(app: web.Application) -> None:
        tick = asyncio.Condition()
        app["tick"] = tick

        async def run() -> None:
            nxt = time.monotonic()
            while True:
                nxt += step_s
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                async with tick:
                    tick.notify_all()

        app["clock"] = asyncio.create_task(run())

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": 1 << 20}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        tick: asyncio.Condition = request.app["tick"]
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(int(body["max_tokens"])):
            async with tick:
                await tick.wait()
            await resp.write(b"data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} "}]}).encode() + b"\n\n")
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.on_startup.append(clock)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def gaps(run: dict) -> tuple[int, float, float]:
    """(requests, largest per-request p95 gap ms, largest gap ms) of one bench run."""
    p95s, top = [], 0.0
    for q in run["requests"]:
        g = sorted(q.get("itl_s") or [])
        if g:
            p95s.append(g[int(0.95 * (len(g) - 1))] * 1e3)
            top = max(top, g[-1] * 1e3)
    return len(p95s), max(p95s, default=0.0), top


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--step-ms", type=float, default=40.0)
    ap.add_argument("--rates", default="8,17.8,24")
    ap.add_argument("--input-len", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=28)
    ap.add_argument("--num-prompts", type=int, default=96)
    ap.add_argument("--out", default=None, help="where the bench runs' JSON go (default: a temporary folder)")
    a = ap.parse_args(argv)
    if a.step_ms <= 0 or a.input_len < 1 or a.output_len < 2 or a.num_prompts < 1:
        ap.error("--step-ms > 0, --input-len >= 1, --output-len >= 2 (a gap needs two tokens), --num-prompts >= 1")
    if a.serve is not None:
        serve(a.serve, a.step_ms / 1e3)
        return 0
    rates = [float(r) for r in a.rates.split(",")]
    out = Path(a.out or tempfile.mkdtemp(prefix="client_clock_"))
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--step-ms", str(a.step_ms)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    print("client_clock.py: the fake engine did not start", file=sys.stderr)
                    return 2
                time.sleep(0.2)
        rows = []
        for rate in rates:
            name = f"clock_{rate:g}"
            subprocess.run([sys.executable, "-m", "rapidserve.cli", "bench", "--base-url", url, "--model", "fake",
                            "--workload", "fixed", "--input-len", str(a.input_len), "--output-len",
                            str(a.output_len), "--request-rate", str(rate), "--num-prompts", str(a.num_prompts),
                            "--out-dir", str(out), "--name", name, "--no-plot", "--quiet"], check=True)
            run = json.loads((out / f"{name}.json").read_text())["runs"][0]
            rows.append((rate, *gaps(run)))
    finally:
        server.terminate()
        server.wait(10)
    print(f"bench client vs a fake engine of {a.step_ms:g}-ms steps ({a.input_len}:{a.output_len}, "
          f"{a.num_prompts} requests a rate; runs in {out})")
    print("| rate (req/s) | requests | largest p95 gap (ms) | largest gap (ms) | step (ms) |")
    print("|---|---|---|---|---|")
    for rate, n, p95, top in rows:
        print(f"| {rate:g} | {n} | {p95:.1f} | {top:.1f} | {a.step_ms:g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
