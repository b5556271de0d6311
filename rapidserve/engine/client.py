"""`AsyncEngine`: the router side of the RAPID engine, used by the HTTP server and the tests.

    engine = await AsyncEngine.start(cfg)
    async for tok in engine.generate(req_id, prompt_token_ids, params):   # TokenOut, in order
        ...
    await engine.abort(req_id)
    await engine.shutdown()

A collector thread sleeps on the router's doorbell, reads both inbox rings and hands messages to the
event loop; tokens are delivered in index order (the first token comes from prefill, the rest from
decode, on different rings). Every 0.2 s it also checks the workers: when one dies, every in-flight
request ends with `EngineError` at once, the other worker is stopped, shared memory is unlinked,
and the engine restarts its workers (`on_worker_death="restart"`, up to `max_restarts`) or stays
down. Nothing blocks forever: a request on a dead engine fails immediately.
In hybrid mode (`LaunchConfig.mode`) there is one worker (`engine/hybrid_worker.py`) and one inbox
ring; the same supervision applies to it.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import signal
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.launch import WorkerSet
from rapidserve.engine.mps import MpsController, MpsPlan
from rapidserve.ipc import wait_any
from rapidserve.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The request could not be completed: a worker died, the engine is down, or it was refused."""


@dataclass
class _Stream:
    queue: asyncio.Queue[m.TokenOut | BaseException | None]
    next_index: int = 0
    early: dict[int, m.TokenOut] = field(default_factory=dict)
    finished: bool = False
    aborted: bool = False  # no token is yielded after an abort, even one queued before it


