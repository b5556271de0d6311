"""ShmRing: layout, validation, pieces, limits, timeouts, wake-ups, naming, cleanup, stress."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import posix_ipc
import pytest
from conftest import MakeRing
from fork_context import child_context

from rapidserve.ipc.ring import (
    MessageTooLarge,
    RingClosed,
    RingFull,
    RingLayoutError,
    ShmRing,
    cleanup_stale,
    new_engine_id,
    ring_name,
)

REPO = Path(__file__).resolve().parent.parent



@pytest.fixture
def raw_name() -> Iterator[str]:
    """A unique name for hand-made segments; whatever got created under it is unlinked."""
    name = ring_name(new_engine_id(), "raw")
    yield name
    for fn, sfx in ((posix_ipc.unlink_shared_memory, ""), (posix_ipc.unlink_semaphore, ".rd"),
                    (posix_ipc.unlink_semaphore, ".wr")):
        with contextlib.suppress(posix_ipc.ExistentialError):
            fn("/" + name + sfx)


def _words(name: str, *offsets: int) -> list[int]:
    data = Path(f"/dev/shm/{name}").read_bytes()
    return [struct.unpack_from("<Q", data, off)[0] for off in offsets]


def test_layout(make_ring: MakeRing) -> None:
    ring = make_ring(slots=4, slot_size=16)
    assert os.path.getsize(f"/dev/shm/{ring.name}") == 512 + 4 * (8 + 16)
    magic, version, slots, slot_size, max_msg, pid = _words(ring.name, 0, 8, 16, 24, 32, 40)
    assert magic.to_bytes(8, "little") == b"rsvRING\x00"
    assert (version, slots, slot_size, max_msg, pid) == (1, 4, 16, 64, os.getpid())
    ring.put(b"abc")
    ring.put(b"x" * 20)  # two pieces: slots 1 and 2
    head, tail = _words(ring.name, 64, 128)
    assert (head, tail) == (3, 0)
    w0, w1, w2 = _words(ring.name, 512, 512 + 24, 512 + 48)
    assert w0 == 3 | (3 << 32) | (0 << 40)
    assert w1 == 16 | (1 << 32) | (1 << 40)  # FIRST piece, stamp 1
    assert w2 == 4 | (2 << 32) | (2 << 40)  # LAST piece, stamp 2
    assert Path(f"/dev/shm/{ring.name}").read_bytes()[520:523] == b"abc"
    assert ring.get(0) == b"abc" and ring.get(0) == b"x" * 20
    assert _words(ring.name, 128) == [3]


def test_create_validation(make_ring: MakeRing) -> None:
    for slots, slot_size in ((0, 8), (4, 0), (4, 12), (1 << 25, 8)):
        with pytest.raises(ValueError):
            make_ring(slots=slots, slot_size=slot_size)
    with pytest.raises(ValueError, match="max_message"):
        make_ring(slots=2, slot_size=8, max_message=17)
    with pytest.raises(ValueError, match="ring_name"):
        ShmRing.create(f"rapidserve-{os.getpid() + 1}-x-y", 2, 8)
    ring = make_ring()
    with pytest.raises(posix_ipc.ExistentialError):
        ShmRing.create(ring.name, 2, 8)


def test_wraparound(make_ring: MakeRing) -> None:
    ring = make_ring(slots=5, slot_size=16)
    rng = random.Random(1)
    sent: list[bytes] = []
    for i in range(3000):
        msg = rng.randbytes(rng.randrange(0, 49))  # 1..4 pieces
        while not ring.try_put(msg):
            sent_msg = sent.pop(0)
            assert ring.try_get() == sent_msg
        sent.append(msg)
        if i % 7 == 0 and sent:
            assert ring.get(0) == sent.pop(0)
    assert ring.drain() == sent
    assert ring.try_get() is None and ring.pending_slots() == 0


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 640])
def test_pieces(make_ring: MakeRing, size: int) -> None:
    ring = make_ring(slots=16, slot_size=64)
    msg = random.Random(size).randbytes(size)
    for shift in (0, 1, 7):  # start the message at different slots (and wrap around)
        for _ in range(shift):
            ring.put(b"s")
            assert ring.get(0) == b"s"
        ring.put(msg)
        assert ring.pending_slots() == max(1, -(-size // 64))
        assert ring.get(0) == msg


def test_too_large_names_limit(make_ring: MakeRing) -> None:
    ring = make_ring(slots=4, slot_size=16)
    with pytest.raises(MessageTooLarge, match="max_message=64"):
        ring.put(b"x" * 65)
    ring.put(b"x" * 64)
    assert ring.get(0) == b"x" * 64
    small = make_ring(slots=4, slot_size=16, max_message=10)
    with pytest.raises(MessageTooLarge, match="max_message=10"):
        small.put(b"x" * 11)
    small.put(b"x" * 10)


def test_timeouts(make_ring: MakeRing) -> None:
    ring = make_ring(slots=2, slot_size=8)
    t0 = time.monotonic()
    assert ring.get(timeout=0.1) is None
    assert 0.09 <= time.monotonic() - t0 < 1.0
    assert ring.try_get() is None and ring.get(0) is None and not ring.wait(0.02)
    ring.put(b"a")
    ring.put(b"b")
    assert not ring.try_put(b"c")
    t0 = time.monotonic()
    with pytest.raises(RingFull, match="full"):
        ring.put(b"c", timeout=0.1)
    assert 0.09 <= time.monotonic() - t0 < 1.0
    with pytest.raises(TimeoutError):
        ring.put(b"c" * 9, timeout=0)
    assert ring.wait(0) and ring.drain(1) == [b"a"] and ring.drain() == [b"b"]


def test_signal_does_not_break_wait(make_ring: MakeRing) -> None:
    ring = make_ring()
    hits: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda *_: hits.append(1))
    timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGUSR1))
    try:
        timer.start()
        assert ring.get(timeout=0.4) is None  # the handler ran; the wait went on to its timeout
    finally:
        timer.join()
        signal.signal(signal.SIGUSR1, old)
    assert hits == [1]


def test_closed(make_ring: MakeRing) -> None:
    ring = make_ring(slots=1, slot_size=8)
    ring.put(b"last")
    ring.mark_closed()
    assert ring.closed
    with pytest.raises(RingClosed):
        ring.put(b"more", timeout=1)  # full ring of a closed peer: no waiting
    assert ring.get(1) == b"last"
    with pytest.raises(RingClosed):
        ring.get(1)


def _late_writer(name: str, rounds: int, delay: float, out: Any) -> None:
    ring = ShmRing.attach(name)
    asleep = []
    for i in range(rounds):
        time.sleep(delay)
        asleep.append(_words(name, 192)[0])  # the reader_sleeping flag, read before the put
        t = time.monotonic()
        ring.put(struct.pack("<d", t) + bytes([i]))
    ring.close()
    out.send(asleep)


def _late_reader(name: str, rounds: int, delay: float, out: Any) -> None:
    ring = ShmRing.attach(name)
    time.sleep(delay)
    asleep = _words(name, 256)[0]  # the writer_sleeping flag, read before the first get
    t = time.monotonic()
    got = [ring.get(10) for _ in range(rounds)]
    ring.close()
    out.send((asleep, t, got))


def _child_result(proc: Any, rx: Any, timeout: float = 30) -> Any:
    """The child's result; if none comes, kill the child and fail (a test never hangs)."""
    deadline = time.monotonic() + timeout
    try:
        while not rx.poll(0.05):
            if not proc.is_alive() and not rx.poll(0) or time.monotonic() > deadline:
                pytest.fail(f"child {proc.name} sent no result (exit code {proc.exitcode})")
        return rx.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def test_sleeping_reader_woken_by_other_process(make_ring: MakeRing) -> None:
    ring = make_ring(slots=4, slot_size=16)
    ctx = child_context()
    rx, tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_late_writer, args=(ring.name, 10, 0.05, tx))
    proc.start()
    latencies = []
    try:
        for i in range(10):
            msg = ring.get(timeout=10)
            assert msg is not None and msg[8] == i
            latencies.append(time.monotonic() - struct.unpack("<d", msg[:8])[0])
    finally:
        asleep = _child_result(proc, rx)
    assert proc.exitcode == 0
    assert sum(asleep) >= 8, asleep  # the reader really was asleep on the semaphore
    assert max(latencies) < 0.1, latencies  # woken by the post, not by a timeout


