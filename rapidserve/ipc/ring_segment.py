"""A ring's shared-memory segment: its memory layout; creating it (`create_segment`, which writes the header),
attaching it (`attach_segment`, which checks the header) and removing its names (`unlink_segment`); and the
ring's errors. The SPSC ring over it (what a message takes, publish order, sleeping, the doorbell): `ShmRing` in
ring.py; the header's word indices: shm.py.

Memory layout (all integers little-endian u64, every offset a multiple of 8):

======  ========================================================================
offset  contents
======  ========================================================================
0       line 0, written once by `create`, then read-only: magic ``b"rsvRING\\0"``
        (stored last, so a half-initialised segment fails `attach`), version,
        slots, slot_size (payload bytes per slot), max_message, creator pid
64      head: number of slots ever published (written only by the writer)
128     tail: number of slots ever consumed (written only by the reader)
192     reader_sleeping flag (written only by the reader)
256     writer_sleeping flag (written only by the writer)
320     closed flag (either side; set once); 384-511 reserved
512     slot i at ``512 + i * (8 + slot_size)``: a word ``len | flags << 32 |
        stamp << 40`` (len: payload bytes in this slot; flags: FIRST=1, LAST=2;
        stamp: low 24 bits of the slot's absolute index) then slot_size payload bytes
======  ========================================================================

A ring created with a `doorbell` has version 2 (else 1) and records the doorbell's name in
line 6, written once by `create` before the magic: offset 384 holds the name's length in
bytes (at most `DOORBELL_NAME_MAX` = 120), 392.. the ASCII name. The version differs so that
code which predates doorbells refuses to attach (its writer would post only ``.rd`` and a
reader asleep on the doorbell would notice the message only when its nap runs out).

Each mutable word has its own cache line, so the writer's and the reader's stores do not
false-share. The slot words are written by `ShmRing.put` and read by `ShmRing.try_get` (ring.py, whose
docstring says how a message takes its slots).

Names: segment ``/dev/shm/<name>``, semaphores ``/dev/shm/sem.<name>.rd`` / ``.wr``, all
mode 0o600; `name` must come from `ring_name` (it embeds the creating pid, for
`cleanup_stale`). `create_segment` in the owner and `attach_segment` in the peer (`ShmRing.create`,
`ShmRing.attach`); `unlink_segment` (the owner, at shutdown: `ShmRing.unlink`) removes the names.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from typing import NamedTuple

import posix_ipc

from rapidserve.ipc.shm import (
    DOORBELL_NAME_MAX,
    DOORBELL_OFF,
    HEADER_BYTES,
    MAGIC,
    NAME_RE,
    SHM_DIR,
    VERSION,
    VERSION_DOORBELL,
    W_CREATOR,
    W_DOORBELL_LEN,
    W_MAGIC,
    W_MAX_MESSAGE,
    W_SLOT_SIZE,
    W_SLOTS,
    W_VERSION,
)


class RingError(Exception):
    """Base class of ring errors."""


class RingLayoutError(RingError, ValueError):
    """A segment is not a valid ring of this version (wrong magic, version, sizes, truncated)."""


class MessageTooLarge(RingError, ValueError):
    """A message exceeds the ring's max_message (at most its whole capacity)."""


class RingFull(RingError, TimeoutError):
    """put() could not find room for the message before its timeout."""


class RingClosed(RingError):
    """The ring was marked closed by one side; nothing more will come (or be read)."""


class Segment(NamedTuple):
    """A mapped ring segment and its semaphores, as `ShmRing` takes them."""

    name: str
    mm: mmap.mmap
    rsem: posix_ipc.Semaphore  #: ``.rd``: a reader asleep in `ShmRing.wait` waits on it
    wsem: posix_ipc.Semaphore  #: ``.wr``: a writer asleep on a full ring waits on it
    bell: posix_ipc.Semaphore | None  #: the doorbell, where the header names one
    doorbell: str | None  #: its name


