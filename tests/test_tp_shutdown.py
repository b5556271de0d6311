"""Tensor-parallel shutdown in order (engine/tp_workers.py): rank 0's process hosts the TCP store its group met on,
so at its exit a leader sends Stop and waits for its followers to exit first. A table for the wait, and gloo
ranks on CPU for `stop_followers` (the engines' order: test_tp_engines.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from rapidserve.engine.tp_workers import stop_followers, wait_exited
from rapidserve.ipc import Receiver, Sender, ShmRing
from rapidserve.loader.presets import preset_config
from rapidserve.parallel.group import TPGroup
from rapidserve.parallel.mirror import Leader, MirrorMessage, Stop, follow, send_each
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


def _rank(follower_lingers_s: float, spec: object, rings: list[str], q: object) -> None:
    """Rank 0 stops its followers as at a leader's exit and reports how long that took; a follower exits
    `follower_lingers_s` after Stop."""
    torch.set_num_threads(1)
    tp = TPGroup(spec, preset_config("tiny-llama"), torch.device("cpu"))  # type: ignore[arg-type]
    try:
        if tp.rank == 0:
            leader = Leader(tp, [Sender(ShmRing.attach(n), MirrorMessage) for n in rings], {})
            t0 = time.monotonic()
            orderly = stop_followers(leader, "done", timeout_s=1.0 if follower_lingers_s else 60.0)
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
