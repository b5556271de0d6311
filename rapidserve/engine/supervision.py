"""Supervision of the RAPID engine's workers: what `AsyncEngine` (engine/client.py, whose collector thread notices a
death or a hang) does about a worker that died, the restart half of its state machine.

On a death every in-flight request ends with `EngineError` at once, one log line names the worker,
its pid and its exit code or signal, the other worker is stopped, shared memory is unlinked, and the
workers are restarted (`on_worker_death="restart"`) while the windowed budget allows: at most
`max_restarts` restarts in any `restart_window_s`. Past it (or with "shutdown", or when restarts
fail MAX_FAILED_STARTS times in a row) the engine gives up: `state` is "down" and `fatal` is
set, so the server can exit non-zero for its supervisor to restart it.

States: starting -> ready -> (a death) restarting -> ready ... or -> down (gave up / shut down).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from rapidserve.config import EngineConfig
from rapidserve.engine.errors import EngineError
from rapidserve.engine.kv_publisher import KVEventPublisher

log = logging.getLogger("rapidserve.engine")
MAX_FAILED_STARTS = 3  # restarts that fail one after another before the engine gives up


class WorkerSupervision:
    """`AsyncEngine`'s handling of a worker's death (the module docstring), as its base class: it works on the
    engine's state below, set by `AsyncEngine.__init__`, and calls the engine's `_start_workers`, `_teardown` and
    `_fail_all`."""

    cfg: EngineConfig
    loop: asyncio.AbstractEventLoop | None
    streams: dict[str, Any]  # request id -> its stream (`finished` says whether it ended)
    kv_publisher: KVEventPublisher | None
    state: str  # starting | ready | restarting | down
    restarts_total: int
    deaths_total: int
    fatal: asyncio.Event
    dead_reason: str | None
    events: list[str]
    _restart_times: deque[float]
    _recovery: asyncio.Task[None] | None
    _closing: bool

    if TYPE_CHECKING:  # AsyncEngine's
        async def _start_workers(self) -> None: ...

        def _teardown(self, graceful: bool) -> None: ...

        def _fail_all(self, err: EngineError) -> None: ...

    def _on_death(self, who: str, pid: int | None, exitcode: int | None, silent_s: float | None) -> None:
        """In the event loop: fail every in-flight request now, then tear down and maybe restart."""
        if silent_s is not None:
            reason = (f"the {who} worker stopped responding (no heartbeat for {silent_s:.1f} s; pid {pid} "
                      f"killed)")
        else:
            reason = f"the {who} worker died ({describe_exit(exitcode)}, pid {pid})"
        self.deaths_total += 1
        self.events.append(reason)
        self.dead_reason = reason
        inflight = sum(1 for s in self.streams.values() if not s.finished)
        self._fail_all(EngineError(reason))
        if self.kv_publisher is not None:  # the dead worker's prefix cache is gone; its successor starts empty
            self.kv_publisher.cleared()
        log.error("%s; %d request(s) in flight failed", reason, inflight)
        self.state = "restarting" if self._may_restart() else "down"
        assert self.loop is not None
        self._recovery = self.loop.create_task(self._recover())

    def _may_restart(self) -> bool:
        """The restart budget: at most max_restarts in any restart_window_s."""
        lc = self.cfg.launch
        if self._closing or lc.on_worker_death != "restart":
            return False
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > lc.restart_window_s:
            self._restart_times.popleft()
        return len(self._restart_times) < lc.max_restarts

    async def _recover(self) -> None:
        try:
            await self._teardown_and_restart()
        except Exception as e:  # noqa: BLE001 - a recovery that breaks gives up, loudly
            self.state = "down"
            self.dead_reason = f"{self.dead_reason}; recovery failed: {type(e).__name__}: {e}"
            log.exception("engine down for good: %s", self.dead_reason)
            self.fatal.set()

    async def _teardown_and_restart(self) -> None:
        assert self.loop is not None
        await self.loop.run_in_executor(None, self._teardown, False)  # off the loop: joins processes
        if self._closing:
            return
        failed = 0
        while self.state == "restarting":
            self._restart_times.append(time.monotonic())
            t0 = time.monotonic()
            try:
                await self._start_workers()
            except Exception as e:  # noqa: BLE001 - counted against the budget, reported
                failed += 1
                self.dead_reason = f"restart failed ({failed}/{MAX_FAILED_STARTS}): {e}"
                self.events.append(self.dead_reason)
                log.error("%s", self.dead_reason)
                ok = failed < MAX_FAILED_STARTS and self._may_restart()
                self.state = "restarting" if ok else "down"
                continue
            self.restarts_total += 1
            msg = (f"workers restarted in {time.monotonic() - t0:.1f} s (restart {self.restarts_total}; "
                   f"{len(self._restart_times)} in the last {self.cfg.launch.restart_window_s:.0f} s)")
            self.events.append(msg)
            log.warning("%s", msg)
            return
        if not self._closing:
            why = ("on_worker_death=shutdown" if self.cfg.launch.on_worker_death != "restart"
                   else f"{failed} restarts failed in a row" if failed >= MAX_FAILED_STARTS
                   else f"restart budget used up ({self.cfg.launch.max_restarts} in "
                        f"{self.cfg.launch.restart_window_s:.0f} s)")
            self.dead_reason = f"{self.dead_reason}; giving up: {why}"
            self.events.append(self.dead_reason)
            log.error("engine down for good: %s", self.dead_reason)
            self.fatal.set()

    @property
    def restarts(self) -> int:
        return self.restarts_total


def describe_exit(exitcode: int | None) -> str:
    """'exit code 1', 'killed by SIGKILL', or 'no exit code' for a process's exit status."""
    if exitcode is None:
        return "no exit code"
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"
