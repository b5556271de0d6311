"""`AsyncEngine`: the router side of the RAPID engine, used by the HTTP server and the tests.

    engine = await AsyncEngine.start(cfg)
    async for tok in engine.generate(req_id, prompt_token_ids, params):   # TokenOut, in order
        ...
    await engine.abort(req_id)
    await engine.shutdown()

A collector thread sleeps on the router's doorbell, reads the inbox rings and hands messages to the
event loop; tokens are delivered in index order. It also supervises the workers:
- death: a worker process that exits is noticed within 0.2 s;
- hang: a worker that sends nothing (Stats / Heartbeat come every `stats_interval_s`) for
  `heartbeat_timeout_s` is killed and handled as a death.
What follows a death (every in-flight request fails with `EngineError` at once; the workers restart within a
windowed budget, or the engine gives up and sets `fatal`) and the engine's states: engine/supervision.py, a base
class of `AsyncEngine`. What a request fails with: engine/errors.py. Nothing blocks forever: a
request on an engine that is not ready fails immediately, and the event loop never waits on a full
ring (`_put`).

A new request goes to one place, the decode worker's inbox (or the hybrid worker's, in hybrid mode:
`LaunchConfig.mode`); decode hands it to prefill with its blocks. Its prompt is checked here first
(`rapidserve/prompt.py`; the KV pool's capacity comes from the worker's Ready). Tokens come back
from decode (and a first token that ends a request, from prefill). The same supervision applies in
both modes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import functools
import signal
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.engine.errors import ConstraintFailed, EngineError, RequestRejected
from rapidserve.engine.kv_publisher import KVEventPublisher
from rapidserve.engine.launch import WorkerSet
from rapidserve.engine.mps import MpsController, MpsPlan
from rapidserve.engine.supervision import WorkerSupervision
from rapidserve.ipc import wait_any
from rapidserve.prompt import PromptError, PromptLimits
from rapidserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rapidserve.partition.profile import Profile

INBOX_WAIT_S = 5.0  # how long a new request may wait for room in a worker's inbox ring


def _error_of(msg: m.Finished) -> EngineError | None:
    """What a request's stream raises when it ends with `msg` (None: an ordinary end)."""
    if msg.reason != "error":
        return None
    if msg.fault == m.STRUCTURED_FAULT:
        return ConstraintFailed(msg.message)
    return EngineError(msg.message or msg.reason)


@dataclass
class _Stream:
    queue: asyncio.Queue[m.TokenOut | BaseException | None]
    next_index: int = 0
    early: dict[int, m.TokenOut] = field(default_factory=dict)
    finished: bool = False
    aborted: bool = False  # no token is yielded after an abort, even one queued before it


