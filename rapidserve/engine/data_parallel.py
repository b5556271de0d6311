"""`DataParallelEngine`: N independent engines behind one router (`rapidserve serve --data-parallel-size N`).

    engine = await DataParallelEngine.start(cfg)     # cfg.parallel.data_parallel_size engines
    async for tok in engine.generate(req_id, prompt_token_ids, params):
        ...
    await engine.shutdown()

Each member is a whole `AsyncEngine` (rapid or hybrid: its own worker processes, rings, KV pool and
supervision); engine i runs on GPU `cfg.parallel.gpus()[i * tp]` (its config's `runner.device` is
`cuda:<gpu>`, so the workers' `ModelRunner` selects it; on the CPU every engine runs on the CPU), and
with tensor parallelism its rank r on `gpus()[i * tp + r]` (its config's `parallel` lists those GPUs,
which the launcher's `rank_config` reads). The
members share nothing but the router's event loop and, in rapid mode on NVIDIA, one MPS control daemon
(started here, once, for all of them). The server uses this class exactly as it uses an `AsyncEngine`.

Invariants:
- A request belongs to exactly one engine, chosen when it starts (`pick_engine`: the running engine
  with the fewest requests in flight, ties to the lowest index) and fixed until its stream ends; the
  choice and the hand-over to that engine happen without an await in between, so no request is ever
  between engines. Its abort goes to that engine (`_owner`).
- `in_flight[i]` is the number of requests engine i holds (those of `_owner` that name i).
- A worker death is that engine's business alone: its requests end with `EngineError` as with one
  engine, the engine restarts, and dispatch skips it until it is running again; the others go on.
- One engine giving up for good (`fatal`: restart budget used up, `--on-worker-death shutdown`) sets
  this engine's `fatal`: the server then exits non-zero for its supervisor, as with one engine.
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import importlib
import logging
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from rapidserve.config import EngineConfig, ParallelConfig
from rapidserve.config_base import ConfigError
from rapidserve.engine import messages as m
from rapidserve.engine.client import AsyncEngine, gpu_platform
from rapidserve.engine.dp_stats import CounterCarry, combine_stats
from rapidserve.engine.errors import EngineError
from rapidserve.engine.mps import MpsController, MpsPlan
from rapidserve.engine.step_trace import trace_path
from rapidserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rapidserve.partition.profile import Profile

log = logging.getLogger("rapidserve.engine")


class Member(Protocol):
    """What this class needs of each engine (an `AsyncEngine`; tests use stand-ins)."""

    state: str
    dead_reason: str | None
    stats: m.Stats | None
    restarts_total: int
    deaths_total: int
    fatal: asyncio.Event
    events: list[str]

    @property
    def running(self) -> bool: ...

    @property
    def context_cap(self) -> int: ...

    def generate(self, req_id: str, prompt_token_ids: list[int],
                 params: SamplingParams) -> AsyncIterator[m.TokenOut]: ...

    async def abort(self, req_id: str) -> None: ...

    async def shutdown(self) -> None: ...


def pick_engine(in_flight: Sequence[int], running: Sequence[bool]) -> int | None:
    """The engine a new request goes to: among the running ones, the one with the fewest requests in
    flight, ties to the lowest index; None when no engine is running (all dead, restarting or down)."""
    best: int | None = None
    for i, (load, up) in enumerate(zip(in_flight, running, strict=True)):
        if up and (best is None or load < in_flight[best]):
            best = i
    return best


def engine_configs(cfg: EngineConfig, visible_gpus: int) -> list[EngineConfig]:
    """One config per engine. With GPUs (`visible_gpus` > 0 and a device of auto or cuda) engine i gets
    `runner.device = cuda:<gpus()[i * tp]>` and `parallel` = one replica of `tp` ranks over
    `gpus()[i * tp:(i + 1) * tp]`; on the CPU (device cpu, or auto with no GPU) every engine gets the CPU
    and a replica of `tp` ranks. Nothing below the router sees data parallelism (data_parallel_size is 1
    in every engine's config). Raises ConfigError when the GPUs asked for are not all visible."""
    par = cfg.parallel
    dp, tp = par.data_parallel_size, par.tensor_parallel_size
    device = cfg.runner.device
    on_cpu = device == "cpu" or (device == "auto" and visible_gpus == 0)
    if not on_cpu:
        gpus = par.gpus()
        if visible_gpus <= max(gpus):
            raise ConfigError(f"data_parallel_size={dp} x tensor_parallel_size={tp} needs GPUs {list(gpus)} but "
                              f"{visible_gpus} {'is' if visible_gpus == 1 else 'are'} visible; lower "
                              "--data-parallel-size, or pick GPUs with CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES")
    out = []
    for i in range(dp):
        if on_cpu:
            runner, own = dataclasses.replace(cfg.runner, device="cpu"), None
        else:
            own = par.gpus()[i * tp:(i + 1) * tp]
            runner = dataclasses.replace(cfg.runner, device=f"cuda:{own[0]}")
        kv_events = dataclasses.replace(cfg.kv_events, data_parallel_rank=i)  # its own KV events port (+ i)
        launch = cfg.launch if cfg.launch.step_trace is None else dataclasses.replace(
            cfg.launch, step_trace=trace_path(cfg.launch.step_trace, i))  # its own --step-trace file
        out.append(dataclasses.replace(cfg, runner=runner, parallel=ParallelConfig(tp, 1, own), kv_events=kv_events,
                                       launch=launch))
    return out


class DataParallelEngine:
    """N `Member` engines behind one router, dispatched least-loaded (see the module doc)."""

    def __init__(self, cfg: EngineConfig, engines: Sequence[Member], mps: MpsController | None = None,
                 mps_plan: MpsPlan | None = None) -> None:
        """Wrap engines that are already started; needs a running event loop (it watches their `fatal`)."""
        if not engines:
            raise ValueError("a DataParallelEngine needs at least one engine")
        self.cfg = cfg
        self.engines = list(engines)
        self.in_flight = [0] * len(self.engines)
        self.dispatched = [0] * len(self.engines)  # requests sent to each engine so far
        self._owner: dict[str, int] = {}  # request id -> the engine that holds it
        self._carry = [CounterCarry() for _ in self.engines]
        self.fatal = asyncio.Event()  # set when any engine gives up for good
        self._fatal_reason: str | None = None
        self._mps = mps
        self.mps_plan = mps_plan
        self._closing = False
        self._watchers = [asyncio.ensure_future(self._watch(i)) for i in range(len(self.engines))]

    # ---- life cycle -------------------------------------------------------------------------
    @classmethod
    async def start(cls, cfg: EngineConfig, profile: Profile | None = None) -> DataParallelEngine:
        """Start every engine at once (each loads its model and captures its graphs in parallel);
        if one fails to start, the others are stopped and its error is raised as it came. `profile`: the file
        `cfg.partition.profile` names, parsed once already, given to every engine (AsyncEngine.start)."""
        loop = asyncio.get_running_loop()
        platform = "cpu" if cfg.runner.device == "cpu" else await loop.run_in_executor(None, gpu_platform)
        visible = 0 if platform == "cpu" else await loop.run_in_executor(None, _gpu_count)
        configs = engine_configs(cfg, visible)
        mps, plan = MpsController(), None
        atexit.register(mps.stop)  # before the engines' own handlers, so it runs after them (LIFO)
        if platform != "cpu" and cfg.runner.device != "cpu" and cfg.launch.mode == "rapid":
            # one control daemon serves the workers of every GPU (an engine given a plan starts none)
            plan = mps.start(cfg.launch.mps, platform, tempfile.mkdtemp(prefix="rapidserve-mps-"))
        # The launcher imports torch in an executor thread; do it once here, not from N threads at once.
        await loop.run_in_executor(None, importlib.import_module, "rapidserve.engine.worker_build")
        results = await asyncio.gather(*(AsyncEngine.start(c, mps_plan=plan, profile=profile) for c in configs),
                                       return_exceptions=True)
        started = [r for r in results if not isinstance(r, BaseException)]
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            await asyncio.gather(*(e.shutdown() for e in started), return_exceptions=True)
            await loop.run_in_executor(None, mps.stop)
            for i, err in failed:
                log.error("engine %d of %d (%s) failed to start: %s", i, len(configs), configs[i].runner.device, err)
            raise failed[0][1]
        return cls(cfg, started, mps, plan)

    async def shutdown(self) -> None:
        """Stop every engine (each ends what it has in flight with EngineError), then the MPS daemon."""
        self._closing = True
        for w in self._watchers:
            w.cancel()
        await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)
        if self._mps is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._mps.stop)

    async def _watch(self, i: int) -> None:
        await self.engines[i].fatal.wait()
        if self._closing or self.fatal.is_set():
            return
        self._fatal_reason = f"engine {i}: {self.engines[i].dead_reason}"
        log.error("engine %d of %d is down for good (%s): the server stops, for its supervisor to start it "
                  "afresh", i, len(self.engines), self.engines[i].dead_reason)
        self.fatal.set()

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, req_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       placed: Callable[[int], None] | None = None) -> AsyncIterator[m.TokenOut]:
        """Tokens of one request in order, from the engine `pick_engine` chose; raises EngineError as
        `AsyncEngine.generate` does, and at once when no engine is running. `placed(i)` is told the engine's
        index once it is chosen, before the request is handed to it (the server's metrics label by it)."""
        if req_id in self._owner:
            raise EngineError(f"request id {req_id!r} is already in flight")
        i = None if self.fatal.is_set() else pick_engine(self.in_flight, [e.running for e in self.engines])
        if i is None:
            raise EngineError(f"no engine is running ({self.state}): {self.dead_reason or 'not started'}")
        if placed is not None:  # (before any bookkeeping: were it to raise, nothing is held)
            placed(i)
        self._owner[req_id] = i
        self.in_flight[i] += 1
        self.dispatched[i] += 1
        inner = self.engines[i].generate(req_id, prompt_token_ids, params)
        try:  # no await before the engine's generate runs: the request is never between engines
            async for tok in inner:
                yield tok
        finally:
            try:
                await inner.aclose()  # now, not at garbage collection: a request left early is aborted there
            finally:
                self.in_flight[i] -= 1
                del self._owner[req_id]

    async def abort(self, req_id: str) -> None:
        """Abort `req_id` on the engine that holds it (nothing if none does)."""
        i = self._owner.get(req_id)
        if i is not None:
            await self.engines[i].abort(req_id)

    def owner(self, req_id: str) -> int | None:
        """The index of the engine that holds `req_id`, or None."""
        return self._owner.get(req_id)

    # ---- what the server reads --------------------------------------------------------------
    @property
    def state(self) -> str:
        """ready while any engine can take a request (and none gave up); else restarting or starting
        while one of them will come back, down when none will."""
        states = [e.state for e in self.engines]
        if self.fatal.is_set() or all(s == "down" for s in states):
            return "down"
        for s in ("ready", "restarting", "starting"):
            if s in states:
                return s
        return "down"

    @property
    def running(self) -> bool:
        return not self.fatal.is_set() and any(e.running for e in self.engines)

    @property
    def context_cap(self) -> int:
        """The longest context a request may reach on every engine (a request may go to any)."""
        return min(e.context_cap for e in self.engines)

    @property
    def dead_reason(self) -> str | None:
        """Why engines are not ready, each named by index; None when all are."""
        if self._fatal_reason is not None:
            return self._fatal_reason
        why = [f"engine {i} {e.state}: {e.dead_reason or e.state}" for i, e in enumerate(self.engines)
               if e.state != "ready"]
        return "; ".join(why) or None

    def health(self) -> list[dict[str, object]]:
        """Per engine, for /health: its state, why it is not ready, its requests in flight and so far."""
        return [{"engine": i, "state": e.state, "reason": e.dead_reason if e.state != "ready" else None,
                 "in_flight": self.in_flight[i], "requests": self.dispatched[i]}
                for i, e in enumerate(self.engines)]

    @property
    def events(self) -> list[str]:
        """The engines' supervision logs, each line prefixed with its engine."""
        head = [self.mps_plan.reason] if self.mps_plan is not None else []
        return head + [f"engine {i}: {line}" for i, e in enumerate(self.engines) for line in e.events]

    @property
    def restarts_total(self) -> int:
        return sum(e.restarts_total for e in self.engines)

    @property
    def restarts(self) -> int:
        return self.restarts_total

    @property
    def deaths_total(self) -> int:
        return sum(e.deaths_total for e in self.engines)

    @property
    def engine_stats(self) -> list[m.Stats | None]:
        """Each engine's latest Stats, by index (the server's ``vllm:`` series label each engine's own by its
        index, as vLLM does); None for one that is not running (restarting, down: it holds no requests and no
        pool) or has not reported yet."""
        return [e.stats if e.running else None for e in self.engines]

    @property
    def stats(self) -> m.Stats | None:
        """The engines' Stats as one (dp_stats.combine_stats: counters summed and kept monotonic across
        one engine's restart; gauges summed over the running engines): the server's ``rapidserve:`` series."""
        now = [e.stats for e in self.engines]
        self._carry = [c.advance(s) for c, s in zip(self._carry, now, strict=True)]
        return combine_stats(now, [e.running for e in self.engines], self._carry)


def _gpu_count() -> int:
    import torch

    return int(torch.cuda.device_count())
