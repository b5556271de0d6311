"""`rapidserve serve`: start the engine, serve HTTP until SIGTERM/SIGINT or the engine gives up.

Starting (`run`): the port is bound first (a busy one fails at once: `startup.BindError`, one line, exit 1),
and answers 503 "starting" (`startup.StartupGate`) while the config tree is built (a first start with a GGUF
file converts it, logged with the reason), the tokenizer loads and the engine starts (its workers log
loading weights, sizing the KV cache, capturing graphs); each step is logged and named in /health's reason.
Then the server proper takes the sockets over and "ready in X s" (from the process's start) is printed.

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
import dataclasses
import functools
import ipaddress
import logging
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from rapidserve.config import EngineConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine.launch import start_fork_server
from rapidserve.policy_spec import policy_line
from rapidserve.server.connections import GuardedRunner
from rapidserve.server.redact import Redactor, install
from rapidserve.server.startup import StartupGate, bind_sockets, configure_logging, off_loop, process_age_s
from rapidserve.server_config import TOOL_CALL_PARSERS, ServerConfig

if TYPE_CHECKING:  # the engine, the loader and the tokenizer import torch: loaded once the port is bound
    from rapidserve.engine.client import AsyncEngine
    from rapidserve.engine.data_parallel import DataParallelEngine
    from rapidserve.loader import ModelSource
    from rapidserve.partition.profile import Profile
    from rapidserve.server.app import Server
    from rapidserve.structured import GrammarTrials
    from rapidserve.tokenizer import Tokenizer

log = logging.getLogger("rapidserve.server")
EXIT_ENGINE_DOWN = 1
END_WAIT_S = 1.0  # after the grace: how long ended requests get to send their last bytes


def served_names(scfg: ServerConfig, ecfg: EngineConfig, model_spec: str | None) -> tuple[str, ...]:
    """The names the model answers to: --served-model-name's, else one: the Hub id as given (`Qwen/Qwen3-8B`,
    which vLLM's users send as `model`), a preset's spec, or a path's last component (rapidserve's default)."""
    from rapidserve.loader.hub import DUMMY_PREFIX, display_name, is_repo_id

    if scfg.served_model_name:
        return scfg.served_model_name
    if model_spec is not None and ecfg.model.removeprefix(DUMMY_PREFIX) != model_spec and is_repo_id(model_spec):
        return (model_spec,)  # found in the Hugging Face cache
    return (display_name(ecfg.model),)


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
    from rapidserve.server.tools import resolve_parser, template_renders_tools

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


def check_reasoning_parser(scfg: ServerConfig, tokenizer: Tokenizer | None) -> None:
    """--reasoning-parser at start: a ConfigError when the model has no tokenizer (no chats to read) or its
    vocabulary lacks the think tags (vLLM refuses to start then too); logs the parser."""
    from rapidserve.server.reasoning_parsers import tag_problem

    name = scfg.reasoning_parser
    if name is None:
        return
    if tokenizer is None:
        raise ConfigError(f"--reasoning-parser {name}: the model has no tokenizer, so it serves no chat to read "
                          "reasoning out of; give it one with --tokenizer DIR, or drop the flag")
    problem = tag_problem(tokenizer.hf.get_vocab())
    if problem is not None:
        raise ConfigError(f"--reasoning-parser {name}: {problem}")
    log.info("chat answers: the reasoning in <think> tags goes to reasoning_content, the rest to content "
             "(--reasoning-parser %s)", name)


def make_runner(app: web.Application, scfg: ServerConfig) -> GuardedRunner:
    """The runner of the server's app: connection limits from `scfg`, handlers cancelled when their
    client goes away (which aborts the engine request), no access log (one line per request instead)."""
    return GuardedRunner(app, header_timeout_s=scfg.header_timeout_s, max_connections=scfg.max_connections,
                         handler_cancellation=True, access_log=None, keepalive_timeout=scfg.keepalive_timeout_s,
                         shutdown_timeout=END_WAIT_S)


def serving_tokenizer(ecfg: EngineConfig, scfg: ServerConfig,
                      source: ModelSource) -> tuple[EngineConfig, Tokenizer | None]:
    """The router's tokenizer (with --chat-template's template instead of the model's), and `ecfg` with the
    tokenizer's EOS ids added to the model's (the set generation stops on). A ConfigError when a template
    is given for a model without a tokenizer."""
    from rapidserve.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_source(source, chat_template=scfg.chat_template)
    if tokenizer is None and scfg.chat_template is not None:
        raise ConfigError(f"--chat-template: model {ecfg.model!r} has no tokenizer to render chats with; give it "
                          "one with --tokenizer DIR, or drop the flag")
    if tokenizer is None:  # presets: token ids in and out (text prompts get 400, outputs carry token_ids)
        log.warning("model %r has no tokenizer: serving token-id prompts only on /v1/completions and /generate",
                    ecfg.model)
        return ecfg, None
    merged = tuple(dict.fromkeys(ecfg.model_config.eos_token_ids + tokenizer.eos_token_ids))
    ecfg = dataclasses.replace(ecfg, model_config=ecfg.model_config.replace(eos_token_ids=merged))
    if scfg.chat_template is not None:
        log.info("chat template: the one given by --chat-template (%d characters), not the model's",
                 len(scfg.chat_template))
    return ecfg, tokenizer


Build = Callable[[], "tuple[EngineConfig, ModelSource]"]
StartEngine = Callable[[EngineConfig], Awaitable[Any]]


async def serve(scfg: ServerConfig, build: Build, sockets: list[socket.socket], model_spec: str | None = None,
                t0: float | None = None, start: StartEngine | None = None) -> int:
    """Serve on `sockets` (bound already): the start-up gate at once, then `build()` (the config tree and the
    model's source: a bad flag or model raises ConfigError / ModelLoadError), the tokenizer, `start(ecfg)` (the
    engine: start_engine), then the server proper until a signal or the engine gives up. `t0`: when the process
    started (time.monotonic()), for the "ready in" line. Returns the exit code. From the first line to the last
    (the start-up gate included, not only while the server proper runs) no log record carries the API key or an
    Authorization value (server/redact.py)."""
    undo = install(Redactor([scfg.api_key] if scfg.api_key is not None else []))
    try:
        return await _serve(scfg, build, sockets, model_spec, t0, start)
    finally:
        undo()


async def _serve(scfg: ServerConfig, build: Build, sockets: list[socket.socket], model_spec: str | None,
                 t0: float | None, start: StartEngine | None) -> int:
    t0 = time.monotonic() if t0 is None else t0
    gate = StartupGate()
    await gate.open(make_runner(gate.app(), scfg), sockets)
    where = ", ".join(f"http://{_address(s)}" for s in sockets)
    log.info("listening on %s; /health answers 503 \"starting\" until the engine is ready", where)
    warn_if_exposed(scfg)
    start_fork_server()  # the workers' fork server imports torch beside this process's start-up
    warming: asyncio.Future[None] | None = None
    try:
        gate.set_step("loading the engine's code (torch), reading the model's configuration and, on a GPU with no "
                      "partition profile for it, measuring one (auto-profile, under a minute)")
        ecfg, source = await off_loop(build)
        Server = await off_loop(_server_code)
        gate.set_step(f"loading the tokenizer ({source.description})")
        ecfg, tokenizer = await off_loop(functools.partial(serving_tokenizer, ecfg, scfg, source))
        log.info("%s", ecfg.generation.describe())
        names = served_names(scfg, ecfg, model_spec)
        tool_parser = auto_tool_parser(scfg, ecfg, tokenizer)  # a bad flag fails before the workers start
        check_reasoning_parser(scfg, tokenizer)
        trials = None if tokenizer is None else _grammar_trials(ecfg, tokenizer)
        # the grammar engine's view of the tokenizer (seconds, mostly GIL): loaded while the engine starts
        if trials is not None:
            warming = asyncio.ensure_future(off_loop(trials.warm))
        policy = policy_line(ecfg.launch.mode, ecfg.partition.policy, ecfg.partition.mode, ecfg.partition.slo_itl_ms)
        gate.set_step(f"starting the engine ({ecfg.launch.mode} mode, {policy}): its workers load the "
                      "weights, size the KV cache and capture graphs (each logs its steps)")
        engine = await (start or start_engine)(ecfg)
        if warming is not None:
            await warming
    except BaseException:
        if warming is not None:
            warming.cancel()
        await gate.close()
        raise
    for line in engine.events:
        log.info("%s", line)
    ecfg = fitted_max_model_len(ecfg, engine.context_cap) if ecfg.scheduler.fit_max_model_len else ecfg
    server = Server(scfg, ecfg, engine, tokenizer, names[0], tool_parser, aliases=names[1:], trials=trials)
    runner = make_runner(server.app(), scfg)
    await runner.setup()
    port = sockets[0].getsockname()[1]
    await gate.stop_accepting()  # from here new connections wait in the backlog for the server proper
    sites = [web.SockSite(runner, sock) for sock in sockets]
    for site in sites:
        await site.start()
    await gate.close()
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
    # readiness only once SIGTERM / SIGINT are ours: a supervisor that signals on this line gets the graceful stop
    print(f"rapidserve: serving {names[0]} on http://{scfg.host}:{port} (ready in {time.monotonic() - t0:.1f} s)",
          flush=True)  # counted from the process's start
    await _first(stop, engine.fatal)
    fatal = engine.fatal.is_set() and not stop.is_set()

    server.draining = True
    for site in sites:
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


def fitted_max_model_len(ecfg: EngineConfig, context_cap: int) -> EngineConfig:
    """--max-model-len auto: `ecfg` with the length the engine's KV pool allows (`context_cap`) as its
    max_model_len, the one the server checks requests against and reports (/v1/models, the metrics' buckets)."""
    if context_cap >= ecfg.max_model_len:
        return ecfg
    log.info("--max-model-len auto: max_model_len %d (what the KV cache holds; the model's is %d)", context_cap,
             ecfg.max_model_len)
    sched = dataclasses.replace(ecfg.scheduler, max_model_len=context_cap, fit_max_model_len=False)
    return dataclasses.replace(ecfg, scheduler=sched)


async def start_engine(ecfg: EngineConfig, profile: Profile | None = None) -> AsyncEngine | DataParallelEngine:
    """One engine, or with `--data-parallel-size N` (N > 1) N of them behind this router. `profile`: the file
    `ecfg.partition.profile` names, parsed once at start-up (cli_serve: the flag check's read), which every
    decode worker checks against its GPU instead of parsing the file again."""
    from rapidserve.engine.client import AsyncEngine
    from rapidserve.engine.data_parallel import DataParallelEngine

    if ecfg.parallel.data_parallel_size > 1:
        return await DataParallelEngine.start(ecfg, profile=profile)
    return await AsyncEngine.start(ecfg, profile=profile)


async def _first(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Wait until one of `events` is set (or `timeout` seconds)."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()


def _server_code() -> type[Server]:
    """The server's class (its imports take seconds: run off the event loop, which answers meanwhile)."""
    from rapidserve.server.app import Server

    return Server


def _grammar_trials(ecfg: EngineConfig, tokenizer: Tokenizer) -> GrammarTrials:
    """The admission trials of structured-output constraints (server/app.py's `grammar_trials`; its module is
    loaded already, by `_server_code`)."""
    from rapidserve.server.app import grammar_trials

    return grammar_trials(ecfg, tokenizer)


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def run(scfg: ServerConfig, build: Build, model_spec: str | None = None, start: StartEngine | None = None) -> int:
    """`rapidserve serve` after its flags are checked: logging, the port (BindError at once when it cannot be
    bound, before anything is loaded), then `serve`. `build` runs on a thread while the port answers 503; `start`:
    how the engine starts (None: start_engine)."""
    configure_logging(scfg.log_level, scfg.http_log_level, scfg.log_requests)
    t0 = time.monotonic() - process_age_s()
    sockets = bind_sockets(scfg.host, scfg.port)
    try:
        return asyncio.run(serve(scfg, build, sockets, model_spec, t0, start))
    finally:
        for sock in sockets:
            sock.close()
