"""Tensor-parallel shutdown in order (engine/tp_workers.py): rank 0's process hosts the TCP store its group met on,
so at its exit a leader sends Stop and waits for its followers to exit first. A table for the wait, the Stop to a
follower whose mirror ring is full (tried again until it drains or the deadline passes: fake rings on a fake
clock, and a real small ring drained by a thread), and gloo ranks on CPU for `stop_followers` (the engines'
order: test_tp_engines.py)."""

from __future__ import annotations

import logging
import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rapidserve.engine.tp_workers import FollowersStopped, stop_followers, wait_exited
from rapidserve.ipc import Receiver, RingClosed, Sender, ShmRing
from rapidserve.loader.presets import preset_config
from rapidserve.parallel.group import TPGroup
from rapidserve.parallel.mirror import Leader, MirrorMessage, Sampled, Stop, follow, send_each
from tests.conftest import MakeRing
from tests.tp_harness import run_ranks


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


@pytest.mark.parametrize("exits_after_s,timeout_s,want", [
    ({}, 1.0, True),  # no followers
    ({11: 0.0, 12: 0.0}, 1.0, True),  # already gone
    ({11: 0.0, 12: 0.5}, 1.0, True),  # one goes within the wait
    ({11: 0.3, 12: 0.9}, 1.0, True),
    ({11: 0.0, 12: 2.0}, 1.0, False),  # one outlives the wait
    ({11: 0.5}, 0.0, False),  # no wait at all
    ({11: 0.0}, 0.0, True),
])
def test_wait_exited(exits_after_s: dict[int, float], timeout_s: float, want: bool) -> None:
    clock = FakeClock()
    got = wait_exited(list(exits_after_s), timeout_s, alive=lambda pid: clock.t < exits_after_s[pid],
                      clock=clock, sleep=clock.sleep)
    assert got is want
    assert clock.t <= timeout_s + 0.011  # never waits past the bound


class FullFor:
    """A ring that refuses every message until the clock reaches `free_at_s` (None: it never frees)."""

    def __init__(self, clock: FakeClock, free_at_s: float | None) -> None:
        self.clock, self.free_at_s = clock, free_at_s
        self.got: list[object] = []

    def try_send(self, msg: object) -> bool:
        if self.free_at_s is None or self.clock.t < self.free_at_s:
            return False
        self.got.append(msg)
        return True


@pytest.mark.parametrize("free_at_s,timeout_s,want", [
    ([0.0, 0.0], 0.0, [True, True]),  # room everywhere: no wait
    ([0.0, 0.5], 1.0, [True, True]),  # the full ring drains within the time: tried again until it takes it
    ([0.5, 0.2], 1.0, [True, True]),  # any order
    ([0.0, 0.5], 0.0, [True, False]),  # no retry allowed: the old behaviour
    ([0.0, None], 1.0, [True, False]),  # never drains: given up at the deadline, the others still got it
    ([None, None], 0.3, [False, False]),
    ([], 1.0, []),  # no followers
])
def test_send_each_retries_a_full_ring_until_the_deadline(free_at_s: list[float | None], timeout_s: float,
                                                          want: list[bool]) -> None:
    clock = FakeClock()
    rings = [FullFor(clock, f) for f in free_at_s]
    got = send_each(rings, Stop("done"), timeout_s, clock=clock, sleep=clock.sleep)
    assert got == want
    assert all(len(r.got) == int(ok) for r, ok in zip(rings, got, strict=True))  # each took it at most once
    assert clock.t <= timeout_s + 0.011  # never past the bound


class Closed:
    """A ring whose reader closed it: every send raises."""

    def try_send(self, msg: object) -> bool:
        raise RingClosed("ring 'x' is closed")


@pytest.mark.parametrize("rings,gone,timeout_s,want,waited_s", [
    (["closed", 0.0], set(), 1.0, [False, True], 0.0),  # a closed ring is given up, without raising or waiting
    ([None, 0.0], {0}, 1.0, [False, True], 0.0),  # a full ring whose reader has exited: no wait for it
    ([None, 0.5], {0}, 1.0, [False, True], 0.5),  # ... while the other is still waited for
    ([0.0], {0}, 1.0, [True], 0.0),  # a ring with room is written whether or not its reader looks gone
    ([0.3, None], set(), 1.0, [True, False], 1.0),  # alive and never drains: the deadline
])
def test_send_each_gives_up_on_a_ring_nobody_will_drain(rings: list[Any], gone: set[int], timeout_s: float,
                                                        want: list[bool], waited_s: float) -> None:
    clock = FakeClock()
    made = [Closed() if r == "closed" else FullFor(clock, r) for r in rings]
    got = send_each(made, Stop("done"), timeout_s, clock=clock, sleep=clock.sleep, reader_gone=gone.__contains__)
    assert got == want
    assert clock.t == pytest.approx(waited_s, abs=0.011)


def fake_leader(clock: FakeClock, free_at_s: list[float | None]) -> tuple[Leader, list[FullFor]]:
    """A leader of followers 1..N-1 (pids 101, 102...) whose rings free up at `free_at_s`."""
    rings = [FullFor(clock, f) for f in free_at_s]
    tp = SimpleNamespace(pids=tuple(100 + r for r in range(len(rings) + 1)))
    return Leader(tp, rings, {}), rings  # type: ignore[arg-type]


