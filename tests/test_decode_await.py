"""The decode worker serves its inbox while it waits for a step to land (DecodeWorker._await), on CPU with
a fake step event and fake rings: a new request is handed to prefill at once where the partition would
stay as it is; a first token waits for the step to land (the gap to the second token stays one step)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import pytest

from rapidserve.engine import messages as m
from rapidserve.engine.decode_worker import DecodeWorker
from rapidserve.partition.plan import PartitionPlan
from rapidserve.partition.profile import Configuration
from rapidserve.partition.runtime import DecodePartition
from rapidserve.partition.shape import Split
from rapidserve.partition.step_policies import AlwaysSplit
from rapidserve.partition_config import PartitionConfig
from tests.decode_sched_fakes import make, new
from tests.test_partition_manager import QWEN3
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


def worker(inbox: list[list[Any]], partition: DecodePartition) -> DecodeWorker:
    """A decode worker of rapid mode (`AlwaysSplit`: today's partition manager), in a split step."""
    w = object.__new__(DecodeWorker)
    w.cfg = Cfg(partition.pcfg)  # type: ignore[assignment]
    w.io = IO(deque(inbox))  # type: ignore[assignment]
    w.sched, w.partition, w.grammar = make(), partition, Grammar()  # type: ignore[assignment]
    w._out, w._first, w._stop = [], [], False
    w.policy, w.has_prefill, w.reads_queue = AlwaysSplit(partition, 8192, w._rapid_inputs), True, True
    w.queue_head = False
    w.config = w.fused_config = partition.current
    w.shape, w.step_tokens = Split(partition.current, 8192), 8192
    return w


def first_token(req_id: str) -> m.PrefillDone:
    return m.PrefillDone(req_id, 0, m.TokenOut(req_id, 0, 5))


STATIC = PartitionPlan("cuda-green", [Configuration("split32", 32, 100)], None, "static split32")


@pytest.mark.parametrize(("plan", "slo", "handed"), [
    (STATIC, 50.0, ["r1"]),  # one configuration: hand off at once
    (adaptive_plan(), 50.0, ["r1"]),  # overallocated meets SLO 50 beside prefill: no switch, hand off
    # prefill pending would switch at SLO 2 (even r1's few tokens beside a 1.5 ms step on the whole GPU miss
    # its 1.8 ms limit): the step boundary decides first
    (adaptive_plan(), 2.0, []),
    # the committed H100 Qwen3 profile would put decode on split16 beside prefill, but r1's few tokens keep
    # the whole GPU within the SLO (manager.beside_prefill_ms): hand off at once
    (adaptive_plan(QWEN3), 50.0, ["r1"]),
    (adaptive_plan(QWEN3), 12.0, []),  # 6.8 + 6.8 ms + r1's work > 10.8 ms: the step boundary decides first
])
def test_await_serves_the_inbox(plan: PartitionPlan, slo: float, handed: list[str]) -> None:
    part = DecodePartition(PartitionConfig(slo_itl_ms=slo), plan)
    w = worker([[]], part)
    w.sched.add(new(0))
    w.sched.admit()
    w.io.inbox.append([first_token("r0"), new(1)])  # r0's prefill is done; r1 arrives
    w._await(Event(5))  # type: ignore[arg-type]
    assert [kv.req_id for kv in w.io.to_prefill.sent] == handed
    assert not w.io.to_router.sent  # r0's first token streams after the step has landed (publish)
    assert [t.req_id for t in w._first] == ["r0"]  # held for the publish after the next launch
    assert [r.req_id for r in w.sched.waiting] == ([] if handed else ["r1"])


def test_await_returns_when_the_step_lands_with_nothing_to_do() -> None:
    w = worker([], DecodePartition(PartitionConfig(slo_itl_ms=50.0), STATIC))
    ev = Event(3)
    w._await(ev)  # type: ignore[arg-type]
    assert ev.n < 0 and not w.io.to_prefill.sent and not w.io.to_router.sent


class Backend:
    """No streams (as on CPU): a switch has nothing to synchronize."""

    def stream(self, config: str, role: str) -> None:
        return None


@pytest.mark.parametrize(("prompt", "sent"), [
    (100, []),  # a short prompt: the whole GPU beside it keeps the SLO; nothing to tell prefill
    (5000, ["split16"]),  # longer than the profile's forward: the profile's figure, 53.7 ms > 45: split at once
])
def test_the_step_boundary_tells_the_policy_the_pending_work(prompt: int, sent: list[str]) -> None:
    """The step boundary hands the rapid policy the scheduler's count of pending prompt tokens and its longest
    prompt (DecodeWorker._pending_work), and a switch reaches prefill as a SetPartition."""
    part = DecodePartition(PartitionConfig(slo_itl_ms=50.0), adaptive_plan(QWEN3), prefill_budget=8192)
    w = worker([], part)
    w.backend = Backend()  # type: ignore[assignment]
    w.sched.add(new(0))
    w.sched.admit()
    w.sched.prefill_done(first_token("r0"))  # r0 runs
    w.sched.add(new(1, n=prompt))
    w.begin_step()  # the step boundary: the policy's shape (split, on the manager's configuration), then admission
    assert [msg.config for msg in w.io.to_prefill.sent if isinstance(msg, m.SetPartition)] == sent
    assert part.current == (sent[-1] if sent else "overallocated")
