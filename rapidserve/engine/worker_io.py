"""What a worker process needs around its loop: its channels, an idle wait, and liveness checks.

The launcher (in the router process) creates every ring and doorbell; workers only attach. Rings,
by label (writer -> reader):

    r2d router->decode   r2p router->prefill   d2p decode->prefill
    p2d prefill->decode  d2r decode->router    p2r prefill->router

Each reader has one doorbell that all its inbox rings ring, so an idle worker sleeps until a
message arrives on any of them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import posix_ipc

from rapidserve.engine import messages as m
from rapidserve.ipc import Doorbell, Receiver, Sender, ShmRing, pid_alive, wait_any

RING_LABELS = ("r2d", "r2p", "d2p", "p2d", "d2r", "p2r")
DOORBELLS = ("decode", "prefill", "router")
# Inbox rings of each reader, and the message types each ring carries.
INBOXES = {"decode": ("r2d", "p2d"), "prefill": ("r2p", "d2p"), "router": ("d2r", "p2r")}
RING_TYPES: dict[str, Any] = {
    "r2d": m.NewRequest | m.Abort | m.Shutdown,
    "r2p": m.NewRequest | m.Shutdown,
    "d2p": m.KVReady | m.Drop | m.SetPartition | m.Shutdown,
    "p2d": m.PrefillDone | m.PrefillFailed | m.Dropped,
    "d2r": m.Ready | m.TokenBatch | m.Finished | m.Stats | m.WorkerError,
    "p2r": m.Ready | m.TokenBatch | m.Heartbeat | m.WorkerError,
}
RING_READER = {label: who for who, labels in INBOXES.items() for label in labels}


@dataclass(frozen=True)
class ChannelNames:
    """Shared-memory names of one engine's rings and doorbells (built by the launcher)."""

    rings: dict[str, str]
    doorbells: dict[str, str]


class WorkerIO:
    """The channels of one worker: `send[label]` for its outbound rings, `recv[label]` for inbound."""

    def __init__(self, who: str, names: ChannelNames, parent_pid: int) -> None:
        self.who = who
        self.parent_pid = parent_pid
        self.peer_pids: list[int] = []
        self.recv: dict[str, Receiver[Any]] = {}
        self.send: dict[str, Sender[Any]] = {}
        for label, name in names.rings.items():
            ring = ShmRing.attach(name)
            if RING_READER[label] == who:
                self.recv[label] = Receiver(ring, RING_TYPES[label])
            elif label[0] == who[0]:  # d2*, p2*: this worker writes
                self.send[label] = Sender(ring, RING_TYPES[label])
            else:
                ring.close()
        self.doorbell = Doorbell.attach(names.doorbells[who])
        self._last_check = 0.0

    def drain(self) -> list[Any]:
        out: list[Any] = []
        for r in self.recv.values():
            out.extend(r.drain())
        return out

    def wait(self, timeout: float) -> bool:
        """Sleep until a message is waiting on any inbox ring, or `timeout` seconds pass."""
        return wait_any(list(self.recv.values()), self.doorbell, timeout)

    def others_alive(self, every_s: float = 0.25) -> bool:
        """False once the router (our parent) or a peer worker has died; checked at most every_s."""
        now = time.monotonic()
        if now - self._last_check < every_s:
            return True
        self._last_check = now
        if os.getppid() != self.parent_pid or not pid_alive(self.parent_pid):
            return False
        return all(pid_alive(p) for p in self.peer_pids)

    def close(self) -> None:
        for r in self.recv.values():
            r.close()
        for s in self.send.values():
            s.close()
        self.doorbell.close()


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


def apply_env(env: dict[str, str | None]) -> None:
    """Set (or, for None, remove) the variables the router chose for this worker (MPS pipes...)."""
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
    """Ctrl-C belongs to the router, which shuts the workers down in order; SIGTERM ends a worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
