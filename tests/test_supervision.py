"""Engine supervision on CPU (a tiny preset, so a restart takes ~2 s): deaths and hangs are noticed,
in-flight requests fail at once, the workers come back within a windowed restart budget, past it the
engine gives up (`fatal`), and nothing is left in /dev/shm (no `sem.mp-*` either)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

import pytest

from rapidserve import SamplingParams
from rapidserve.config_base import ConfigError
from rapidserve.engine.client import AsyncEngine
from rapidserve.engine.errors import EngineError
from rapidserve.engine.supervision import describe_exit
from rapidserve.launch_config import LaunchConfig
from rapidserve.llm import build_engine_config
from tests.test_soak import sp


def config(**launch: object) -> object:
    """LONG requests run past tiny-llama's 1024 positions: allowed (random weights: no text to spoil)."""
    cfg, _ = build_engine_config("preset:tiny-llama", device="cpu", dtype="float32", num_kv_blocks=512,
                                 max_model_len=8192, allow_long_max_model_len=True)
    return dataclasses.replace(cfg, launch=LaunchConfig(mps="off", **launch))  # type: ignore[arg-type]


def mp_semaphores() -> set[str]:
    return {f for f in os.listdir("/dev/shm") if f.startswith("sem.mp-")}


def left_semaphores(before: set[str]) -> set[str]:
    """sem.mp-* made since `before` that no process but this one holds (the engine's workers are gone by then):
    a named semaphore another test's process has mapped (under pytest-xdist, beside this one) is not ours."""
    new = mp_semaphores() - before
    return new - sp.held_elsewhere(new, [os.getpid()])


LONG = 8000  # tokens: a request still running when its worker is killed


async def collect(engine: AsyncEngine, rid: str, n: int, started: asyncio.Event | None = None) -> int:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    count = 0
    async for _ in engine.generate(rid, [1, 2, 3, 4], params):
        count += 1
        if started is not None:
            started.set()
    return count


async def start_long(engine: AsyncEngine, rid: str) -> asyncio.Task[int]:
    """A long request, returned once its first token has arrived."""
    started = asyncio.Event()
    task = asyncio.create_task(collect(engine, rid, LONG, started))
    await asyncio.wait_for(started.wait(), 30)
    return task


async def wait_for(pred: object, timeout: float) -> float:
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < timeout:  # type: ignore[operator]
        await asyncio.sleep(0.02)
    assert pred(), f"not within {timeout} s"  # type: ignore[operator]
    return time.monotonic() - t0


def test_ten_deaths_in_a_row_each_recovered() -> None:
    async def main() -> None:
        before = mp_semaphores()
        engine = await AsyncEngine.start(config(max_restarts=10, restart_window_s=600))  # type: ignore[arg-type]
        try:
            for i in range(10):
                victim = ("decode", "prefill")[i % 2]
                task = await start_long(engine, f"r{i}")
                os.kill(engine.workers.procs[victim].pid, signal.SIGKILL)  # type: ignore[union-attr,arg-type]
                t0 = time.monotonic()
                with pytest.raises(EngineError, match=f"the {victim} worker died \\(killed by SIGKILL"):
                    await asyncio.wait_for(task, 5.0)
                assert time.monotonic() - t0 < 2.0
                assert engine.state in ("restarting", "ready")
                await wait_for(lambda: engine.state == "ready", 60)
                assert await collect(engine, f"after{i}", 3) == 3
            assert engine.restarts_total == 10 and engine.deaths_total == 10 and not engine.fatal.is_set()
            assert sum("workers restarted in" in e for e in engine.events) == 10
        finally:
            await engine.shutdown()
        assert not left_semaphores(before)  # the start-up hand-off leaves no named semaphore behind

    asyncio.run(main())


