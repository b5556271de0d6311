"""A stand-in engine and an in-process server for the fast server tests (no workers, no model).

`FakeEngine` follows the `AsyncEngine` contract the server uses: `state`, `restarts_total`,
`deaths_total`, `fatal`, `dead_reason`, `stats`, and `generate`, which yields one token every
`delay` s (the first once `first_token` is set: clear it to hold requests before their first token),
raises `EngineError` within `delay` once `die` is set (a worker died), or at once while `state` is not
"ready". `running_server` serves it on a free loopback port the way `rapidserve
serve` does (`make_runner`: connection limits, handler cancellation).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from rapidserve.config import EngineConfig, ModelConfig, SchedulerConfig
from rapidserve.engine.errors import EngineError, RequestRejected
from rapidserve.engine.messages import TokenOut
from rapidserve.sampling_params import SamplingParams
from rapidserve.server.app import Server
from rapidserve.server.serve import make_runner
from rapidserve.server_config import ServerConfig

MODEL = ModelConfig(arch="llama", vocab_size=64, hidden_size=8, intermediate_size=16, num_layers=1, num_heads=2,
                    num_kv_heads=1, head_dim=4, max_position_embeddings=4096)
ECFG = EngineConfig(model="preset:fake", model_config=MODEL, scheduler=SchedulerConfig(max_num_seqs=8))
CRASH = "crash"  # FakeEngine.mode: raise a plain RuntimeError (a bug) after the first token
REJECT = "reject"  # FakeEngine.mode: refuse the prompt (RequestRejected) before any token


class FakeEngine:
    def __init__(self, delay: float = 0.01) -> None:
        self.delay = delay
        self.state = "ready"
        self.restarts_total = self.deaths_total = 0
        self.dead_reason: str | None = None
        self.stats: Any = None
        self.fatal = asyncio.Event()
        self.die = asyncio.Event()
        self.first_token = asyncio.Event()
        self.first_token.set()
        self.mode = ""
        self.live: set[str] = set()  # engine requests in flight
        self.aborted: list[str] = []  # engine requests the consumer left before they finished

    @property
    def running(self) -> bool:
        return self.state == "ready"

    async def generate(self, req_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[TokenOut]:
        if self.state != "ready":
            raise EngineError(f"the engine is not running ({self.state})")
        if self.mode == REJECT:
            raise RequestRejected("prompt_token_ids holds 99: token ids must be integers in [0, 64)")
        self.live.add(req_id)
        done = False
        try:
            n = params.max_tokens or 16
            await self.first_token.wait()
            for i in range(n):
                if i:
                    await asyncio.sleep(self.delay)
                if self.die.is_set():
                    done = True
                    raise EngineError("the decode worker died (killed by SIGKILL, pid 1)")
                if self.mode == CRASH and i == 1:
                    done = True
                    raise RuntimeError("a bug")
                yield TokenOut(req_id, i, 5 + i % 7, finish_reason="length" if i == n - 1 else None)
            done = True
        finally:
            self.live.discard(req_id)
            if not done:
                self.aborted.append(req_id)


@contextlib.asynccontextmanager
async def running_server(engine: FakeEngine, **cfg: Any) -> AsyncIterator[tuple[Server, str]]:
    """The server over `engine` on 127.0.0.1:<free port>; yields (server, base url)."""
    scfg = ServerConfig(**{"port": 0, **cfg})
    server = Server(scfg, ECFG, engine, None, "fake")  # type: ignore[arg-type]
    runner = make_runner(server.app(), scfg)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield server, f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def sse_events(body: bytes) -> list[str]:
    """The `data:` payloads of a server-sent-events body, in order."""
    return [line[len("data: "):] for line in body.decode().split("\n\n") if line.startswith("data: ")]
