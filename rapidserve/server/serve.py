"""`rapidserve serve`: start the engine, serve HTTP until SIGTERM/SIGINT or the engine gives up.

Stopping (SIGTERM or SIGINT): no new connections or requests (503, /health 503 "draining"); idle
keep-alive connections are closed; requests in flight may finish for `shutdown_grace_s`; then every
one still running ends with an error (a stream: error event + `data: [DONE]`; otherwise 503), the
workers stop, and the process exits 0 within the grace + ~2 s. A second signal skips the rest of
the grace. When the engine gives up for good (`engine.fatal`: its restart budget is used up, or
`on_worker_death=shutdown`), the server logs why, ends what is in flight the same way at once and
exits 1, so that its supervisor (systemd, Kubernetes, Slurm) starts it afresh. With
`--data-parallel-size N` the engine is a `DataParallelEngine` of N engines; one of them giving up
is the engine giving up.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys
import time

from aiohttp import web

from rapidserve.config import TOOL_CALL_PARSERS, ConfigError, EngineConfig, ServerConfig
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.data_parallel import DataParallelEngine
from rapidserve.loader import ModelSource
from rapidserve.server.connections import GuardedRunner
from rapidserve.server.tools import resolve_parser, template_renders_tools
from rapidserve.tokenizer import Tokenizer

log = logging.getLogger("rapidserve.server")
EXIT_ENGINE_DOWN = 1
END_WAIT_S = 1.0  # after the grace: how long ended requests get to send their last bytes


def model_name(cfg: EngineConfig, source: ModelSource, override: str | None) -> str:
    if override:
        return override
    if cfg.model in ("default", ""):
        return "SmolLM2-135M-Instruct"
    if cfg.model.startswith("preset:"):
        return cfg.model
    return os.path.basename(os.path.normpath(cfg.model))


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (127.0.0.0/8, ::1, localhost): reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to any interface
        return False


def warn_if_exposed(scfg: ServerConfig) -> bool:
    """Log a WARNING when the server listens beyond loopback without an API key; True if it did."""
    if scfg.api_key is not None or is_loopback(scfg.host):
        return False
    log.warning("NO API KEY: listening on %s without an API key, so anyone who can reach this address can "
                "use the server; set RAPIDSERVE_API_KEY or pass --api-key-file PATH", scfg.host)
    return True


def auto_tool_parser(scfg: ServerConfig, ecfg: EngineConfig, tokenizer: Tokenizer | None) -> str | None:
    """The tool-call format of tool_choice "auto" (None: not enabled); a ConfigError when it was enabled but
    the format cannot be told. Logs the choice, and a warning when the chat template ignores tools."""
    if not scfg.enable_auto_tool_choice:
        return None
    template = tokenizer.chat_template if tokenizer is not None else None
    parser = resolve_parser(scfg.tool_call_parser, template, ecfg.model_config.arch)
    if parser is None:
        raise ConfigError(f"--enable-auto-tool-choice: cannot tell the tool-call format of this model "
                          f"({ecfg.model_config.arch}, a chat template without <tool_call>): pass --tool-call-parser "
                          f"{' or '.join(p for p in TOOL_CALL_PARSERS if p != 'auto')}")
    log.info("tool_choice \"auto\": parsing tool calls as %s (--tool-call-parser %s)", parser, scfg.tool_call_parser)
    if not template_renders_tools(template):
        log.warning("the chat template does not render 'tools': the model will not see them (tool_choice "
                    "\"required\" and named functions still constrain its output)")
    return parser


def make_runner(app: web.Application, scfg: ServerConfig) -> GuardedRunner:
    """The runner of the server's app: connection limits from `scfg`, handlers cancelled when their
    client goes away (which aborts the engine request), no access log (one line per request instead)."""
    return GuardedRunner(app, header_timeout_s=scfg.header_timeout_s, max_connections=scfg.max_connections,
                         handler_cancellation=True, access_log=None, keepalive_timeout=scfg.keepalive_timeout_s,
                         shutdown_timeout=END_WAIT_S)


async def serve(ecfg: EngineConfig, scfg: ServerConfig, source: ModelSource) -> int:
    from rapidserve.server.app import Server, grammar_trials

    tokenizer = Tokenizer.from_source(source)
    if tokenizer is None:  # presets: token ids in and out (text prompts get 400, outputs carry token_ids)
        log.warning("model %r has no tokenizer: serving token-id prompts only on /v1/completions and /generate",
                    ecfg.model)
    else:
        merged = tuple(dict.fromkeys(ecfg.model_config.eos_token_ids + tokenizer.eos_token_ids))
        ecfg = ecfg.__class__(**{**ecfg.__dict__, "model_config": ecfg.model_config.replace(eos_token_ids=merged)})
    name = model_name(ecfg, source, scfg.served_model_name)
    tool_parser = auto_tool_parser(scfg, ecfg, tokenizer)  # a bad flag fails before the workers start
    t0 = time.monotonic()
    trials = None if tokenizer is None else grammar_trials(ecfg, tokenizer)
    # the grammar engine's view of the tokenizer (seconds, mostly GIL): loaded while the engine starts
    warming = None if trials is None else asyncio.ensure_future(asyncio.to_thread(trials.warm))
    engine = await start_engine(ecfg)
    if warming is not None:
        await warming
    for line in engine.events:
        log.info("%s", line)
    server = Server(scfg, ecfg, engine, tokenizer, name, tool_parser, trials)
    runner = make_runner(server.app(), scfg)
    await runner.setup()
    site = web.TCPSite(runner, scfg.host, scfg.port)
    await site.start()
    warn_if_exposed(scfg)
    port = runner.addresses[0][1] if runner.addresses else scfg.port
    print(f"rapidserve: serving {name} on http://{scfg.host}:{port} (ready in {time.monotonic() - t0:.1f} s)",
          flush=True)

    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.info("%s again: ending the requests in flight now", sig.name)
            hurry.set()
        else:
            log.info("%s: stopping", sig.name)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    await _first(stop, engine.fatal)
    fatal = engine.fatal.is_set() and not stop.is_set()

    server.draining = True
    await site.stop()  # no new connections
    if runner.server is not None:
        runner.server.pre_shutdown()  # idle keep-alive connections close now, busy ones after their response
    if fatal:
        log.error("the engine is down for good (%s): ending %d request(s) in flight and exiting with code %d",
                  engine.dead_reason, server.inflight, EXIT_ENGINE_DOWN)
    else:
        log.info("stopping: no new requests; %d in flight may finish within %.1f s", server.inflight,
                 scfg.shutdown_grace_s)
        deadline = time.monotonic() + scfg.shutdown_grace_s
        while server.inflight and time.monotonic() < deadline and not hurry.is_set() and not engine.fatal.is_set():
            await _first(hurry, engine.fatal, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
    if server.inflight:
        why = (f"the engine is down: {engine.dead_reason}" if engine.fatal.is_set()
               else "the server is shutting down")
        log.warning("ending %d request(s) still in flight: %s", server.end_all(why), why)
        deadline = time.monotonic() + END_WAIT_S
        while server.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    await runner.cleanup()  # closes what is left (each connection gets up to END_WAIT_S)
    await engine.shutdown()
    print("rapidserve: stopped", flush=True)
    return EXIT_ENGINE_DOWN if fatal else 0


async def start_engine(ecfg: EngineConfig) -> AsyncEngine | DataParallelEngine:
    """One engine, or with `--data-parallel-size N` (N > 1) N of them behind this router."""
    if ecfg.parallel.data_parallel_size > 1:
        return await DataParallelEngine.start(ecfg)
    return await AsyncEngine.start(ecfg)


async def _first(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Wait until one of `events` is set (or `timeout` seconds)."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def run(ecfg: EngineConfig, scfg: ServerConfig, source: ModelSource) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    return asyncio.run(serve(ecfg, scfg, source))
