"""Single-producer / single-consumer byte-message ring in POSIX shared memory (see `ShmRing`). Its segment (memory
layout, creating and attaching it) and its errors: ring_segment.py; how a side sleeps: ring_sleep.py."""

from __future__ import annotations

import mmap
from typing import Protocol

import posix_ipc

from rapidserve.ipc.ring_segment import (
    MessageTooLarge,
    RingClosed,
    RingError,
    RingFull,
    RingLayoutError,
    attach_segment,
    create_segment,
    unlink_segment,
)
from rapidserve.ipc.ring_sleep import sleep_until
from rapidserve.ipc.shm import (
    DOORBELL_NAME_MAX,
    HEADER_BYTES,
    NAME_PREFIX,
    SHM_DIR,
    SLEEP_DOORBELL,
    W_CLOSED,
    W_HEAD,
    W_MAX_MESSAGE,
    W_RSLEEP,
    W_SLOT_SIZE,
    W_SLOTS,
    W_TAIL,
    W_WSLEEP,
    cleanup_stale,
    nap_on,
    new_engine_id,
    pid_alive,
    ring_name,
)

# Names importers have always taken from here (the constants and helpers now live in shm.py, the errors in
# ring_segment.py).
__all__ = ["DOORBELL_NAME_MAX", "NAME_PREFIX", "SHM_DIR", "MessageTooLarge", "RingClosed", "RingError", "RingFull",
           "RingLayoutError", "ShmRing", "cleanup_stale", "nap_on", "new_engine_id", "pid_alive", "ring_name"]

_FIRST, _LAST = 1, 2  # piece flags; a middle piece has neither, a one-piece message both
_SINGLE = _FIRST | _LAST
_LEN_MASK = 0xFFFFFFFF
_STAMP_MASK = 0xFFFFFF


class _Named(Protocol):
    """A `Doorbell` as `ShmRing.create` sees it (ring.py does not import doorbell.py, which uses it)."""

    name: str


