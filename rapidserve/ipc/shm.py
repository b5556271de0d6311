"""What `ring.py` and `doorbell.py` share: names under /dev/shm (and removing those of dead processes:
`cleanup_stale`), the ring header's word map, and sleeping.

The lowest module of `rapidserve.ipc` (it imports nothing from rapidserve): ring_segment.py lays out
the header, `ShmRing` (ring.py) reads and writes it, and `wait_any` (doorbell.py) stores the
reader_sleeping word of every ring it sleeps on and naps like `ShmRing.wait` (ring_sleep.py). Keeping these here
lets doorbell.py use ring.py without ring.py knowing about doorbells. The header layout is documented in
ring_segment.py, the wake-up argument in ring_sleep.py and in doorbell.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import uuid

import posix_ipc

NAME_PREFIX = "rapidserve-"
SHM_DIR = "/dev/shm"
NAME_RE = re.compile(r"^rapidserve-(\d+)-[A-Za-z0-9_.-]+$")

MAGIC = int.from_bytes(b"rsvRING\x00", "little")
VERSION = 1  # a ring without a doorbell
VERSION_DOORBELL = 2  # same layout, plus the doorbell's name in the reserved line (see ring_segment.py)
HEADER_BYTES = 512  # 8 cache lines
# Header word indices (8-byte words). Line 0 is written once at creation and then only read.
W_MAGIC, W_VERSION, W_SLOTS, W_SLOT_SIZE, W_MAX_MESSAGE, W_CREATOR = 0, 1, 2, 3, 4, 5
W_HEAD, W_TAIL, W_RSLEEP, W_WSLEEP, W_CLOSED = 8, 16, 24, 32, 40  # one 64-byte line each
W_DOORBELL_LEN = 48  # line 6, written once by create: doorbell name length, then the name bytes
DOORBELL_OFF = W_DOORBELL_LEN * 8 + 8
DOORBELL_NAME_MAX = HEADER_BYTES - DOORBELL_OFF  # 120 bytes
# reader_sleeping values: where the sleeping reader waits, so the writer posts the right semaphore
SLEEP_RING, SLEEP_DOORBELL = 1, 2
FIRST_NAP_S = 0.001  # first sleep after the flag is set: bounds the store-buffer race (see ring_sleep.py)
NAP_S = 0.25  # later sleeps; every publication while the flag is set posts the semaphore anyway
HELD_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # delivered after a nap, not inside it (nap_on)


def ring_name(engine_id: str, label: str) -> str:
    """`rapidserve-<this pid>-<engine id>-<label>`: the pid lets `cleanup_stale` judge liveness."""
    name = f"{NAME_PREFIX}{os.getpid()}-{engine_id}-{label}"
    if not NAME_RE.match(name) or len(name) > 200:
        raise ValueError(f"bad ring name {name!r}: use [A-Za-z0-9_.-], at most 200 characters")
    return name


def nap_on(sem: posix_ipc.Semaphore, timeout: float) -> bool:
    """Sleep on `sem` up to `timeout` s; True if it was posted (surplus posts drained, so the caller
    re-checks once); a timeout returns False.

    SIGTERM and SIGINT are held off during the wait: posix_ipc runs the Python handler of a signal
    that interrupts it but then raises SignalError in place of whatever the handler raised, so a
    worker's SystemExit on SIGTERM was lost and the worker slept on. Held off, the signal is
    delivered as the wait ends (within `timeout`) and its handler's exception propagates from here."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        sem.acquire(timeout)
    except (posix_ipc.BusyError, posix_ipc.SignalError):
        return False
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    with contextlib.suppress(posix_ipc.BusyError, posix_ipc.SignalError):
        while True:
            sem.acquire(0)
    return True


def new_engine_id() -> str:
    """A short random token identifying one engine instance (shared by all its processes)."""
    return uuid.uuid4().hex[:12]


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie (this process counts as alive)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # an unreaped zombie still answers kill(0) but will never unlink anything
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def cleanup_stale(prefix: str = NAME_PREFIX) -> list[str]:
    """Unlink segments and semaphores under /dev/shm named `<prefix><pid>-...` whose pid is dead.

    That covers rings (segment, ``.rd``, ``.wr``) and doorbells (``sem.<name>``) alike, since both
    names come from `ring_name` and so carry the creating pid.

    Returns the /dev/shm entry names removed. Entries of live processes (this one included) stay.
    """
    removed: list[str] = []
    try:
        entries = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return removed
    pid_re = re.compile(re.escape(prefix) + r"(\d+)-")
    for entry in entries:
        is_sem = entry.startswith("sem.")
        base = entry[4:] if is_sem else entry
        m = pid_re.match(base)
        if m is None or pid_alive(int(m.group(1))):
            continue
        try:
            if is_sem:
                posix_ipc.unlink_semaphore("/" + base)
            else:
                posix_ipc.unlink_shared_memory("/" + base)
            removed.append(entry)
        except posix_ipc.ExistentialError:
            pass  # removed concurrently
    return removed