class AsyncEngine(WorkerSupervision):
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        # cfg.partition.profile parsed at start-up (the CLI's flag check), handed to every start and restart of the
        # decode worker, which then does not parse the file again; None: the worker reads it (or finds one) itself.
        self.profile: Profile | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.workers: WorkerSet | None = None
        self.streams: dict[str, _Stream] = {}
        # Aborted requests whose end (Finished, or a token with a finish reason) has not come back yet:
        # their ids are refused until it does, so a late message of the old request never reaches a new
        # one (the workers hold the id as long: engine/decode_scheduler.py). Cleared with the workers.
        self._settling: set[str] = set()
        self.stats: m.Stats | None = None
        self.heartbeat: m.Heartbeat | None = None  # the prefill worker's latest
        self.mps = MpsController()
        self.mps_plan: MpsPlan | None = None
        self.state = "starting"  # starting | ready | restarting | down
        self.restarts_total = 0  # restarts that brought the engine back
        self.deaths_total = 0  # worker deaths and hangs noticed
        self.fatal = asyncio.Event()  # set when the engine gives up for good (see the module doc)
        self.dead_reason: str | None = None
        self.events: list[str] = []  # supervision log: starts, deaths, restarts
        self._restart_times: deque[float] = deque()
        self._recovery: asyncio.Task[None] | None = None
        self._collector: threading.Thread | None = None
        self._stop_collector = threading.Event()
        self._closing = False
        # --kv-events-config: publishes the KV events the engine worker sends (engine/kv_publisher.py)
        self.kv_publisher: KVEventPublisher | None = None

    # ---- life cycle -------------------------------------------------------------------------
    @classmethod
    async def start(cls, cfg: EngineConfig, mps_plan: MpsPlan | None = None,
                    profile: Profile | None = None) -> AsyncEngine:
        """Start the workers. `mps_plan`: how they reach an MPS daemon someone else owns (data
        parallelism: one daemon for every engine); None: this engine settles MPS itself. `profile`: the file
        `cfg.partition.profile` names, parsed already (profile.read_profile), for the decode worker's plan."""
        self = cls(cfg)
        self.mps_plan = mps_plan
        self.profile = profile
        self.loop = asyncio.get_running_loop()
        if cfg.kv_events.publishing:  # its socket first: an address in use fails before the workers load
            self.kv_publisher = KVEventPublisher(cfg.kv_events)
        try:
            await self._start_workers()
        except BaseException:
            self._close_publisher()
            raise
        atexit.register(self._shutdown_sync)
        _exit_on_sigterm()
        return self

    async def _start_workers(self) -> None:
        assert self.loop is not None
        platform = "cpu" if self.cfg.runner.device == "cpu" else gpu_platform()
        if platform != "cpu" and self.cfg.runner.device == "auto":
            # The workers use the GPU found here: left at "auto", a worker that cannot reach it (an MPS daemon
            # that sees other GPUs than CUDA_VISIBLE_DEVICES names) would quietly run the model on the CPU.
            self.cfg = dataclasses.replace(self.cfg, runner=dataclasses.replace(self.cfg.runner, device="cuda"))
        if self.mps_plan is None and self.cfg.launch.mode in ("hybrid", "disagg"):  # nothing shares a GPU
            why = "one worker process" if self.cfg.launch.mode == "hybrid" else "one worker per GPU"
            self.mps_plan = MpsPlan("off", False, False, None, None, f"{self.cfg.launch.mode} mode: {why}, no MPS")
        if self.mps_plan is None:
            import tempfile

            self.mps_plan = self.mps.start(self.cfg.launch.mps, platform, tempfile.mkdtemp(prefix="rapidserve-mps-"))
            self.events.append(self.mps_plan.reason)
        env = self.mps_plan.worker_env()
        self.workers = await self.loop.run_in_executor(
            None, functools.partial(WorkerSet.start, self.cfg, env, profile=self.profile))
        self.dead_reason = None
        self.state = "ready"
        pids = ", ".join(f"{who} pid {p.pid}" for who, p in self.workers.procs.items())
        self.events.append(f"workers ready: {sorted(self.workers.ready)} ({pids})")
        for role, ready in sorted(self.workers.ready.items()):
            if "partition" in ready.info:
                self.events.append(f"{role} partition: {ready.info['partition']}")
            if "weight_bytes" in ready.info:
                self.events.append(f"{role} memory: {memory_split(ready.info)}")
        self._stop_collector.clear()
        self._collector = threading.Thread(target=self._collect, name="rapidserve-collector", daemon=True)
        self._collector.start()

    async def shutdown(self) -> None:
        self._closing = True
        self.state = "down"
        if self._recovery is not None:  # a teardown or restart under way finishes first
            await asyncio.gather(self._recovery, return_exceptions=True)
            self.state = "down"
        await asyncio.get_running_loop().run_in_executor(None, self._teardown, True)
        self._fail_all(EngineError("the engine is shutting down"))
        self.mps.stop()
        self._close_publisher()

    def _close_publisher(self) -> None:
        pub, self.kv_publisher = self.kv_publisher, None
        if pub is not None:
            pub.close()

    def _shutdown_sync(self) -> None:
        if not self._closing:
            self._closing = True
            self.state = "down"
            self._teardown(True)
            self.mps.stop()
            self._close_publisher()

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
        """Tokens of one request in order; the last carries finish_reason. Raises EngineError (the
        engine is not ready, or failed the request; RequestRejected: a prompt it cannot serve)."""
        if self.workers is None or self.state != "ready":
            raise EngineError(f"the engine is not running ({self.state}): {self.dead_reason or 'not started'}")
        if req_id in self.streams:
            raise EngineError(f"request id {req_id!r} is already in flight")
        if req_id in self._settling:
            raise EngineError(f"request id {req_id!r} was aborted a moment ago and is still ending: "
                              "use a unique id per request")
        limits = PromptLimits(self.cfg.model_config.vocab_size, self.cfg.max_model_len, self.workers.pool_tokens)
        try:
            limits.check(prompt_token_ids, "prompt_token_ids")
            limits.check_params(params)
        except PromptError as e:
            raise RequestRejected(str(e)) from None
        if limits.context_cap < min(self.cfg.max_model_len, self.workers.engine_pool_tokens):
            params = limits.within_cap(params, len(prompt_token_ids))  # the engine worker's own cap is larger
        stream = _Stream(asyncio.Queue())
        self.streams[req_id] = stream
        try:  # to the decode (or hybrid) worker alone: it hands the request to prefill with its blocks
            await self._put(m.NewRequest(req_id, list(prompt_token_ids), params, time.monotonic()))
        except BaseException:
            self.streams.pop(req_id, None)
            raise
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
        """End `req_id`'s stream: nothing more is yielded, not even tokens queued before the abort (a request the
        worker already finished, whose last tokens the consumer has not read yet, included: it is not told, there is
        nothing to stop there)."""
        s = self.streams.get(req_id)
        if s is None or s.aborted:
            return
        if not s.finished and self.workers is not None:
            s.finished = True
            if not any(t.finish_reason is not None for t in s.early.values()):  # its end has not come yet
                self._settling.add(req_id)
            self._post_abort(req_id)
        s.aborted = True
        s.queue.put_nowait(None)

    async def _put(self, msg: m.NewRequest | m.Abort) -> None:
        """Send without ever blocking the event loop: a full ring (a busy or hung reader) is retried
        asynchronously, and after INBOX_WAIT_S, or once the engine is not ready, it is an EngineError."""
        ws = self.workers
        deadline = time.monotonic() + INBOX_WAIT_S
        while ws is None or not (ws.submit(msg) if isinstance(msg, m.NewRequest) else ws.abort(msg.req_id)):
            if ws is None or ws is not self.workers or self.state != "ready" or time.monotonic() > deadline:
                raise EngineError(f"the engine did not take the request within {INBOX_WAIT_S:g} s "
                                  f"({self.state}: {self.dead_reason or 'its inbox is full'})")
            await asyncio.sleep(0.002)

    def _post_abort(self, req_id: str) -> None:
        """Tell decode to abort `req_id`, now if its inbox has room, else from a task."""
        ws = self.workers
        if ws is None or ws.abort(req_id):
            return
        assert self.loop is not None
        task = self.loop.create_task(self._put(m.Abort(req_id)))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a dead engine forgets it anyway

    # ---- collector thread -------------------------------------------------------------------
    def _collect(self) -> None:
        ws, loop = self.workers, self.loop
        assert ws is not None and loop is not None
        receivers = list(ws.recv.values())
        bound = heartbeat_bound(self.cfg)
        last_heard = {label: time.monotonic() for label in ws.recv}
        hung: dict[str, float] = {}
        while not self._stop_collector.is_set():
            wait_any(receivers, ws.doorbells["router"], 0.2)
            msgs: list[Any] = []
            now = time.monotonic()
            for label, r in ws.recv.items():
                got = r.drain()
                if got:
                    last_heard[label] = now
                    msgs.extend(got)
            if msgs:
                loop.call_soon_threadsafe(self._dispatch, msgs)
            for label, t in last_heard.items():
                who = ws.writer_of(label)
                if now - t > bound and who not in hung and ws.procs[who].is_alive():
                    hung[who] = now - t  # a hung worker is killed, then handled as a death
                    ws.procs[who].kill()
            dead = ws.dead_worker()
            if dead is not None and not self._stop_collector.is_set():
                p = ws.procs[dead]
                p.join(1.0)
                loop.call_soon_threadsafe(self._on_death, dead, p.pid, p.exitcode, hung.get(dead))
                return

    def _dispatch(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if isinstance(msg, m.TokenBatch):
                for t in msg.tokens:
                    if t.finish_reason is not None:
                        self._settling.discard(t.req_id)
                    self._deliver(t)
            elif isinstance(msg, m.Finished):
                self._settling.discard(msg.req_id)
                s = self.streams.get(msg.req_id)
                if s is not None and not s.finished:
                    s.finished = True
                    s.queue.put_nowait(_error_of(msg))
            elif isinstance(msg, m.Stats):
                self.stats = msg
            elif isinstance(msg, m.Heartbeat):
                self.heartbeat = msg
            elif isinstance(msg, m.KVEvents):
                if self.kv_publisher is not None:
                    self.kv_publisher.publish(msg.events)
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
        self._settling.clear()  # the workers that held those ids are gone
        for s in self.streams.values():
            if not s.finished:
                s.finished = True
                s.queue.put_nowait(err)

    @property
    def running(self) -> bool:
        return self.workers is not None and self.state == "ready"

    @property
    def context_cap(self) -> int:
        """The longest context a request may reach: max_model_len, at most what the KV pool holds (as the engine
        worker reported it at start); max_model_len before the workers are up."""
        pool = None if self.workers is None else self.workers.pool_tokens
        return PromptLimits(self.cfg.model_config.vocab_size, self.cfg.max_model_len, pool).context_cap


def memory_split(info: dict[str, str]) -> str:
    """A worker's Ready memory figures (per GPU: each tensor-parallel rank holds the same shard sizes)."""
    gib = 1 << 30
    w, kv, own = (int(info.get(k, "0")) for k in ("weight_bytes", "kv_bytes", "device_allocated_bytes"))
    rest = f", other allocations {(own - w - kv) / gib:.2f} GiB (activations, graphs)" if own >= w + kv else ""
    return f"weights {w / gib:.2f} GiB, KV pool {kv / gib:.2f} GiB, this process allocated {own / gib:.2f} GiB{rest}"


def heartbeat_bound(cfg: EngineConfig) -> float:
    """Seconds of silence after which a worker is taken as hung (LaunchConfig.heartbeat_timeout_s)."""
    if cfg.launch.heartbeat_timeout_s is not None:
        return cfg.launch.heartbeat_timeout_s
    return 600.0 if cfg.runner.device == "cpu" or gpu_platform() == "cpu" else 60.0


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


def gpu_platform() -> str:
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
