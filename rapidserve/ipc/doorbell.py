"""Doorbell: one semaphore per reading thread, shared by all of its inbox rings (see `wait_any`).

A worker that reads several `ShmRing` inboxes (the decode worker reads one from the router and
one from the prefill worker) must sleep until a message arrives on ANY of them. Each ring's own
``.rd`` semaphore only serves a reader sleeping on that one ring, so the reader creates one
`Doorbell` (a named POSIX semaphore, mode 0o600) and creates its inbox rings with
``ShmRing.create(..., doorbell=bell.name)``. The ring header records the doorbell's name, so a
writer that attaches later opens the same semaphore.

Protocol (reader: `wait_any`; writer: `ShmRing.put`, unchanged apart from which semaphore it
posts):

1. The reader checks every ring (``head != tail``, or closed) and returns at once if one is
   ready; else it spins for `Doorbell.spin_s` (50 us; ``sched_yield`` between checks).
2. It stores reader_sleeping = 2 ("asleep on the doorbell") in EVERY ring's header, then
   RE-CHECKS every ring; if one is ready it clears the flags and returns.
3. It waits on the doorbell. The first waits last at most `FIRST_NAP_S` (1 ms): a long wait
   (`NAP_S`, 250 ms, or what is left of the timeout) only starts after a re-check that itself
   started at least 1 ms after the flags were stored. After each wait it drains surplus posts
   (``acquire(0)`` until busy) and re-checks every ring.
4. When a ring is ready (or the timeout passes) it stores reader_sleeping = 0 in every ring.

The writer, after storing head (the publication), loads reader_sleeping and posts the doorbell
if it reads 2 (the ring's ``.rd`` if 1: a reader in the single-ring `ShmRing.wait`).

Why no wake-up is lost. Take any publication on any ring r while the reader is in step 2-3.
Writer: store head_r, then load flag_r. Reader: store flag_r, then (later) load head_r in a
re-check. Per ring this is the classic store-then-load handshake: at least one side sees the
other's store, unless a load passes its own side's older store. If the writer sees the flag it
posts, and the reader, asleep or about to sleep, wakes (a post before the wait just makes the
wait return at once; the semaphore counts). If the reader's re-check sees head_r, it returns.
The rings are independent (each has one writer), so this holds for each ring separately and
thus for the set. The remaining hole is the store buffer: even x86-TSO lets a load pass an
older store to a different address, and Python cannot issue the StoreLoad fence (``mfence``)
that closes it. So both loads may miss for the nanoseconds the flag stores sit in the reader's
store buffer. That is why every wait is capped at 1 ms until a re-check has run >= 1 ms after
the flag stores: by then the stores are globally visible (store buffers drain in far less, and
the semaphore syscalls in between contain locked instructions, which are full fences on x86),
so that re-check sees any publication the writer made without seeing the flag, and any later
publication sees the flag and posts. A wake-up can thus be late by at most 1 ms in that window,
never lost. (Ordering caveats on weakly ordered CPUs: see `ShmRing`.)

Spurious wake-ups are harmless: a writer that loads the flag just before the reader clears it
posts anyway; the reader's next wait returns at once, drains, re-checks and sleeps again (still
with the 1 ms cap, since that is counted from the flag stores of that call). A post is never
consumed without a re-check after it, so draining cannot lose a wake-up either.

Rules. One thread waits on a doorbell at a time (two waiters would steal each other's posts;
their 250 ms naps would still find the data, late). A ring's reader must not sleep on it in
`ShmRing.wait` and `wait_any` at the same time (they share the flag word). A ring waited on in
`wait_any` must have been created with this doorbell; `wait_any` checks.

Names: ``/dev/shm/sem.<name>`` where `name` comes from `doorbell_name` (or `ring_name`): it
embeds the creating pid, so `cleanup_stale` removes the doorbell of a dead process like its
rings. At most `DOORBELL_NAME_MAX` (120) characters, the room in the ring header.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from typing import Any

import posix_ipc

from rapidserve.ipc.ring import ShmRing
from rapidserve.ipc.shm import (
    DOORBELL_NAME_MAX,
    FIRST_NAP_S,
    NAME_RE,
    NAP_S,
    SHM_DIR,
    SLEEP_DOORBELL,
    W_RSLEEP,
    nap_on,
    ring_name,
)

__all__ = ["DOORBELL_NAME_MAX", "Doorbell", "doorbell_name", "wait_any"]


def doorbell_name(engine_id: str, label: str) -> str:
    """`rapidserve-<this pid>-<engine id>-<label>.bell`, for `Doorbell.create`."""
    name = ring_name(engine_id, label) + ".bell"
    if len(name) > DOORBELL_NAME_MAX:
        raise ValueError(f"doorbell name {name!r} is longer than {DOORBELL_NAME_MAX} characters")
    return name


class Doorbell:
    """A named POSIX semaphore that the writers of several rings post to wake their one reader.

    `create` in the reading process (before its rings), `attach` elsewhere if needed (a writer
    does not need to: `ShmRing.attach` opens the doorbell named in the ring header). `close`
    closes this handle, `unlink` (the creator, at shutdown) removes the name.
    """

    name: str
    spin_s: float  #: how long `wait_any` polls before it sleeps (settable)
    sleeps: int  #: semaphore waits by `wait_any` on this object (statistics; not shared)
    late_wakes: int  #: waits that ran out although a ring had become ready: should stay ~0

    def __init__(self, name: str, sem: posix_ipc.Semaphore) -> None:
        self.name = name
        self._sem = sem
        self._closed = False
        self.spin_s = 50e-6
        self.sleeps = 0
        self.late_wakes = 0

    @classmethod
    def create(cls, name: str) -> Doorbell:
        """Create the semaphore (value 0, mode 0o600); fails if the name already exists."""
        m = NAME_RE.match(name)
        if m is None or int(m.group(1)) != os.getpid():
            raise ValueError(f"doorbell name {name!r} must be rapidserve-<this pid>-...: use doorbell_name()")
        if len(name) > DOORBELL_NAME_MAX:
            raise ValueError(f"doorbell name {name!r} is longer than {DOORBELL_NAME_MAX} characters")
        sem = posix_ipc.Semaphore("/" + name, posix_ipc.O_CREX, mode=0o600, initial_value=0)
        return cls(name, sem)

    @classmethod
    def attach(cls, name: str) -> Doorbell:
        """Open an existing doorbell (`FileNotFoundError` if there is none)."""
        try:
            sem = posix_ipc.Semaphore("/" + name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no doorbell semaphore {SHM_DIR}/sem.{name}") from None
        return cls(name, sem)

    @property
    def path(self) -> str:
        """The /dev/shm entry backing this doorbell."""
        return f"{SHM_DIR}/sem.{self.name}"

    def post(self) -> None:
        """Wake the waiter (or make its next wait return at once): a spurious wake-up, harmless."""
        self._sem.release()

    def wait_any(self, sources: Iterable[Any], timeout: float | None = None) -> bool:
        """`wait_any(sources, self, timeout)`."""
        return wait_any(sources, self, timeout)

    def close(self) -> None:
        """Close this handle (the name stays until `unlink`). Idempotent."""
        if not self._closed:
            self._closed = True
            self._sem.close()

    def unlink(self) -> None:
        """Remove the name (open handles stay valid until closed). Idempotent."""
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore("/" + self.name)

    def __enter__(self) -> Doorbell:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Doorbell({self.name!r})"


def _rings(sources: Iterable[Any], doorbell: Doorbell) -> list[ShmRing]:
    rings = []
    for src in sources:
        ring = getattr(src, "ring", src)  # a Receiver (or Sender) carries its ring
        if not isinstance(ring, ShmRing):
            raise TypeError(f"wait_any takes ShmRings or Receivers, got {type(src).__name__}")
        if ring.doorbell != doorbell.name:
            raise ValueError(f"ring {ring.name!r} has doorbell {ring.doorbell!r}, not {doorbell.name!r}: "
                             f"create it with ShmRing.create(..., doorbell=...)")
        rings.append(ring)
    if not rings:
        raise ValueError("wait_any needs at least one ring")
    return rings


def wait_any(sources: Iterable[Any], doorbell: Doorbell, timeout: float | None = None) -> bool:
    """Sleep until any of the rings (`ShmRing`s or `Receiver`s) is ready; consumes nothing.

    Returns True as soon as one has a message or is closed (its get() then raises `RingClosed`,
    like select() reporting EOF as readable), False once `timeout` s pass (None: never; 0: just
    check). Every ring must have been created with `doorbell`. Protocol: module docstring.
    """
    rings = _rings(sources, doorbell)
    checks = [r.readable for r in rings]

    def ready() -> bool:
        return any(check() for check in checks)

    if ready():
        return True
    if timeout is not None and timeout <= 0:
        return False
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    spin_end = now + (doorbell.spin_s if timeout is None else min(doorbell.spin_s, timeout))
    while time.monotonic() < spin_end:
        os.sched_yield()
        if ready():
            return True
    words = [r._q for r in rings]
    for q in words:
        q[W_RSLEEP] = SLEEP_DOORBELL
    flagged = time.monotonic()
    sem = doorbell._sem
    try:
        posted = True
        while True:
            checked = time.monotonic()
            if ready():  # the re-check after setting the flags, and after every wait
                break
            left = None if deadline is None else deadline - checked
            if left is not None and left <= 0:
                return False
            # Long waits only after a re-check that began >= 1 ms after the flag stores (docstring).
            nap = NAP_S if checked - flagged >= FIRST_NAP_S else FIRST_NAP_S
            doorbell.sleeps += 1
            posted = nap_on(sem, nap if left is None else min(nap, left))
        if not posted:  # a ring became ready while a wait ran out: its post was missed or late
            doorbell.late_wakes += 1
        return True
    finally:
        for q in words:
            q[W_RSLEEP] = 0
