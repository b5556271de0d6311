"""`rapidserve serve`: start the engine, serve HTTP, drain on SIGTERM/SIGINT and exit 0."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

from aiohttp import web

from rapidserve.config import EngineConfig, ServerConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.loader import ModelSource
from rapidserve.tokenizer import Tokenizer

log = logging.getLogger("rapidserve.server")


def model_name(cfg: EngineConfig, source: ModelSource, override: str | None) -> str:
    if override:
        return override
    if cfg.model in ("default", ""):
        return "SmolLM2-135M-Instruct"
    if cfg.model.startswith("preset:"):
        return cfg.model
    return os.path.basename(os.path.normpath(cfg.model))


async def serve(ecfg: EngineConfig, scfg: ServerConfig, source: ModelSource) -> int:
    from rapidserve.server.app import Server

    tokenizer = Tokenizer.from_source(source)
    if tokenizer is None:  # presets: token ids in and out (text prompts get 400, outputs carry token_ids)
        log.warning("model %r has no tokenizer: serving token-id prompts only on /v1/completions and /generate",
                    ecfg.model)
    else:
        merged = tuple(dict.fromkeys(ecfg.model_config.eos_token_ids + tokenizer.eos_token_ids))
        ecfg = ecfg.__class__(**{**ecfg.__dict__, "model_config": ecfg.model_config.replace(eos_token_ids=merged)})
    name = model_name(ecfg, source, scfg.served_model_name)
    t0 = time.monotonic()
    engine = await AsyncEngine.start(ecfg)
    for line in engine.events:
        log.info("%s", line)
    server = Server(scfg, ecfg, engine, tokenizer, name)
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, scfg.host, scfg.port)
    await site.start()
    port = runner.addresses[0][1] if runner.addresses else scfg.port
    print(f"rapidserve: serving {name} on http://{scfg.host}:{port} (ready in {time.monotonic() - t0:.1f} s)",
          flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()

    log.info("stopping: no new requests; waiting up to %.0f s for %d in flight", scfg.shutdown_grace_s,
             server.inflight)
    server.draining = True
    await site.stop()  # stop accepting connections
    deadline = time.monotonic() + scfg.shutdown_grace_s
    while server.inflight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await runner.shutdown()  # cancels what is left: their engine requests are aborted
    await runner.cleanup()
    await engine.shutdown()
    print("rapidserve: stopped", flush=True)
    return 0


def run(ecfg: EngineConfig, scfg: ServerConfig, source: ModelSource) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return asyncio.run(serve(ecfg, scfg, source))