class ShmRing:
    """SPSC ring of fixed-size slots in one POSIX shared-memory segment, plus two named semaphores.

    Memory layout, names and the doorbell's record in the header: ring_segment.py. A message of n bytes takes
    ``max(1, ceil(n / slot_size))`` consecutive slots (first / middle / last pieces, wrapping from the last slot to
    slot 0); it must fit in the ring as a whole (``n <= max_message <= slots * slot_size``), else `MessageTooLarge`.

    Publish order. Writer: copy every piece's payload into its slot, write each slot's word, THEN
    store head += pieces (one store publishes the whole message). Reader: load head, then read the
    slot words and payloads of slots in [tail, head), copy them out, THEN store tail (which lets
    the writer reuse those slots). Why a reader never sees a half-written message:
    - one writer and one reader (the caller's contract), so each index has a single writer;
    - the indices are stored/loaded as aligned 8-byte words through ``memoryview.cast("Q")``,
      which CPython packs with an 8-byte memcpy that compilers emit as one ``mov``/``str``;
      aligned 8-byte accesses are single-copy atomic on x86-64 and aarch64, so a torn index is
      never seen (C does not promise the single instruction; this is what real builds do);
    - CPython executes the payload copy, the word store and the index store in program order
      (separate C calls through the interpreter: the compiler cannot move one across another),
      and x86-64 is TSO: stores become visible in program order, loads are not reordered with
      older loads, and no store passes an older load. So once the reader sees the new head, the
      payload before it is visible too; once the writer sees the new tail, the reader's copies
      are complete and cannot observe the writer's later overwrites.
    - Caveat, weakly ordered CPUs (aarch64, POWER): Python offers no fence, so store->store,
      load->load and load->store order are not architecturally guaranteed. The reader checks each slot's stamp
      (24 bits of its absolute index) and waits for it to match, which catches a stale slot
      word, not stale payload bytes. Use this ring only on x86-64 for a hard guarantee.

    Sleeping. An idle reader, or a writer blocked on a full ring, spins for `spin_s` and then sleeps on its
    semaphore (``.rd``, ``.wr``) with its flag (reader_sleeping, writer_sleeping) set; after every publication the
    writer loads reader_sleeping and posts if it is set, and after every consumption the reader does the same with
    writer_sleeping. The protocol, and why no wake-up is lost: ring_sleep.py.

    Doorbell. reader_sleeping also says WHERE the reader sleeps: 1 on the ring's ``.rd``
    (`wait`, `get`), 2 on the ring's doorbell, a semaphore shared by all inbox rings of one
    reading thread (`rapidserve.ipc.doorbell.wait_any`, which documents that protocol). After a
    publication the writer posts ``.rd`` for 1, the doorbell for 2. The flag / re-check argument
    (ring_sleep.py) is per ring and holds unchanged; only the semaphore slept on differs.

    `create` in the owner, `attach` in the peer; `close` unmaps, `unlink` (the owner, at shutdown)
    removes the names. A `ShmRing` object caches its side's indices, so use one object per role (one may serve as
    both in a single-process loopback).
    """

    name: str  #: read-only after construction, like slots, slot_size and max_message
    slots: int
    slot_size: int
    max_message: int
    spin_s: float  #: how long an idle get()/full put() polls before it sleeps (settable)
    sleeps: int
    late_wakes: int

    doorbell: str | None  #: the name of the doorbell semaphore the ring's reader may sleep on

    def __init__(self, name: str, mm: mmap.mmap, rsem: posix_ipc.Semaphore,
                 wsem: posix_ipc.Semaphore, bell: posix_ipc.Semaphore | None = None,
                 doorbell: str | None = None) -> None:
        self.name = name
        self._mm = mm
        self._buf = memoryview(mm)
        self._q = self._buf.cast("Q")
        self._rsem, self._wsem = rsem, wsem
        self._bell = bell
        self.doorbell = doorbell
        q = self._q
        self.slots, self.slot_size, self.max_message = q[W_SLOTS], q[W_SLOT_SIZE], q[W_MAX_MESSAGE]
        self._single_max = min(self.slot_size, self.max_message)  # fast path: one-slot messages
        stride = 8 + self.slot_size
        self._words = [(HEADER_BYTES + i * stride) // 8 for i in range(self.slots)]
        self._offsets = [HEADER_BYTES + i * stride + 8 for i in range(self.slots)]
        self._w_head = self._r_head = q[W_HEAD]
        self._w_tail = self._r_tail = q[W_TAIL]
        self.spin_s = 50e-6
        self.sleeps = 0  # semaphore waits by this object (statistics; not shared)
        self.late_wakes = 0  # waits that ran out although data had come: should stay ~0

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def create(cls, name: str, slots: int, slot_size: int, *, max_message: int | None = None,
               doorbell: str | _Named | None = None) -> ShmRing:
        """Create the segment and semaphores (mode 0o600); fails if the name already exists.

        `doorbell`: the name of an existing `Doorbell` (or the object) that the ring's reader
        will sleep on in `wait_any`; it is recorded in the header, so the attaching peer uses it.
        """
        bell_name = None if doorbell is None else doorbell if isinstance(doorbell, str) else doorbell.name
        return cls(*create_segment(name, slots, slot_size, max_message, bell_name))

    @classmethod
    def attach(cls, name: str) -> ShmRing:
        """Map an existing ring, validating magic, version and sizes (`RingLayoutError` if bad)."""
        return cls(*attach_segment(name))

    # ---- properties ---------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """slots * slot_size: the largest message the ring could ever hold."""
        return self.slots * self.slot_size

    @property
    def closed(self) -> bool:
        return bool(self._q[W_CLOSED])

    def pending_slots(self) -> int:
        """Slots published and not yet consumed (a snapshot)."""
        return self._q[W_HEAD] - self._q[W_TAIL]

    def shm_paths(self) -> list[str]:
        """The /dev/shm entries backing this ring."""
        return [f"{SHM_DIR}/{pre}{self.name}{suf}" for pre, suf in (("", ""), ("sem.", ".rd"), ("sem.", ".wr"))]

    # ---- writer -------------------------------------------------------------------------
    def put(self, data: bytes | bytearray | memoryview, timeout: float | None = None) -> None:
        """Publish one message; waits for room up to `timeout` s (None: forever), else `RingFull`."""
        if type(data) is not bytes and not isinstance(data, bytearray):
            data = memoryview(data).cast("B")
        n = len(data)
        head = self._w_head
        q = self._q
        if n <= self._single_max:
            if head - self._w_tail >= self.slots:
                self._wait_space(head, 1, timeout)
            i = head % self.slots
            off = self._offsets[i]
            self._mm[off:off + n] = data
            q[self._words[i]] = n | (_SINGLE << 32) | ((head & _STAMP_MASK) << 40)
            head += 1
        else:
            head = self._put_pieces(data, n, head, timeout)
        self._w_head = head
        q[W_HEAD] = head  # publish: everything above is visible before this store (TSO)
        sleeping = q[W_RSLEEP]
        if sleeping:  # 2: asleep in wait_any on the doorbell; 1: in wait() on .rd
            if sleeping == SLEEP_DOORBELL and self._bell is not None:
                self._bell.release()
            else:
                self._rsem.release()

    def try_put(self, data: bytes | bytearray | memoryview) -> bool:
        """Publish without waiting; False if the ring has no room now."""
        try:
            self.put(data, timeout=0)
        except RingFull:
            return False
        return True

    def _put_pieces(self, data: bytes | bytearray | memoryview, n: int, head: int,
                    timeout: float | None) -> int:
        if n > self.max_message:
            raise MessageTooLarge(
                f"message of {n} bytes exceeds ring {self.name!r} limit max_message={self.max_message} "
                f"bytes (capacity {self.slots} slots x {self.slot_size} bytes = {self.capacity})")
        size = self.slot_size
        pieces = -(-n // size)
        if head + pieces - self._w_tail > self.slots:
            self._wait_space(head, pieces, timeout)
        src = memoryview(data)
        for p in range(pieces):
            i = head % self.slots
            off = self._offsets[i]
            lo = p * size
            k = min(size, n - lo)
            self._mm[off:off + k] = src[lo:lo + k]
            flags = (_FIRST if p == 0 else 0) | (_LAST if p == pieces - 1 else 0)
            self._q[self._words[i]] = k | (flags << 32) | ((head & _STAMP_MASK) << 40)
            head += 1
        return head

    def _wait_space(self, head: int, need: int, timeout: float | None) -> None:
        q, slots = self._q, self.slots

        def room() -> bool:
            self._w_tail = q[W_TAIL]
            return head + need - self._w_tail <= slots

        if not sleep_until(self, q, room, timeout, W_WSLEEP, self._wsem):
            raise RingFull(f"ring {self.name!r} full: no room for a {need}-slot message "
                           f"({slots} slots of {self.slot_size} bytes) within timeout={timeout}s")

    # ---- reader -------------------------------------------------------------------------
    def try_get(self) -> bytes | None:
        """Next message, or None if none is published now."""
        tail = self._r_tail
        q = self._q
        if tail == self._r_head:
            head = q[W_HEAD]
            if head == tail:
                return None
            self._r_head = head
        i = tail % self.slots
        w = q[self._words[i]]
        if w >> 32 == _SINGLE | ((tail & _STAMP_MASK) << 8):
            off = self._offsets[i]
            data = self._mm[off:off + (w & _LEN_MASK)]
            tail += 1
        else:
            data, tail = self._get_pieces(tail)
        self._r_tail = tail
        q[W_TAIL] = tail  # release the slots only after the payload was copied out
        if q[W_WSLEEP]:
            self._wsem.release()
        return data

    def get(self, timeout: float | None = None) -> bytes | None:
        """Next message, waiting up to `timeout` s (None: forever); None on timeout.

        Raises `RingClosed` once the ring is closed and empty.
        """
        data = self.try_get()
        if data is None and timeout != 0 and self.wait(timeout):
            data = self.try_get()
        if data is None and self._q[W_CLOSED] and self._q[W_HEAD] == self._r_tail:
            raise RingClosed(f"ring {self.name!r} is closed")
        return data

    def drain(self, max_items: int = 1 << 30) -> list[bytes]:
        """Every message available now (at most `max_items`), without blocking."""
        out: list[bytes] = []
        while len(out) < max_items:
            data = self.try_get()
            if data is None:
                break
            out.append(data)
        return out

    def readable(self) -> bool:
        """True if a get() would not block now: a message is published, or the ring is closed."""
        q = self._q
        self._r_head = q[W_HEAD]
        return self._r_head != self._r_tail or bool(q[W_CLOSED])

    def wait(self, timeout: float | None = None) -> bool:
        """Sleep until a message is available (True) or `timeout` s pass (False); consumes nothing."""
        q = self._q

        def ready() -> bool:
            self._r_head = q[W_HEAD]
            return self._r_head != self._r_tail

        return ready() or sleep_until(self, q, ready, timeout, W_RSLEEP, self._rsem)

    def _get_pieces(self, tail: int) -> tuple[bytes, int]:
        parts: list[memoryview] = []
        k = tail
        try:
            while True:
                if k >= self._r_head:
                    raise RingError(f"ring {self.name!r} corrupt: message at slot {tail} runs past head")
                i = k % self.slots
                w = self._settled_word(i, k)
                flags, n = (w >> 32) & 0xFF, w & _LEN_MASK
                if bool(flags & _FIRST) != (k == tail) or n > self.slot_size:
                    raise RingError(f"ring {self.name!r} corrupt: slot {k} word {w:#x}")
                off = self._offsets[i]
                parts.append(self._buf[off:off + n])
                k += 1
                if flags & _LAST:
                    return b"".join(parts), k
        finally:
            for v in parts:  # views pin the mapping; release them so close() cannot fail
                v.release()

    def _settled_word(self, i: int, k: int) -> int:
        """The slot word once its stamp matches index k (waits out visibility lag on weak CPUs)."""
        for _ in range(10000):
            w = self._q[self._words[i]]
            if (w >> 40) == k & _STAMP_MASK:
                return w
        raise RingError(f"ring {self.name!r} corrupt: slot {k} has stamp {w >> 40} (two writers?)")

    # ---- shutdown -----------------------------------------------------------------------
    def mark_closed(self) -> None:
        """Tell the peer no more traffic will happen; wakes it if asleep.

        The reader then gets what is pending and `RingClosed` after; a writer gets `RingClosed`
        only when it would have to wait for room (put() does not check the flag otherwise).
        """
        self._q[W_CLOSED] = 1
        self._rsem.release()
        self._wsem.release()
        if self._bell is not None:
            self._bell.release()

    def close(self) -> None:
        """Unmap and close the semaphores (names stay until `unlink`). Idempotent."""
        if self._mm.closed:
            return
        self._q.release()
        self._buf.release()
        self._mm.close()
        self._rsem.close()
        self._wsem.close()
        if self._bell is not None:
            self._bell.close()

    def unlink(self) -> None:
        """Remove the segment and semaphore names (mappings stay valid until closed). Idempotent.

        The doorbell is not the ring's: its owner (`Doorbell.unlink`) removes it.
        """
        unlink_segment(self.name)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        bell = f", doorbell={self.doorbell!r}" if self.doorbell else ""
        return f"ShmRing({self.name!r}, slots={self.slots}, slot_size={self.slot_size}{bell})"