def test_restart_budget_per_window_then_gives_up() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(config(max_restarts=2, restart_window_s=600))  # type: ignore[arg-type]
        try:
            for _ in range(2):
                os.kill(engine.workers.procs["decode"].pid, signal.SIGKILL)  # type: ignore[union-attr,arg-type]
                await wait_for(lambda: engine.state != "ready", 3)
                await wait_for(lambda: engine.state == "ready", 60)
            os.kill(engine.workers.procs["prefill"].pid, signal.SIGKILL)  # type: ignore[union-attr,arg-type]
            await asyncio.wait_for(engine.fatal.wait(), 10)
            assert engine.state == "down" and not engine.running and engine.restarts_total == 2
            assert engine.dead_reason is not None and "restart budget used up (2 in 600 s)" in engine.dead_reason
            with pytest.raises(EngineError, match="not running \\(down\\)"):
                await collect(engine, "refused", 2)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_restart_budget_window_slides() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(config(max_restarts=1, restart_window_s=3))  # type: ignore[arg-type]
        try:
            for _ in range(2):  # one restart per window: the second comes after the first left the window
                os.kill(engine.workers.procs["decode"].pid, signal.SIGKILL)  # type: ignore[union-attr,arg-type]
                await wait_for(lambda: engine.state != "ready", 3)
                await wait_for(lambda: engine.state == "ready", 60)
                await asyncio.sleep(3.2)
            assert engine.restarts_total == 2 and not engine.fatal.is_set()
        finally:
            await engine.shutdown()

    asyncio.run(main())


@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_stopped_worker_is_detected_within_the_heartbeat_bound(victim: str) -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(config(heartbeat_timeout_s=3.0))  # type: ignore[arg-type]
        try:
            task = await start_long(engine, "stalled")
            pid = engine.workers.procs[victim].pid  # type: ignore[union-attr]
            os.kill(pid, signal.SIGSTOP)  # type: ignore[arg-type]
            took = await wait_for(lambda: engine.state != "ready", 6)
            assert took <= 3.0 + 0.6  # the bound, plus the collector's 0.2-s tick and slack
            with pytest.raises(EngineError, match=f"the {victim} worker stopped responding"):
                await asyncio.wait_for(task, 2.0)
            await wait_for(lambda: engine.state == "ready", 60)
            assert await collect(engine, "after", 3) == 3
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_idle_workers_are_not_taken_as_hung() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(config(heartbeat_timeout_s=2.5))  # type: ignore[arg-type]
        try:
            await asyncio.sleep(4.0)  # idle longer than the bound: heartbeats keep coming
            assert engine.state == "ready" and engine.deaths_total == 0
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_heartbeat_bound_must_exceed_the_stats_interval() -> None:
    with pytest.raises(ConfigError, match="heartbeat_timeout_s"):
        LaunchConfig(heartbeat_timeout_s=1.0, stats_interval_s=0.25)
    with pytest.raises(ConfigError, match="max_restarts"):
        LaunchConfig(max_restarts=-1)


@pytest.mark.parametrize("code, text", [(None, "no exit code"), (1, "exit code 1"), (-9, "killed by SIGKILL"),
                                        (-15, "killed by SIGTERM"), (-200, "killed by signal 200")])
def test_describe_exit(code: int | None, text: str) -> None:
    assert describe_exit(code) == text


def test_shared_memory_is_private_to_the_user() -> None:
    async def main() -> None:
        engine = await AsyncEngine.start(config())  # type: ignore[arg-type]
        try:
            mine = [f for f in os.listdir("/dev/shm") if f"rapidserve-{os.getpid()}-" in f]
            from rapidserve.engine.worker_io import DOORBELLS, RING_TYPES

            assert len(mine) == 3 * len(RING_TYPES) + len(DOORBELLS)  # rings, their 2 semaphores each, doorbells
            for f in mine:
                assert os.stat(f"/dev/shm/{f}").st_mode & 0o777 == 0o600, f
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_no_pickle_on_the_rings() -> None:
    """Every ring carries a union of declared msgspec Structs (msgpack on the wire); the package never
    imports pickle (the one-time start-up hand-off of IPC handles goes through multiprocessing)."""
    import ast
    import pathlib

    import msgspec

    from rapidserve.engine.worker_io import RING_TYPES

    for label, wire in RING_TYPES.items():
        for t in getattr(wire.types, "__args__", (wire.types,)):
            assert isinstance(t, type) and issubclass(t, msgspec.Struct), (label, t)
    root = pathlib.Path(__file__).resolve().parents[1] / "rapidserve"
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] in ("pickle", "cloudpickle", "dill") for n in names), path


