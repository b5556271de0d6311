"""What a worker process needs around its loop: its entry point, its channels, an idle wait, liveness.

The launcher (in the router process) creates every ring and doorbell; workers only attach. The one
wire table, `RING_TYPES`, says for each ring (one SPSC ring per direction per pair, see
rapidserve/ipc/ring.py) who writes it, who reads it and which messages ride it:

    r2d router->decode    d2p decode->prefill   p2d prefill->decode
    d2r decode->router    p2r prefill->router

A new request enters at decode only (r2d) and reaches prefill inside a KVReady (d2p). Each reader
has one doorbell that all its inbox rings ring, so an idle worker sleeps until a message arrives on
any of them. Hybrid mode's worker (the decode worker alone, every step fused) sits in the decode seat with
r2d and d2r only: it never writes to a prefill worker.

A worker's channels are named by whom they reach: `io.to_router`, `io.to_prefill`, `io.to_decode`.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import posix_ipc

from rapidserve.config import EngineConfig
from rapidserve.engine import messages as m
from rapidserve.ipc import Doorbell, Receiver, Sender, ShmRing, pid_alive, wait_any
from rapidserve.kv_events import KVEventLog, split_events


@dataclass(frozen=True)
class Wire:
    writer: str
    reader: str
    types: Any  # the union of message types the reader decodes


RING_TYPES: dict[str, Wire] = {
    "r2d": Wire("router", "decode", m.NewRequest | m.Abort | m.Shutdown),
    "d2p": Wire("decode", "prefill", m.KVReady | m.Drop | m.SetPartition),
    "p2d": Wire("prefill", "decode", m.PrefillDone | m.PrefillFailed | m.Dropped),
    "d2r": Wire("decode", "router", m.Ready | m.TokenBatch | m.Finished | m.Stats | m.KVEvents | m.WorkerError),
    "p2r": Wire("prefill", "router", m.Ready | m.TokenBatch | m.Heartbeat | m.WorkerError),
}
HYBRID_RINGS = ("r2d", "d2r")  # hybrid mode's worker (the decode worker, no prefill worker) sits in decode's seat
DOORBELLS = ("decode", "prefill", "router")
SEATS = {"decode": "decode", "prefill": "prefill", "hybrid": "decode"}  # role -> whose rings it uses


@dataclass(frozen=True)
class ChannelNames:
    """Shared-memory names of one engine's rings and doorbells (built by the launcher)."""

    rings: dict[str, str]
    doorbells: dict[str, str]


class WorkerIO:
    """The channels of one worker seat: named senders (`to_router`...), and its inbox rings."""

    def __init__(self, seat: str, names: ChannelNames, parent_pid: int) -> None:
        self.seat = seat
        self.parent_pid = parent_pid  # the router
        self.start_ppid = os.getppid()  # the fork server (launch.worker_context), which ends with the router
        self.peer_pids: list[int] = []
        self.recv: list[Receiver[Any]] = []
        self._out: dict[str, Sender[Any]] = {}  # by reader
        for label, name in names.rings.items():
            wire = RING_TYPES[label]
            ring = ShmRing.attach(name)
            if wire.reader == seat:
                self.recv.append(Receiver(ring, wire.types))
            elif wire.writer == seat:
                self._out[wire.reader] = Sender(ring, wire.types)
            else:
                ring.close()
        self.doorbell = Doorbell.attach(names.doorbells[seat])
        self._last_check = 0.0

    def _to(self, reader: str) -> Sender[Any]:
        s = self._out.get(reader)
        if s is None:
            raise RuntimeError(f"the {self.seat} seat has no ring to the {reader} (see worker_io.RING_TYPES)")
        return s

    @property
    def to_router(self) -> Sender[Any]:
        return self._to("router")

    @property
    def to_prefill(self) -> Sender[Any]:
        return self._to("prefill")

    @property
    def to_decode(self) -> Sender[Any]:
        return self._to("decode")

    def drain(self) -> list[Any]:
        out: list[Any] = []
        for r in self.recv:
            out.extend(r.drain())
        return out

    def wait(self, timeout: float) -> bool:
        """Sleep until a message is waiting on any inbox ring, or `timeout` seconds pass."""
        return wait_any(self.recv, self.doorbell, timeout)

    def others_alive(self, every_s: float = 0.25) -> bool:
        """False once the router or a peer worker has died; checked at most every_s. A worker's parent is the fork
        server the router started, which exits when the router does: the worker is then re-parented, which
        tells the router's end even should its pid be reused."""
        now = time.monotonic()
        if now - self._last_check < every_s:
            return True
        self._last_check = now
        if os.getppid() != self.start_ppid or not pid_alive(self.parent_pid):
            return False
        return all(pid_alive(p) for p in self.peer_pids)

    def close(self) -> None:
        for r in self.recv:
            r.close()
        for s in self._out.values():
            s.close()
        self.doorbell.close()