@pytest.mark.parametrize("free_at_s,exits_at_s,want,log_says", [
    # rank 1 drains at once, rank 2 after 0.5 s (then exits): both get the Stop, in time
    ([0.0, 0.5], [0.1, 0.6], FollowersStopped(), None),
    # rank 2's ring never drains: named, the others still stopped; rank 2 is left to the router
    ([0.0, None, 0.2], [0.1, 99.0, 0.3], FollowersStopped(missed=(2,)), "TP ranks [2] never took the leader's Stop"),
    # rank 1 took it but runs on past the deadline
    ([0.0], [99.0], FollowersStopped(lingering=(1,)), "TP ranks [1] took the leader's Stop"),
    # rank 1 had died with a full ring: nobody to stop, nothing to wait for
    ([None], [0.0], FollowersStopped(), None),
])
def test_stop_followers_names_the_ranks_that_never_took_the_stop(
        free_at_s: list[float | None], exits_at_s: list[float], want: FollowersStopped, log_says: str | None,
        caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    leader, rings = fake_leader(clock, free_at_s)
    exits = {100 + r: t for r, t in enumerate(exits_at_s, start=1)}
    with caplog.at_level(logging.INFO, logger="rapidserve.engine.tp_workers"):
        got = stop_followers(leader, "the decode leader exited", timeout_s=3.0, alive=lambda pid: clock.t < exits[pid],
                             clock=clock, sleep=clock.sleep)
    assert got == want and got.orderly is (want == FollowersStopped())
    assert [len(r.got) for r in rings] == [int(r + 1 not in want.missed and f is not None)
                                          for r, f in enumerate(free_at_s)]  # each Stop sent at most once
    assert clock.t <= 3.0 + 0.011  # one deadline for the Stop and the wait
    if log_says is None:
        assert not caplog.records
    else:
        assert log_says in caplog.text and "the decode leader exited" in caplog.text


def fill(sender: Sender[Any]) -> int:
    """Fill a ring with `Sampled` messages until it refuses one; how many it took."""
    n = 0
    while sender.try_send(Sampled(n, 1)):
        n += 1
    return n


def test_a_full_ring_takes_the_stop_once_its_follower_drains(make_ring: MakeRing) -> None:
    ring = make_ring(slots=4, slot_size=64)
    sender, receiver = Sender(ShmRing.attach(ring.name), MirrorMessage), Receiver(ring, MirrorMessage)
    queued = fill(sender)
    assert queued == 4 and not sender.try_send(Stop("x"))
    got: list[Any] = []

    def follower() -> None:  # behind: starts replaying 0.3 s later, a message at a time, until Stop
        time.sleep(0.3)
        while not got or not isinstance(got[-1], Stop):
            msg = receiver.recv(timeout=5.0)
            assert msg is not None
            got.append(msg)

    t = threading.Thread(target=follower)
    t.start()
    leader = Leader(SimpleNamespace(pids=(1, 2)), [sender], {})  # type: ignore[arg-type]
    t0 = time.monotonic()
    sent = leader.stop("done", timeout_s=10.0)
    took = time.monotonic() - t0
    t.join(10.0)
    sender.close()
    assert sent == [True] and 0.25 < took < 5.0  # waited for room, not for the deadline
    assert got == [*(Sampled(n, 1) for n in range(queued)), Stop("done")]  # after everything before it


def test_a_ring_that_never_drains_is_given_up_at_the_deadline(make_ring: MakeRing) -> None:
    ring = make_ring(slots=4, slot_size=64)
    sender = Sender(ShmRing.attach(ring.name), MirrorMessage)
    fill(sender)
    leader = Leader(SimpleNamespace(pids=(1, os.getpid())), [sender], {})  # type: ignore[arg-type]
    t0 = time.monotonic()
    got = stop_followers(leader, "done", timeout_s=0.3)  # rank 1 (this process) alive, its ring full for good
    took = time.monotonic() - t0
    sender.close()
    assert got == FollowersStopped(missed=(1,)) and not got.orderly
    assert 0.29 < took < 1.5  # no hang


def _rank(follower_lingers_s: float, spec: object, rings: list[str], q: object) -> None:
    """Rank 0 stops its followers as at a leader's exit and reports how long that took; a follower exits
    `follower_lingers_s` after Stop."""
    torch.set_num_threads(1)
    tp = TPGroup(spec, preset_config("tiny-llama"), torch.device("cpu"))  # type: ignore[arg-type]
    try:
        if tp.rank == 0:
            leader = Leader(tp, [Sender(ShmRing.attach(n), MirrorMessage) for n in rings], {})
            t0 = time.monotonic()
            orderly = stop_followers(leader, "done", timeout_s=1.0 if follower_lingers_s else 60.0).orderly
            q.put((0, orderly, tp.pids, time.monotonic() - t0))  # type: ignore[attr-defined]
        else:
            why = follow(None, Receiver(ShmRing.attach(rings[tp.rank - 1]), MirrorMessage), lambda name: None,
                         lambda: True)  # type: ignore[arg-type]
            q.put((tp.rank, why, os.getpid(), 0.0))  # type: ignore[attr-defined]
            time.sleep(follower_lingers_s)
    finally:
        tp.close()


@pytest.mark.parametrize("tp", [2, 4])
def test_the_leader_outlives_its_followers(tp: int) -> None:
    got = run_ranks(_rank, tp, before=(0.0,))
    orderly, pids, _ = got[0]
    assert orderly  # every follower had exited when stop_followers returned
    assert pids[1:] == tuple(got[r][1] for r in range(1, tp)) and pids[0] > 0  # the group's processes, by rank
    assert all(got[r][0] == "done" for r in range(1, tp))  # Stop came


def test_the_wait_for_a_lingering_follower_is_bounded() -> None:
    got = run_ranks(_rank, 2, before=(3.0,))
    orderly, _, waited = got[0]
    assert not orderly
    assert 0.9 < waited < 2.5  # the bound, not the follower's 3 s