def test_a_full_inbox_never_blocks_the_event_loop() -> None:
    """A hung prefill stops draining its inbox; with a tiny ring it fills at once. New requests wait
    for room asynchronously and fail with EngineError; the loop stays responsive, so the hang is
    handled (killed, restarted) as usual."""
    async def main() -> None:
        engine = await AsyncEngine.start(config(heartbeat_timeout_s=3.0, ring_slots=8))  # type: ignore[arg-type]
        try:
            os.kill(engine.workers.procs["prefill"].pid, signal.SIGSTOP)  # type: ignore[union-attr,arg-type]
            tasks = [asyncio.create_task(collect(engine, f"q{i}", 4)) for i in range(40)]
            worst, t0 = 0.0, time.monotonic()
            while not all(t.done() for t in tasks) and time.monotonic() - t0 < 20:
                t = time.monotonic()
                await asyncio.sleep(0.01)
                worst = max(worst, time.monotonic() - t)
            assert all(t.done() for t in tasks)
            assert worst < 0.5, f"the event loop stalled for {worst:.2f} s"
            errors = [t.exception() for t in tasks]
            assert all(isinstance(e, EngineError) for e in errors), [repr(e) for e in errors if
                                                                     not isinstance(e, EngineError)]
            assert "the prefill worker stopped responding" in str(errors[0])  # decode never blocks on it
            await wait_for(lambda: engine.state == "ready", 60)
            assert await collect(engine, "after", 3) == 3
        finally:
            await engine.shutdown()

    asyncio.run(main())


def _nap_forever(sem_name: str, ready: Any, ended: Any) -> None:
    """A worker's idle loop: SIGTERM ends it (worker_signals), naps on a semaphore in between; `ready` is set
    once its handler is in place (a SIGTERM before that would end it by the default action, proving nothing);
    `ended`: when (monotonic, system-wide) the SystemExit came out of the nap."""
    import posix_ipc

    from rapidserve.engine.worker_io import worker_signals
    from rapidserve.ipc.shm import nap_on

    worker_signals()
    sem = posix_ipc.Semaphore(sem_name)
    ready.set()
    try:
        while True:
            nap_on(sem, 0.25)
    except SystemExit:
        ended.value = time.monotonic()
        raise


def test_sigterm_ends_a_worker_that_is_napping_on_a_semaphore() -> None:
    """posix_ipc replaces the exception a signal handler raises inside a wait with SignalError: nap_on
    holds SIGTERM off during the wait, so the worker's SystemExit is not lost (it used to nap on)."""
    import posix_ipc

    from tests.fork_context import child_context

    name = f"/rapidserve-test-nap-{os.getpid()}"
    sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
    try:
        ctx = child_context()  # as a worker starts: a fork of the engine's fork server
        ready, ended = ctx.Event(), ctx.Value("d", 0.0, lock=False)
        p = ctx.Process(target=_nap_forever, args=(name, ready, ended), daemon=True)
        p.start()
        # its handler in place (a loaded machine took over 3 s to spawn it), then napping: its loop spends all
        # but microseconds of each 0.25 s nap inside the semaphore wait
        assert ready.wait(120), "the napping worker never started"
        time.sleep(0.5)
        assert p.is_alive()
        t0 = time.monotonic()
        p.terminate()
        p.join(5.0)
        assert not p.is_alive() and p.exitcode == 0, p.exitcode
        assert 0 < ended.value - t0 < 1.0  # at the end of the nap it was in (0.25 s), not the interpreter's exit
    finally:
        sem.unlink()


def test_an_aborted_id_is_refused_until_its_end_comes_back() -> None:
    """A late message of an aborted request must never reach a new request of the same id: the router
    refuses the id until the workers' end of the old one arrives, then serves it normally."""
    from rapidserve.sampling_params import SamplingParams

    async def main() -> None:
        engine = await AsyncEngine.start(config())  # type: ignore[arg-type]
        try:
            params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
            stream = engine.generate("x", list(range(1, 200)), params)
            await stream.__anext__()  # running
            await engine.abort("x")
            await stream.aclose()
            with pytest.raises(EngineError, match="still ending"):
                async for _ in engine.generate("x", [1, 2, 3], params):
                    pass
            deadline = time.monotonic() + 30
            while "x" in engine._settling and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert "x" not in engine._settling
            got = [t async for t in engine.generate("x", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4,
                                                                                     ignore_eos=True))]
            assert [t.index for t in got] == [0, 1, 2, 3] and got[-1].finish_reason == "length"
        finally:
            await engine.shutdown()

    asyncio.run(main())