def test_full_writer_woken_by_other_process(make_ring: MakeRing) -> None:
    ring = make_ring(slots=2, slot_size=16)
    ring.put(b"a")
    ring.put(b"b")
    ctx = child_context()
    rx, tx = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_late_reader, args=(ring.name, 3, 0.5, tx))
    proc.start()
    try:
        ring.put(b"c", timeout=30)  # blocks, asleep, until the child reads "a"
        woken = time.monotonic()
    finally:
        asleep, first_get, got = _child_result(proc, rx)
    assert proc.exitcode == 0
    assert got == [b"a", b"b", b"c"]
    assert asleep == 1
    assert woken - first_get < 0.1


def test_attach_errors(make_ring: MakeRing, raw_name: str) -> None:
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(ring_name(new_engine_id(), "missing"))
    shm = posix_ipc.SharedMemory("/" + raw_name, posix_ipc.O_CREX, mode=0o600, size=100)
    shm.close_fd()
    with pytest.raises(RingLayoutError, match="smaller than the 512-byte ring header"):
        ShmRing.attach(raw_name)
    os.truncate(f"/dev/shm/{raw_name}", 4096)
    with pytest.raises(RingLayoutError, match="bad magic"):
        ShmRing.attach(raw_name)
    ring = make_ring(slots=8, slot_size=64)
    os.truncate(f"/dev/shm/{ring.name}", 512 + 3 * 72)
    with pytest.raises(RingLayoutError, match="truncated"):
        ShmRing.attach(ring.name)
    ring2 = make_ring(slots=2, slot_size=8)
    with open(f"/dev/shm/{ring2.name}", "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<Q", 99))
    with pytest.raises(RingLayoutError, match="version 99"):
        ShmRing.attach(ring2.name)
    ring3 = make_ring(slots=2, slot_size=8)
    posix_ipc.unlink_semaphore("/" + ring3.name + ".rd")
    with pytest.raises(RingLayoutError, match="semaphores"):
        ShmRing.attach(ring3.name)


