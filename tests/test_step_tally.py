"""The decode worker's step counts by kind (engine/step_tally.py), as the Stats carry them and data parallelism
combines them (engine/dp_stats.py); pure, from tables of StepTimings; and the host's view of a landed step
(engine/step_cycle.py's `Landed`: its token gap and the device's idle time before it) with fake device events."""

from __future__ import annotations

import math

import msgspec
import pytest

from rapidserve.engine import messages as m
from rapidserve.engine.decode_request import StepBatch
from rapidserve.engine.dp_stats import CounterCarry, combine_stats
from rapidserve.engine.step_cycle import Landed
from rapidserve.engine.step_launch import InFlight, StepClock
from rapidserve.engine.step_tally import KINDS, StepTally, correction_ratios, step_kind
from rapidserve.partition.correction import Correction
from rapidserve.partition.shape import DecodeAlone, Fused, Split, StepShape, StepTiming

SPLIT = Split("d32", 2048)


@pytest.mark.parametrize(("shape", "chunk", "kind"), [
    (Fused(512), 300, "fused"),
    (Fused(512), 0, "fused_decode"),  # a fused step whose plan took no prompt token
    (Fused(0), 0, "fused_decode"),
    (SPLIT, 0, "split"),
    (DecodeAlone(), 0, "alone"),
    (DecodeAlone("d32"), 0, "alone"),  # decode holding its split while the prefill worker finishes
])
def test_step_kind(shape: StepShape, chunk: int, kind: str) -> None:
    assert KINDS[step_kind(shape, chunk)] == kind


def t(shape: StepShape, measured: float, predicted: float | None = None, chunk: int = 0) -> StepTiming:
    return StepTiming(shape, 8, chunk, predicted, measured)


TABLE = [
    t(Fused(512), 40.0, 38.0, chunk=512),
    t(Fused(512), 55.0, 44.0, chunk=256),  # over the 50 ms SLO
    t(Fused(512), 30.0, None, chunk=128),  # no prediction: counted, its time not in the ratio's sums
    t(Fused(512), 12.0, 10.0),  # no prompt token: fused_decode
    t(SPLIT, 20.0, 25.0),
    t(SPLIT, 50.0, 25.0),  # exactly at the SLO: not over it
    t(DecodeAlone(), 9.0, 8.0),
    t(DecodeAlone(), math.nan, 8.0),  # a time that is no number: the step counts, nothing else
    t(DecodeAlone(), 7.0, 0.0),  # a prediction of 0 is none
]


def test_tally_accumulates_a_table_of_timings() -> None:
    tally = StepTally(50.0)
    for x in TABLE:
        tally.add(x)
    assert tally.snapshot() == {
        "fused": m.StepKindStats(3, 125.0, 1, 82.0, 95.0),
        "fused_decode": m.StepKindStats(1, 12.0, 0, 10.0, 12.0),
        "split": m.StepKindStats(2, 70.0, 0, 50.0, 70.0),
        "alone": m.StepKindStats(3, 16.0, 0, 8.0, 9.0),
    }


def test_tally_without_slo_counts_nothing_over_it_and_leaves_out_kinds_never_seen() -> None:
    tally = StepTally(None)
    assert tally.snapshot() == {}
    tally.add(t(SPLIT, 1e6, 25.0))
    assert tally.snapshot() == {"split": m.StepKindStats(1, 1e6, 0, 25.0, 1e6)}


def test_correction_ratios_of_a_policy() -> None:
    class Corrects:
        correction = Correction(fused=1.25, split=0.8)

    class Other:
        correction = "not one"

    assert correction_ratios(Corrects()) == {"fused": 1.25, "split": 0.8, "decode": 1.0}
    assert correction_ratios(Other()) == {} and correction_ratios(object()) == {}


def stats(**kw: object) -> m.Stats:
    return m.Stats(1, 0, 0, 100, 50, 0, **kw)  # type: ignore[arg-type]


def test_older_stats_without_the_step_fields_still_decode() -> None:
    class OldStats(msgspec.Struct, tag="Stats", frozen=True):  # the message as it was before step_kinds
        num_running: int
        num_waiting: int
        num_prefilling: int
        kv_blocks_total: int
        kv_blocks_free: int
        num_preemptions: int

    got = msgspec.msgpack.decode(msgspec.msgpack.encode(OldStats(1, 0, 0, 100, 50, 0)), type=m.Stats)
    assert got == stats() and got.step_kinds == {} and got.step_correction == {}


