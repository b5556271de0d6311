"""How a ring's side sleeps, and why no wake-up is lost (`sleep_until`, which `ShmRing.wait` and a `ShmRing.put`
waiting for room run; the ring's memory layout: ring_segment.py; its publish order: `ShmRing` in ring.py).

An idle reader spins (with sched_yield) for `spin_s`, then stores reader_sleeping = 1, RE-CHECKS head, and only then
waits on the ``.rd`` semaphore; after every publication the writer loads reader_sleeping and posts if it is set.
Either the reader's re-check sees the new head, or the writer's load sees the flag: both missing needs each side's
load to pass its own older store. Even x86-TSO allows that (store buffer) and Python cannot emit a fence, so the
reader's first wait is short (`FIRST_NAP_S`) and is followed by another head check; by then its flag store is
globally visible, so every later publication posts. A wake-up is thus at worst delayed by 1 ms in that nanosecond
window, never lost. The reader clears the flag only when it leaves the wait; surplus posts just cause a spurious
wake (after a wake it drains the count and re-checks). The writer blocked on a full ring does the same with
writer_sleeping, tail and ``.wr``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Protocol

import posix_ipc

from rapidserve.ipc.ring_segment import RingClosed
from rapidserve.ipc.shm import FIRST_NAP_S, NAP_S, SLEEP_RING, W_CLOSED, nap_on


class Sleeper(Protocol):
    """The side of a ring that sleeps (a `ShmRing`): its name for errors, how long it spins, its counts."""

    name: str
    spin_s: float
    sleeps: int
    late_wakes: int


def sleep_until(ring: Sleeper, q: memoryview, cond: Callable[[], bool], timeout: float | None, flag: int,
                sem: posix_ipc.Semaphore) -> bool:
    """Spin briefly, then the flag / re-check / sleep protocol of the module docstring: True once `cond()` holds,
    False once `timeout` s pass (None: never; 0: just check), `RingClosed` if the ring is closed meanwhile. `q`: the
    ring's header words; `flag`: this side's sleeping word (W_RSLEEP, W_WSLEEP); `sem`: its semaphore (.rd, .wr)."""
    now = time.monotonic()
    deadline = None if timeout is None else now + timeout
    spin_end = now + min(ring.spin_s, timeout if timeout is not None else ring.spin_s)
    while True:
        if cond():
            return True
        if q[W_CLOSED]:
            raise RingClosed(f"ring {ring.name!r} is closed")
        if timeout == 0:
            return False
        if time.monotonic() >= spin_end:
            break
        os.sched_yield()
    q[flag] = SLEEP_RING
    try:
        nap, posted = FIRST_NAP_S, True
        while not cond():  # the re-check after setting the flag
            if q[W_CLOSED]:
                raise RingClosed(f"ring {ring.name!r} is closed")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            ring.sleeps += 1
            posted = nap_on(sem, nap if left is None else min(nap, left))
            nap = NAP_S
        if not posted:  # the data came while a nap ran out: its post was missed or late
            ring.late_wakes += 1
        return True
    finally:
        q[flag] = 0
