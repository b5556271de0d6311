"""The decode worker serves its inbox while it waits for a step to land (DecodeWorker._await), on CPU with
a fake step event and fake rings: a new request is handed to prefill at once where the partition would
stay as it is, and a first token streams at once where the gap to the second stays within the ITL SLO."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

from rapidserve.config import PartitionConfig
from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.engine.first_token import StepClock
from rapidserve.partition.profile import Configuration
from rapidserve.partition.runtime import DecodePartition, PartitionPlan
from tests.decode_sched_fakes import make, new
from tests.test_partition_runtime import adaptive_plan


class Event:
    """Lands after `n` queries."""

    def __init__(self, n: int) -> None:
        self.n = n

    def query(self) -> bool:
        self.n -= 1
        return self.n < 0


@dataclass
class Ring:
    sent: list[Any] = field(default_factory=list)

    def send(self, msg: Any) -> None:
        self.sent.append(msg)

    def try_send(self, msg: Any) -> bool:
        self.sent.append(msg)
        return True


@dataclass
class IO:
    inbox: deque[list[Any]]
    to_prefill: Ring = field(default_factory=Ring)
    to_router: Ring = field(default_factory=Ring)

    def drain(self) -> list[Any]:
        return self.inbox.popleft() if self.inbox else []


class Grammar:
    def prepare(self, key: str, so: Any) -> bool:
        return True


@dataclass(frozen=True)
class Cfg:
    partition: PartitionConfig


def worker(inbox: list[list[Any]], partition: DecodePartition, step_ms: float | None) -> DecodeWorker:
    w = object.__new__(DecodeWorker)
    w.cfg = Cfg(partition.pcfg)  # type: ignore[assignment]
    w.io = IO(deque(inbox))  # type: ignore[assignment]
    w.sched, w.partition, w.grammar = make(), partition, Grammar()  # type: ignore[assignment]
    w.clock, w._out, w._stop = StepClock(), [], False
    if step_ms is not None:
        w.clock.landed(0.0)
        w.clock.landed(step_ms / 1e3)
    return w


def first_token(req_id: str) -> m.PrefillDone:
    return m.PrefillDone(req_id, 0, m.TokenOut(req_id, 0, 5))


STATIC = PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], None, "static split32")


@pytest.mark.parametrize(("plan", "slo", "step_ms", "queued", "handed", "streamed"), [
    # one configuration: hand off at once; 3 x 10 ms <= 45: stream at once
    (STATIC, 50.0, 10.0, True, ["r1"], True),
    (STATIC, 50.0, 16.0, True, ["r1"], False),  # 48 ms > 45: the first token waits for the step boundary
    (STATIC, 50.0, 16.0, False, ["r1"], True),  # nothing queued behind: 2 x 16 = 32 ms
    (STATIC, 50.0, None, True, ["r1"], False),  # no step measured yet
    # adaptive, decode on the whole GPU: prefill pending would switch at SLO 5: the boundary decides first
    (adaptive_plan(), 5.0, 1.0, True, [], True),
])
def test_await_serves_the_inbox(plan: PartitionPlan, slo: float, step_ms: float | None, queued: bool,
                                handed: list[str], streamed: bool) -> None:
    part = DecodePartition(PartitionConfig(slo_itl_ms=slo), plan)
    w = worker([[]], part, step_ms)
    w.sched.add(new(0))
    (kv0,) = w.sched.admit()
    w.io.inbox.append([first_token("r0"), new(1)])  # r0's prefill is done; r1 arrives
    w._await(Event(5), queued)  # type: ignore[arg-type]
    assert [kv.req_id for kv in w.io.to_prefill.sent] == handed
    sent = [t.req_id for b in w.io.to_router.sent for t in b.tokens]
    assert sent == (["r0"] if streamed else [])
    assert [t.req_id for t in w._out] == ([] if streamed else ["r0"])  # else streamed at the boundary
    assert [r.req_id for r in w.sched.waiting] == ([] if handed else ["r1"])


def test_await_returns_when_the_step_lands_with_nothing_to_do() -> None:
    w = worker([], DecodePartition(PartitionConfig(slo_itl_ms=50.0), STATIC), 10.0)
    ev = Event(3)
    w._await(ev, True)  # type: ignore[arg-type]
    assert ev.n < 0 and not w.io.to_prefill.sent and not w.io.to_router.sent
