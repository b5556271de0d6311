"""Typed msgspec channels over ShmRing: round trips, several message types, multi-piece messages."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from rapidserve.ipc import Receiver, RingFull, Sender, ShmRing, new_engine_id, ring_name


class NewRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_ids: list[int]
    max_tokens: int = 16
    temperature: float = 1.0


class KVReady(msgspec.Struct, tag=True):
    request_id: str
    block_ids: list[int]


class Abort(msgspec.Struct, tag=True):
    request_id: str
    reason: str | None = None


Msg = NewRequest | KVReady | Abort


@pytest.fixture
def ring() -> Iterator[ShmRing]:
    r = ShmRing.create(ring_name(new_engine_id(), "chan"), 16, 64)
    yield r
    r.close()
    r.unlink()


def test_round_trip_typed(ring: ShmRing) -> None:
    tx: Sender[Msg] = Sender(ring, (NewRequest, KVReady, Abort))
    rx: Receiver[Msg] = Receiver(ShmRing.attach(ring.name), Msg)
    sent: list[Msg] = [NewRequest("r1", [1, 2, 3], max_tokens=4), KVReady("r1", [7, 8]), Abort("r2")]
    for m in sent:
        tx.send(m)
    got = [rx.recv(1), rx.try_recv()]
    assert got == sent[:2]
    assert type(got[0]) is NewRequest and type(got[1]) is KVReady
    assert rx.drain() == sent[2:]
    assert rx.try_recv() is None and rx.recv(0.01) is None and not rx.wait(0.01)
    rx.close()


def test_multi_piece_message(ring: ShmRing) -> None:
    tx: Sender[Msg] = Sender(ring, [NewRequest, KVReady, Abort])
    rx: Receiver[Msg] = Receiver(ring, Msg)
    big = NewRequest("long", list(range(150)), temperature=0.5)  # ~300 bytes: several 64-byte slots
    assert len(msgspec.msgpack.encode(big)) > 3 * ring.slot_size
    tx.send(big)
    assert ring.pending_slots() > 3
    assert rx.recv(1) == big


def test_single_type_and_drain_limit(ring: ShmRing) -> None:
    tx: Sender[KVReady] = Sender(ring, KVReady)
    rx: Receiver[KVReady] = Receiver(ring, KVReady)
    for i in range(5):
        tx.send(KVReady(f"r{i}", [i]))
    assert [m.request_id for m in rx.drain(3)] == ["r0", "r1", "r2"]
    assert [m.block_ids for m in rx.drain()] == [[3], [4]]
    assert rx.drain() == []


def test_wrong_type_and_full(ring: ShmRing) -> None:
    tx: Sender[Abort] = Sender(ring, Abort)
    with pytest.raises(TypeError, match="Abort"):
        tx.send(KVReady("x", []))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Sender(ring, (Abort, 3))
    while tx.try_send(Abort("fill")):
        pass
    with pytest.raises(RingFull):
        tx.send(Abort("late"), timeout=0.01)


def test_undeclared_type_fails_to_decode(ring: ShmRing) -> None:
    Sender(ring, Abort).send(Abort("x"))
    rx: Receiver[KVReady] = Receiver(ring, KVReady)
    with pytest.raises(msgspec.ValidationError):
        rx.recv(1)


def _child_sender(name: str, n: int) -> None:
    ring = ShmRing.attach(name)
    tx: Sender[Msg] = Sender(ring, (NewRequest, KVReady, Abort))
    for i in range(n):
        tx.send(NewRequest(f"r{i}", list(range(i % 60))) if i % 2 else KVReady(f"r{i}", [i] * (i % 40)))
    tx.send(Abort("done", reason="end"))
    ring.close()


def test_across_processes(ring: ShmRing) -> None:
    rx: Receiver[Msg] = Receiver(ring, Msg)
    proc = mp.get_context("spawn").Process(target=_child_sender, args=(ring.name, 2000))
    proc.start()
    got: list[Any] = []
    while not got or not isinstance(got[-1], Abort):
        msg = rx.recv(30)
        assert msg is not None
        got.append(msg)
    proc.join(30)
    assert proc.exitcode == 0
    assert len(got) == 2001
    for i, m in enumerate(got[:-1]):
        assert m.request_id == f"r{i}"
        assert isinstance(m, NewRequest if i % 2 else KVReady)
    assert got[-1] == Abort("done", reason="end")