def test_data_parallel_sums_step_counts_across_a_restart_and_averages_ratios() -> None:
    a = stats(step_kinds={"fused": m.StepKindStats(10, 400.0, 2, 380.0, 400.0)},
              step_correction={"fused": 1.2, "split": 1.0, "decode": 1.0})
    b = stats(step_kinds={"fused": m.StepKindStats(4, 100.0, 0, 90.0, 100.0), "split": m.StepKindStats(3, 60.0)},
              step_correction={"fused": 1.0, "split": 0.8, "decode": 1.0})
    carries = [CounterCarry().advance(a), CounterCarry().advance(b)]
    s = combine_stats([a, b], [True, True], carries)
    assert s is not None
    assert s.step_kinds == {"fused": m.StepKindStats(14, 500.0, 2, 470.0, 500.0), "split": m.StepKindStats(3, 60.0)}
    assert s.step_correction == pytest.approx({"fused": 1.1, "split": 0.9, "decode": 1.0})
    assert isinstance(s.step_kinds["fused"].steps, int) and isinstance(s.step_kinds["fused"].over_slo, int)
    # engine 0 restarts and counts from 0: what it had counted stays in the sums; its ratios leave with it
    a2 = stats(step_kinds={"fused": m.StepKindStats(1, 30.0, 0, 30.0, 30.0)}, step_correction={"fused": 1.0})
    carries[0] = carries[0].advance(a2)
    s = combine_stats([a2, b], [False, True], carries)
    assert s is not None
    assert s.step_kinds["fused"] == m.StepKindStats(15, 530.0, 2, 500.0, 530.0)
    assert s.step_correction == {"fused": 1.0, "split": 0.8, "decode": 1.0}


def test_data_parallel_sums_the_host_view_too() -> None:
    a = stats(step_kinds={"fused": m.StepKindStats(10, 400.0, 2, 380.0, 400.0, 9, 450.0, 3, 1.5, 30.0)})
    b = stats(step_kinds={"fused": m.StepKindStats(4, 100.0, 0, 90.0, 100.0, 4, 120.0, 1, 0.5, 10.0)})
    s = combine_stats([a, b], [True, True], [CounterCarry().advance(a), CounterCarry().advance(b)])
    assert s is not None
    assert s.step_kinds == {"fused": m.StepKindStats(14, 500.0, 2, 470.0, 500.0, 13, 570.0, 4, 2.0, 40.0)}
    assert isinstance(s.step_kinds["fused"].gaps, int) and isinstance(s.step_kinds["fused"].gaps_over_slo, int)


def h(shape: StepShape, measured: float, gap: float | None, idle: float | None, chunk: int = 0,
      host: float | None = None) -> StepTiming:
    return StepTiming(shape, 8, chunk, None, measured, gap, idle, host)


@pytest.mark.parametrize(("slo", "timings", "want"), [
    # a fused step within the SLO whose gap was over it (the host late to record it): counted as a gap over
    (50.0, [h(Fused(512), 45.0, 58.0, 0.2, chunk=512, host=9.5), h(Fused(512), 40.0, 41.0, 0.0, chunk=256, host=4.5)],
     {"fused": m.StepKindStats(2, 85.0, 0, 0.0, 0.0, 2, 99.0, 1, 0.2, 14.0)}),
    # no gap (no request decoded in the step before), no idle figure (a CPU): the step counts, nothing else
    (50.0, [h(DecodeAlone(), 6.0, None, None)], {"alone": m.StepKindStats(1, 6.0)}),
    # a gap exactly at the SLO is not over it; without an SLO none is
    (50.0, [h(SPLIT, 20.0, 50.0, 1.0)], {"split": m.StepKindStats(1, 20.0, 0, 0.0, 0.0, 1, 50.0, 0, 1.0)}),
    (None, [h(SPLIT, 20.0, 500.0, 0.0)], {"split": m.StepKindStats(1, 20.0, 0, 0.0, 0.0, 1, 500.0, 0, 0.0)}),
    # figures that are no time are left out
    (50.0, [h(SPLIT, 20.0, math.nan, -1.0, host=math.nan), h(SPLIT, 20.0, math.inf, math.inf, host=-2.0)],
     {"split": m.StepKindStats(2, 40.0)}),
])
def test_tally_counts_the_host_view(slo: float | None, timings: list[StepTiming],
                                    want: dict[str, m.StepKindStats]) -> None:
    tally = StepTally(slo)
    for x in timings:
        tally.add(x)
    assert tally.snapshot() == want


class FakeEvent:
    """A device event at a time on the device's clock (ms)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: FakeEvent) -> float:
        return later.ms - self.ms


def landed(decode: list[object], start: float | None, end: float | None) -> InFlight:
    clock = StepClock(FakeEvent(start) if start is not None else None, FakeEvent(end) if end is not None else None)
    return InFlight(StepBatch(decode), [], None, None, None, DecodeAlone(), clock)  # type: ignore[arg-type]


def test_landed_gap_and_idle_of_the_next_step() -> None:
    r1, r2, r3 = object(), object(), object()
    first = Landed.of(landed([r1, r2], 0.0, 40.0), at=10.0)
    # r2 decoded in both: a gap of 52 ms on the host; the device idle 3 ms between the steps' events
    assert first.next(landed([r2, r3], 43.0, 90.0), at=10.052) == (pytest.approx(52.0), 3.0)
    # no request in common (r3 joined since): no gap; a start before the end (events on one stream): idle 0
    assert first.next(landed([r3], 39.0, 80.0), at=10.1) == (None, 0.0)
    # on a CPU (no events): a gap, no idle figure
    cpu = Landed.of(landed([r1], None, None), at=5.0)
    assert cpu.next(landed([r1], None, None), at=5.02) == (pytest.approx(20.0), None)
