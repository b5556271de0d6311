"""Single-producer / single-consumer byte-message ring in POSIX shared memory (see `ShmRing`)."""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import time
import uuid
from collections.abc import Callable
from typing import Protocol

import posix_ipc

from rapidserve.ipc.shm import (
    DOORBELL_NAME_MAX,
    DOORBELL_OFF,
    FIRST_NAP_S,
    HEADER_BYTES,
    MAGIC,
    NAME_PREFIX,
    NAME_RE,
    NAP_S,
    SHM_DIR,
    SLEEP_DOORBELL,
    SLEEP_RING,
    VERSION,
    VERSION_DOORBELL,
    W_CLOSED,
    W_CREATOR,
    W_DOORBELL_LEN,
    W_HEAD,
    W_MAGIC,
    W_MAX_MESSAGE,
    W_RSLEEP,
    W_SLOT_SIZE,
    W_SLOTS,
    W_TAIL,
    W_VERSION,
    W_WSLEEP,
    nap_on,
    ring_name,
)

# Names importers have always taken from here (the constants and helpers now live in shm.py).
__all__ = ["DOORBELL_NAME_MAX", "NAME_PREFIX", "SHM_DIR", "MessageTooLarge", "RingClosed", "RingError", "RingFull",
           "RingLayoutError", "ShmRing", "cleanup_stale", "nap_on", "new_engine_id", "pid_alive", "ring_name"]

_FIRST, _LAST = 1, 2  # piece flags; a middle piece has neither, a one-piece message both
_SINGLE = _FIRST | _LAST
_LEN_MASK = 0xFFFFFFFF
_STAMP_MASK = 0xFFFFFF


class _Named(Protocol):
    """A `Doorbell` as `ShmRing.create` sees it (ring.py does not import doorbell.py, which uses it)."""

    name: str


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


class ShmRing:
    """SPSC ring of fixed-size slots in one POSIX shared-memory segment, plus two named semaphores.

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
    false-share. A message of n bytes takes ``max(1, ceil(n / slot_size))`` consecutive slots
    (first / middle / last pieces, wrapping from the last slot to slot 0); it must fit in the
    ring as a whole (``n <= max_message <= slots * slot_size``), else `MessageTooLarge`.

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

    Sleeping, and why no wake-up is lost. An idle reader spins (with sched_yield) for `spin_s`,
    then stores reader_sleeping = 1, RE-CHECKS head, and only then waits on the ``.rd``
    semaphore; after every publication the writer loads reader_sleeping and posts if it is set.
    Either the reader's re-check sees the new head, or the writer's load sees the flag: both
    missing needs each side's load to pass its own older store. Even x86-TSO allows that
    (store buffer) and Python cannot emit a fence, so the reader's first wait is short
    (`FIRST_NAP_S`) and is followed by another head check; by then its flag store is globally
    visible, so every later publication posts. A wake-up is thus at worst delayed by 1 ms in
    that nanosecond window, never lost. The reader clears the flag only when it leaves the wait;
    surplus posts just cause a spurious wake (after a wake it drains the count and re-checks).
    The writer blocked on a full ring does the same with writer_sleeping, tail and ``.wr``.

    Doorbell. reader_sleeping also says WHERE the reader sleeps: 1 on the ring's ``.rd``
    (`wait`, `get`), 2 on the ring's doorbell, a semaphore shared by all inbox rings of one
    reading thread (`rapidserve.ipc.doorbell.wait_any`, which documents that protocol). After a
    publication the writer posts ``.rd`` for 1, the doorbell for 2. The flag / re-check argument
    above is per ring and holds unchanged; only the semaphore slept on differs.

    Names: segment ``/dev/shm/<name>``, semaphores ``/dev/shm/sem.<name>.rd`` / ``.wr``, all
    mode 0o600; `name` must come from `ring_name` (it embeds the creating pid, for
    `cleanup_stale`). `create` in the owner, `attach` in the peer; `close` unmaps, `unlink`
    (the owner, at shutdown) removes the names. A `ShmRing` object caches its side's indices, so
    use one object per role (one may serve as both in a single-process loopback).
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
        return cls(name, mm, sems[0], sems[1], bell, bell_name)

    @classmethod
    def attach(cls, name: str) -> ShmRing:
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
        return cls(name, mm, sems[0], sems[1], sems[2] if bell_name else None, bell_name)

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

        if not self._sleep_until(room, timeout, W_WSLEEP, self._wsem):
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

        return ready() or self._sleep_until(ready, timeout, W_RSLEEP, self._rsem)

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

    # ---- sleeping -----------------------------------------------------------------------
    def _sleep_until(self, cond: Callable[[], bool], timeout: float | None, flag: int,
                     sem: posix_ipc.Semaphore) -> bool:
        """Spin briefly, then the flag / re-check / sleep protocol of the class docstring."""
        q = self._q
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_end = now + min(self.spin_s, timeout if timeout is not None else self.spin_s)
        while True:
            if cond():
                return True
            if q[W_CLOSED]:
                raise RingClosed(f"ring {self.name!r} is closed")
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
                    raise RingClosed(f"ring {self.name!r} is closed")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self.sleeps += 1
                posted = nap_on(sem, nap if left is None else min(nap, left))
                nap = NAP_S
            if not posted:  # the data came while a nap ran out: its post was missed or late
                self.late_wakes += 1
            return True
        finally:
            q[flag] = 0

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
        for fn, nm in ((posix_ipc.unlink_shared_memory, ""), (posix_ipc.unlink_semaphore, ".rd"),
                       (posix_ipc.unlink_semaphore, ".wr")):
            with contextlib.suppress(posix_ipc.ExistentialError):
                fn("/" + self.name + nm)

    def __enter__(self) -> ShmRing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        bell = f", doorbell={self.doorbell!r}" if self.doorbell else ""
        return f"ShmRing({self.name!r}, slots={self.slots}, slot_size={self.slot_size}{bell})"