def create_segment(name: str, slots: int, slot_size: int, max_message: int | None,
                   bell_name: str | None) -> Segment:
    """Create the segment and semaphores (mode 0o600) and write the header; fails if the name already exists.
    `bell_name`: an existing doorbell semaphore, recorded in the header (version 2)."""
    bell_bytes = b""
    if bell_name is not None:
        bell_bytes = bell_name.encode("ascii", "replace")
        if not NAME_RE.match(bell_name) or len(bell_bytes) > DOORBELL_NAME_MAX:
            raise ValueError(f"doorbell name {bell_name!r}: must be rapidserve-<pid>-... of at most "
                             f"{DOORBELL_NAME_MAX} characters [A-Za-z0-9_.-]")
    m = NAME_RE.match(name)
    if m is None or int(m.group(1)) != os.getpid():
        raise ValueError(f"ring name {name!r} must be rapidserve-<this pid>-...: use ring_name()")
    if not 1 <= slots <= 1 << 24:
        raise ValueError(f"slots={slots}: must be in [1, 16777216]")
    if slot_size < 8 or slot_size % 8 or slot_size > 1 << 30:
        raise ValueError(f"slot_size={slot_size}: must be a multiple of 8 in [8, 2**30]")
    capacity = slots * slot_size
    max_message = capacity if max_message is None else max_message
    if not 0 <= max_message <= capacity:
        raise ValueError(f"max_message={max_message}: must be in [0, slots*slot_size={capacity}]")
    size = HEADER_BYTES + slots * (8 + slot_size)
    bell = None
    if bell_name is not None:
        try:
            bell = posix_ipc.Semaphore("/" + bell_name)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(f"no doorbell semaphore {SHM_DIR}/sem.{bell_name}: create "
                                    f"the Doorbell before its rings") from None
    try:
        shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
    except BaseException:
        if bell is not None:
            bell.close()
        raise
    sems: list[posix_ipc.Semaphore] = []
    try:
        for suffix in (".rd", ".wr"):
            sems.append(posix_ipc.Semaphore("/" + name + suffix, posix_ipc.O_CREX, mode=0o600))
        mm = mmap.mmap(shm.fd, size)
    except BaseException:
        shm.close_fd()
        shm.unlink()
        for s in sems:
            s.unlink()
            s.close()
        if bell is not None:
            bell.close()
        raise
    shm.close_fd()
    q = memoryview(mm).cast("Q")
    q[W_SLOTS], q[W_SLOT_SIZE] = slots, slot_size
    q[W_MAX_MESSAGE], q[W_CREATOR] = max_message, os.getpid()
    if bell_name is None:
        q[W_VERSION] = VERSION
    else:
        q[W_VERSION] = VERSION_DOORBELL
        q[W_DOORBELL_LEN] = len(bell_bytes)
        mm[DOORBELL_OFF:DOORBELL_OFF + len(bell_bytes)] = bell_bytes
    q[W_MAGIC] = MAGIC  # last: attach() rejects a segment whose header is not complete
    q.release()
    return Segment(name, mm, sems[0], sems[1], bell, bell_name)


def attach_segment(name: str) -> Segment:
    """Map an existing ring, validating magic, version and sizes (`RingLayoutError` if bad)."""
    try:
        shm = posix_ipc.SharedMemory("/" + name)
    except posix_ipc.ExistentialError:
        raise FileNotFoundError(f"no ring segment {SHM_DIR}/{name}") from None
    size = shm.size
    if size < HEADER_BYTES:
        shm.close_fd()
        raise RingLayoutError(f"segment {name!r} is {size} bytes, smaller than the "
                              f"{HEADER_BYTES}-byte ring header: truncated or not a ring")
    mm = mmap.mmap(shm.fd, size)
    shm.close_fd()
    q = memoryview(mm).cast("Q")
    try:
        magic, version, slots, slot_size, max_message = (q[i] for i in range(5))
        bell_len = q[W_DOORBELL_LEN]
    finally:
        q.release()
    bell_name = None
    problem = None
    if magic != MAGIC:
        problem = f"bad magic {magic:#x} (want {MAGIC:#x}): not a rapidserve ring, or not initialised"
    elif version not in (VERSION, VERSION_DOORBELL):
        problem = f"ring version {version}, this code reads versions {VERSION} and {VERSION_DOORBELL}"
    elif version == VERSION_DOORBELL and not 0 < bell_len <= DOORBELL_NAME_MAX:
        problem = f"bad doorbell name length {bell_len} (at most {DOORBELL_NAME_MAX})"
    elif not slots or not slot_size or slot_size % 8 or max_message > slots * slot_size:
        problem = f"inconsistent header: slots={slots} slot_size={slot_size} max_message={max_message}"
    elif size < HEADER_BYTES + slots * (8 + slot_size):
        problem = (f"truncated: header says {slots} slots of {slot_size} bytes = "
                   f"{HEADER_BYTES + slots * (8 + slot_size)} bytes, segment has {size}")
    if problem is None and version == VERSION_DOORBELL:
        bell_name = mm[DOORBELL_OFF:DOORBELL_OFF + bell_len].decode("ascii", "replace")
        if not NAME_RE.match(bell_name):
            problem = f"bad doorbell name {bell_name!r} in the header"
    sems: list[posix_ipc.Semaphore] = []
    if problem is None:
        try:
            sems = [posix_ipc.Semaphore("/" + name + sfx) for sfx in (".rd", ".wr")]
        except posix_ipc.ExistentialError:
            problem = "its semaphores are missing"
    if problem is None and bell_name is not None:
        try:
            sems.append(posix_ipc.Semaphore("/" + bell_name))
        except posix_ipc.ExistentialError:
            problem = f"its doorbell semaphore {SHM_DIR}/sem.{bell_name} is missing"
    if problem is not None:
        for s in sems:
            s.close()
        mm.close()
        raise RingLayoutError(f"cannot attach ring {name!r}: {problem}")
    return Segment(name, mm, sems[0], sems[1], sems[2] if bell_name else None, bell_name)


def unlink_segment(name: str) -> None:
    """Remove the segment and semaphore names of ring `name` (mappings stay valid until closed). Idempotent."""
    for fn, nm in ((posix_ipc.unlink_shared_memory, ""), (posix_ipc.unlink_semaphore, ".rd"),
                   (posix_ipc.unlink_semaphore, ".wr")):
        with contextlib.suppress(posix_ipc.ExistentialError):
            fn("/" + name + nm)
