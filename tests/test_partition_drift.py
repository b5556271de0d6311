"""DRIFT's dispatcher (partition/drift.py) in tables of cases on CPU: the linear latency model, the
partition, block sizes, preemption by a short request (a stack of one) and resumption first."""

from __future__ import annotations

import pytest

from rapidserve.partition.drift import (
    DriftDecision,
    LinearModel,
    RunningPrefill,
    choose_partition,
    decide_drift,
    fit_linear,
    layers_per_block,
)
from rapidserve.partition.policy import PolicyState, WaitingPrefill

# Per configuration: prefill ms = a + b * tokens, decode step beside prefill (ms), prefill units.
MODELS = {"split16": LinearModel(5.0, 0.025), "split32": LinearModel(5.0, 0.03), "split64": LinearModel(5.0, 0.05)}
BESIDE = {"split16": 48.0, "split32": 27.0, "split64": 15.0}
UNITS = {"split16": 116, "split32": 100, "split64": 68}
L = 36


def state(now: float, waiting: list[tuple[str, float, int]], slo_tbt: float = 50.0,
          slo_ttft: float | None = 2000.0) -> PolicyState:
    return PolicyState(now, (2048,) * 32, tuple(WaitingPrefill(r, a, n) for r, a, n in waiting), slo_tbt, slo_ttft)


def decide(s: PolicyState, running: RunningPrefill | None = None,
           preempted: RunningPrefill | None = None) -> DriftDecision:
    return decide_drift(s, models=MODELS, decode_ms_beside=BESIDE, prefill_units=UNITS, num_layers=L,
                        running=running, preempted=preempted)


def long_batch(done: int, arrival: float = 0.0, config: str = "split32") -> RunningPrefill:
    return RunningPrefill(("long",), (arrival,), 60000, config, done, L)  # 1805 ms on split32


def test_fit_linear() -> None:
    m = fit_linear([(1000, 30.0), (2000, 55.0), (4000, 105.0)])
    assert m.a_ms == pytest.approx(5.0) and m.b_ms_per_token == pytest.approx(0.025)
    assert fit_linear([(100, 10.0), (200, 5.0)]).b_ms_per_token == 0.0  # never a negative slope
    with pytest.raises(ValueError, match="two or more"):
        fit_linear([(100, 1.0), (100, 2.0)])


@pytest.mark.parametrize(("batch_ms", "step_ms", "want"), [(360.0, 30.0, 3), (36.0, 30.0, 30), (10.0, 30.0, 36),
                                                            (5000.0, 10.0, 1), (0.0, 10.0, 36)])
def test_layers_per_block(batch_ms: float, step_ms: float, want: int) -> None:
    assert layers_per_block(L, batch_ms, step_ms) == want


@pytest.mark.parametrize(("limit", "want"), [(45.0, ("split32", True)), (50.0, ("split16", True)),
                                             (20.0, ("split64", True)), (10.0, ("split64", False))])
def test_choose_partition(limit: float, want: tuple[str, bool]) -> None:
    assert choose_partition(BESIDE, UNITS, limit) == want


def test_idle_and_start() -> None:
    assert decide(state(0.0, [])).action == "idle"
    d = decide(state(1.0, [("a", 0.5, 3000), ("b", 0.9, 6000)]))
    assert d.action == "start" and d.config == "split32"  # 27 ms <= 45 with the most prefill units
    assert d.batch == (("a", 3000, 0), ("b", 5192, 0))  # arrival order within the 8192-token budget
    assert d.predicted_ms == pytest.approx(5.0 + 0.03 * 8192)
    assert d.layers_per_block == layers_per_block(L, d.predicted_ms, 27.0)
    tight = decide(state(1.0, [("a", 0.5, 3000)], slo_tbt=10.0))
    assert tight.config == "split64" and "no partition meets" in tight.reason


def test_short_request_preempts_a_long_batch() -> None:
    # 10 s in, the long batch (arrived at 9.0 s, TTFT SLO 2 s) has 1/3 left (~600 ms); the short one
    # arrived 1.7 s ago: behind the batch it would miss 2 s, run now (~35 ms) it meets it
    s = state(10.0, [("short", 8.3, 1000)])
    d = decide(s, running=long_batch(24, arrival=9.0))
    assert d.action == "preempt" and d.batch == (("short", 1000, 0),) and d.config == "split32"
    assert d.predicted_ms == pytest.approx(35.0)
    # the same, but the long batch would then miss its own TTFT: no preemption
    assert decide(s, running=long_batch(24, arrival=8.1)).action == "continue"
    # a stack of one: with a batch already preempted, no second preemption
    assert decide(s, running=long_batch(24, arrival=9.0), preempted=long_batch(3)).action == "continue"
    # a request that meets its TTFT even behind the batch waits
    assert decide(state(10.0, [("short", 9.9, 1000)]), running=long_batch(24, arrival=9.0)).action == "continue"
    # one that misses it even alone gains nothing from preempting
    assert decide(state(10.0, [("short", 7.0, 1000)]), running=long_batch(24, arrival=9.0)).action == "continue"
    # no TTFT SLO: never preempts
    no_slo = state(10.0, [("short", 8.3, 1000)], slo_ttft=None)
    assert decide(no_slo, running=long_batch(24, arrival=9.0)).action == "continue"


def test_preempted_batch_resumes_first() -> None:
    d = decide(state(10.0, [("next", 9.0, 500)]), preempted=long_batch(24))
    assert d.action == "resume" and d.config == "split32"
    assert d.predicted_ms == pytest.approx((5 + 0.03 * 60000) / 3)


def test_continue_reports_what_is_left() -> None:
    d = decide(state(10.0, []), running=long_batch(12))
    assert d.action == "continue" and d.predicted_ms == pytest.approx((5 + 0.03 * 60000) * 2 / 3)
    assert d == decide(state(10.0, []), running=long_batch(12))  # pure


def test_configurations_must_agree() -> None:
    with pytest.raises(ValueError, match="same configurations"):
        decide_drift(state(0.0, []), models=MODELS, decode_ms_beside={"split16": 1.0}, prefill_units=UNITS,
                     num_layers=L)


@pytest.mark.parametrize(("per_1k", "lengths", "want"), [
    (100.0, (60000,), "preempt"),  # the long batch's SLO (6.5 s) has room for the short one (SLO 0.6 s)
    (0.0, (60000,), "continue"),  # one SLO for all: the long batch would miss its own 0.5 s after the delay
    (100.0, (), "continue"),  # lengths not given: the base SLO for the running batch
])
def test_length_scaled_ttft_slo(per_1k: float, lengths: tuple[int, ...], want: str) -> None:
    """Both fresh (FCFS queues): the long batch arrived 50 ms before the short request. With TTFT SLOs
    that grow with the length, the short one preempts: ~1.2 s of the batch left would miss its 0.6 s."""
    s = PolicyState(10.0, (2048,) * 32, (WaitingPrefill("short", 9.95, 1000),), 50.0, 500.0,
                    slo_ttft_ms_per_1k_tokens=per_1k)
    running = RunningPrefill(("long",), (9.9,), 60000, "split32", 12, L, lengths)
    d = decide(s, running=running)
    assert d.action == want
    assert s.ttft_slo_ms(1000) == 500.0 + per_1k
    if want == "preempt":
        assert d.batch == (("short", 1000, 0),)