def send_kv_events(to_router: Sender[Any], log: KVEventLog | None) -> None:
    """The KV events logged since the last call, to the router (a no-op without --kv-events-config, or with none
    logged), in messages the ring holds: max_message / 10 token ids and hashes each (msgpack: at most 5 bytes a
    token id, 9 a hash). Sent as tokens are, waiting for room: the router drains its rings all the time."""
    if log is None or not log.events:
        return
    for part in split_events(log.drain(), max(1, to_router.ring.max_message // 10)):
        to_router.send(m.KVEvents(part))


class Worker(Protocol):
    def run(self) -> None: ...


# build(cfg, io, handoff, seat) -> (what the Ready message tells the router, the worker to run); `seat`:
# the tensor-parallel seat of rank 0 (engine/tp_workers.py), None without tensor parallelism.
Build = Callable[[EngineConfig, WorkerIO, Any, Any], tuple[dict[str, str], Worker]]


def run_worker(role: str, build: Build, cfg: EngineConfig, names: ChannelNames, parent_pid: int, handoff: Any,
               env: dict[str, str | None], seat: Any = None) -> None:
    """The entry point of every worker process (forked from the fork server, launch.worker_context): attach the
    channels, `build` the worker (load or attach the model...), say Ready, run its loop. A failure is reported
    (WorkerError) and ends the process: the router fails the requests in flight and restarts the workers."""
    apply_env(env)
    worker_signals()
    no_named_locks()
    worker_logging(role, cfg.launch.log_level)
    io = WorkerIO(SEATS[role], names, parent_pid)
    try:
        t0 = time.monotonic()
        info, worker = build(cfg, io, handoff, seat)
        logging.getLogger(__name__).info("ready: built in %.1f s", time.monotonic() - t0)
        io.to_router.send(m.Ready(role, os.getpid(), info))
        settle_heap()
        worker.run()
    except SystemExit:
        pass
    except BaseException as e:  # report, then die
        io.to_router.try_send(m.WorkerError(role, f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))
        raise
    finally:
        if not io.others_alive(every_s=0.0):  # the router died without cleaning up: we do it
            unlink_names(names)
        io.close()
        run_exit_handlers()


def worker_logging(role: str, level: str) -> None:
    """A worker's log on stderr (inherited from the router), each line naming the worker: its start-up steps
    (loading weights, sizing the KV cache, capturing graphs) at info; rapidserve's loggers at `level`."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [{role} worker {os.getpid()}]: %(message)s")
    logging.getLogger("rapidserve").setLevel(level.upper())


def unlink_names(names: ChannelNames) -> None:
    """Remove an engine's shared-memory names (idempotent; used when the router is gone)."""
    for name in names.rings.values():
        for fn, suffix in ((posix_ipc.unlink_shared_memory, ""), (posix_ipc.unlink_semaphore, ".rd"),
                           (posix_ipc.unlink_semaphore, ".wr")):
            with contextlib.suppress(posix_ipc.ExistentialError):
                fn("/" + name + suffix)
    for name in names.doorbells.values():
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore("/" + name)


def run_exit_handlers() -> None:
    """Run what the interpreter's exit would (atexit; each handler once), at the end of a worker's entry point:
    a worker forked from the fork server (launch.worker_context) ends with os._exit, which skips them, where a
    spawned one ran them. A TP leader stops its followers there (tp_workers.stop_followers)."""
    atexit._run_exitfuncs()


def apply_env(env: dict[str, str | None]) -> None:
    """Make the process's environment exactly `env` (`launch.worker_env`: the router's when it started this
    worker, with its choices for it, MPS pipes..., applied; None: absent). A worker is forked from a fork server
    begun earlier, whose environment may be older than the router's; every variable a worker's libraries read
    is read after this (CUDA's and HIP's at their first call, the allocator's at its first allocation)."""
    os.environ.clear()
    os.environ.update({k: v for k, v in env.items() if v is not None})


def settle_heap() -> None:
    """Once start-up is over: collect, then freeze what survived (modules, weights' wrappers, graphs)
    so the collector's full passes during serving skip it and pause the loop less (vLLM does the same)."""
    gc.collect()
    gc.freeze()


def no_named_locks() -> None:
    """tqdm's first progress bar makes a multiprocessing RLock, a named POSIX semaphore
    (/dev/shm/sem.mp-*) that a killed worker never unlinks: workers use a thread lock instead."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def worker_signals() -> None:
    """Ctrl-C belongs to the router, which shuts the workers down in order; SIGTERM ends a worker;
    SIGUSR1 prints every thread's stack to stderr (`kill -USR1 <worker pid>`: where is it stuck?)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    def _term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