def test_attach_roundtrip_and_unlink(make_ring: MakeRing) -> None:
    ring = make_ring(slots=4, slot_size=32)
    peer = ShmRing.attach(ring.name)
    assert (peer.slots, peer.slot_size, peer.max_message) == (4, 32, 128)
    ring.put(b"hello")
    assert peer.get(1) == b"hello"
    paths = ring.shm_paths()
    assert all(os.path.exists(p) for p in paths)
    ring.unlink()
    assert not any(os.path.exists(p) for p in paths)
    with pytest.raises(FileNotFoundError):
        ShmRing.attach(ring.name)
    ring.put(b"still mapped")
    assert peer.get(0) == b"still mapped"
    peer.close()
    peer.close()  # idempotent
    ring.unlink()  # idempotent


def test_permissions_0600(make_ring: MakeRing) -> None:
    old = os.umask(0)
    try:
        ring = make_ring()
    finally:
        os.umask(old)
    for path in ring.shm_paths():
        assert os.stat(path).st_mode & 0o777 == 0o600, path


def test_cleanup_stale(make_ring: MakeRing) -> None:
    live = make_ring()
    code = ("from rapidserve.ipc.ring import ShmRing, ring_name\n"
            "print(ShmRing.create(ring_name('deadbeef', 'orphan'), 2, 8).name)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         check=True, timeout=60)
    dead = out.stdout.strip()
    dead_entries = [dead, f"sem.{dead}.rd", f"sem.{dead}.wr"]
    assert all(os.path.exists(f"/dev/shm/{e}") for e in dead_entries)
    removed = cleanup_stale()
    assert all(e.startswith(("rapidserve-", "sem.rapidserve-")) for e in removed)
    assert not any(os.path.exists(f"/dev/shm/{e}") for e in dead_entries)
    assert all(os.path.exists(p) for p in live.shm_paths())
    assert not any(live.name in r for r in removed)


# ---- stress -------------------------------------------------------------------------------
STRESS_MESSAGES = 300_000  # the spinning variant: the writer naps 3 times, the reader 3 times (1M: 35 s serial)
_HDR = struct.Struct("<QII")  # sequence number, payload length, crc32 of the payload


def _stress_sizes(rng: random.Random) -> int:
    r = rng.random()
    if r < 0.75:
        return rng.randrange(0, 128 - _HDR.size + 1)  # one slot
    if r < 0.97:
        return rng.randrange(128, 1024)  # 2-9 pieces
    return rng.randrange(1024, 64 * 128 - _HDR.size + 1)  # up to the whole ring


def _stress_writer(name: str, count: int, seed: int, spin_s: float) -> None:
    ring = ShmRing.attach(name)
    ring.spin_s = spin_s
    rng = random.Random(seed)
    pool = rng.randbytes(1 << 16)
    pack, crc, put = _HDR.pack, zlib.crc32, ring.put
    for seq in range(count):
        n = _stress_sizes(rng)
        off = rng.randrange(0, len(pool) - n)
        payload = pool[off:off + n]
        put(pack(seq, n, crc(payload)) + payload, 60)
        if seq % 100_000 == 99_999:
            time.sleep(0.01)  # let the reader fall asleep now and then
    ring.close()


@pytest.mark.slow
@pytest.mark.parametrize(("count", "spin_s"), [(STRESS_MESSAGES, 50e-6), (100_000, 0.0)],
                         ids=["spin", "always-sleep"])
def test_stress_two_processes(make_ring: MakeRing, count: int, spin_s: float) -> None:
    """Seq + crc per message: none lost, duplicated, reordered or corrupted.

    The "always-sleep" variant never spins, so both sides go through the flag / re-check / sleep
    protocol all the time; a wake-up that is not posted shows up as a late wake (a nap that ran
    out although data had come).
    """
    ring = make_ring(slots=64, slot_size=128)
    ring.spin_s = spin_s
    ctx = child_context()
    proc = ctx.Process(target=_stress_writer, args=(ring.name, count, 1234, spin_s))
    t0 = time.monotonic()
    proc.start()
    unpack, crc, get, hsize = _HDR.unpack_from, zlib.crc32, ring.get, _HDR.size
    pieces = 0
    try:
        for expect in range(count):
            msg = get(60)
            assert msg is not None, f"timed out waiting for message {expect}"
            seq, n, c = unpack(msg)
            if seq != expect or n != len(msg) - hsize or crc(memoryview(msg)[hsize:]) != c:
                pytest.fail(f"message {expect}: got seq {seq}, length {n}/{len(msg) - hsize}, crc "
                            f"{c:#x}/{crc(memoryview(msg)[hsize:]):#x}")
            pieces += -(-len(msg) // 128)
            if expect % 100_000 == 0:
                time.sleep(0.01)  # let the writer fill the ring and sleep on it
        proc.join(60)
        assert proc.exitcode == 0
        assert ring.try_get() is None  # nothing duplicated after the last one
    finally:
        if proc.is_alive():
            proc.kill()
    elapsed = time.monotonic() - t0
    print(f"stress: {count} messages, {pieces} slots, spin_s={spin_s}: {elapsed:.1f} s")
    assert pieces > count * 1.5  # multi-piece messages really happened
    print(f"reader slept {ring.sleeps} times, late wakes {ring.late_wakes}")
    if spin_s == 0:
        assert ring.sleeps > 1000
    # A late wake is a nap that ran out although data had come (store-buffer window, or the writer
    # preempted between publishing and posting): rare, never systematic.
    assert ring.late_wakes <= 5 + ring.sleeps // 10