class AsyncEngine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.loop: asyncio.AbstractEventLoop | None = None
        self.workers: WorkerSet | None = None
        self.streams: dict[str, _Stream] = {}
        self.stats: m.Stats | None = None
        self.mps = MpsController()
        self.mps_plan: MpsPlan | None = None
        self.restarts = 0
        self.dead_reason: str | None = None
        self.events: list[str] = []  # supervision log: starts, deaths, restarts
        self._collector: threading.Thread | None = None
        self._stop_collector = threading.Event()
        self._closing = False

    # ---- life cycle -------------------------------------------------------------------------
    @classmethod
    async def start(cls, cfg: EngineConfig) -> AsyncEngine:
        self = cls(cfg)
        self.loop = asyncio.get_running_loop()
        await self._start_workers()
        atexit.register(self._shutdown_sync)
        _exit_on_sigterm()
        return self

    async def _start_workers(self) -> None:
        assert self.loop is not None
        platform = "cpu" if self.cfg.runner.device == "cpu" else _gpu_platform()
        if self.mps_plan is None and self.cfg.launch.mode == "hybrid":  # one process: nothing to share
            self.mps_plan = MpsPlan("off", False, False, None, None, "hybrid mode: one worker process, no MPS")
        if self.mps_plan is None:
            import tempfile

            self.mps_plan = self.mps.start(self.cfg.launch.mps, platform, tempfile.mkdtemp(prefix="rapidserve-mps-"))
            self.events.append(self.mps_plan.reason)
        env = self.mps_plan.worker_env()
        self.workers = await self.loop.run_in_executor(None, WorkerSet.start, self.cfg, env)
        self.dead_reason = None
        self.events.append(f"workers ready: {sorted(self.workers.ready)}")
        self._stop_collector.clear()
        self._collector = threading.Thread(target=self._collect, name="rapidserve-collector", daemon=True)
        self._collector.start()

    async def shutdown(self) -> None:
        self._closing = True
        await asyncio.get_running_loop().run_in_executor(None, self._teardown, True)
        self._fail_all(EngineError("the engine is shutting down"))
        self.mps.stop()

    def _shutdown_sync(self) -> None:
        if not self._closing:
            self._closing = True
            self._teardown(True)
            self.mps.stop()

    def _teardown(self, graceful: bool) -> None:
        self._stop_collector.set()
        if self._collector is not None and self._collector is not threading.current_thread():
            self._collector.join(2.0)
        ws, self.workers = self.workers, None
        if ws is not None:
            ws.stop(graceful=graceful)

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, req_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[m.TokenOut]:
        """Tokens of one request in order; the last carries finish_reason. Raises EngineError."""
        if self.workers is None:
            raise EngineError(f"the engine is not running: {self.dead_reason or 'not started'}")
        if req_id in self.streams:
            raise EngineError(f"request id {req_id!r} is already in flight")
        stream = _Stream(asyncio.Queue())
        self.streams[req_id] = stream
        msg = m.NewRequest(req_id, list(prompt_token_ids), params, time.monotonic())
        self.workers.send_request(msg)
        try:
            while True:
                item = await stream.queue.get()
                if item is None or stream.aborted:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finish_reason is not None:
                    return
        finally:
            if not stream.finished:  # the consumer went away early (client disconnect): abort
                await self.abort(req_id)
            self.streams.pop(req_id, None)

    async def abort(self, req_id: str) -> None:
        s = self.streams.get(req_id)
        if s is not None and not s.finished and self.workers is not None:
            s.finished = s.aborted = True
            self.workers.send["r2d"].send(m.Abort(req_id))
            s.queue.put_nowait(None)

    # ---- collector thread -------------------------------------------------------------------
    def _collect(self) -> None:
        ws, loop = self.workers, self.loop
        assert ws is not None and loop is not None
        receivers = list(ws.recv.values())
        while not self._stop_collector.is_set():
            wait_any(receivers, ws.doorbells["router"], 0.2)
            msgs: list[Any] = []
            for r in receivers:
                msgs.extend(r.drain())
            if msgs:
                loop.call_soon_threadsafe(self._dispatch, msgs)
            dead = ws.dead_worker()
            if dead is not None and not self._stop_collector.is_set():
                code = ws.procs[dead].exitcode
                loop.call_soon_threadsafe(self._on_death, dead, code)
                return

    def _dispatch(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, m.TokenBatch):
                for t in msg.tokens:
                    self._deliver(t)
            elif isinstance(msg, m.Finished):
                s = self.streams.get(msg.req_id)
                if s is not None and not s.finished:
                    s.finished = True
                    err = EngineError(msg.message or msg.reason) if msg.reason == "error" else None
                    s.queue.put_nowait(err)
            elif isinstance(msg, m.Stats):
                self.stats = msg
            elif isinstance(msg, m.WorkerError):
                self.events.append(f"{msg.worker} worker error: {msg.message.splitlines()[0]}")

    def _deliver(self, t: m.TokenOut) -> None:
        s = self.streams.get(t.req_id)
        if s is None or s.finished:
            return
        s.early[t.index] = t
        while s.next_index in s.early:
            tok = s.early.pop(s.next_index)
            s.next_index += 1
            s.queue.put_nowait(tok)
            if tok.finish_reason is not None:
                s.finished = True
                return

    def _fail_all(self, err: EngineError) -> None:
        for s in self.streams.values():
            if not s.finished:
                s.finished = True
                s.queue.put_nowait(err)

    def _on_death(self, who: str, exitcode: int | None) -> None:
        reason = f"the {who} worker died (exit code {exitcode})"
        self.events.append(reason)
        self.dead_reason = reason
        self._fail_all(EngineError(reason))
        self._teardown(graceful=False)
        if self._closing:
            return
        if self.cfg.launch.on_worker_death == "restart" and self.restarts < self.cfg.launch.max_restarts:
            self.restarts += 1
            self.events.append(f"restarting workers ({self.restarts}/{self.cfg.launch.max_restarts})")
            assert self.loop is not None
            self.loop.create_task(self._restart())

    async def _restart(self) -> None:
        try:
            await self._start_workers()
        except Exception as e:  # noqa: BLE001 - report and stay down
            self.dead_reason = f"restart failed: {e}"
            self.events.append(self.dead_reason)

    @property
    def running(self) -> bool:
        return self.workers is not None


def _exit_on_sigterm() -> None:
    """SIGTERM ends the process through normal exit (so atexit stops the workers and unlinks shared
    memory), unless the application installed its own handler. SIGINT already raises
    KeyboardInterrupt; the workers ignore it and are stopped by the router in order."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        def _term(signum: int, frame: object) -> None:
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, _term)


def _gpu_platform() -> str:
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return "rocm" if torch.version.hip else "cuda"


@contextlib.asynccontextmanager
async def engine(cfg: EngineConfig) -> AsyncIterator[AsyncEngine]:
    e = await AsyncEngine.start(cfg)
    try:
        yield e
    finally:
        await e.shutdown()
