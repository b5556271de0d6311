"""When the decode worker streams a first token (engine/first_token.py): the rule and the step clock."""

from __future__ import annotations

import pytest

from rapidserve.engine.first_token import StepClock, stream_at_launch, stream_now


@pytest.mark.parametrize(("step_ms", "in_flight", "slo", "want"), [
    (None, True, 50.0, False),  # no step measured yet: wait for the step in flight
    (None, False, 50.0, False),
    (10.0, True, 50.0, True),  # gap <= 2 x 10 = 20 ms <= 45
    (22.5, True, 50.0, True),  # 45 <= 45: at the bound
    (22.6, True, 50.0, False),  # 45.2 > 45
    (40.0, False, 50.0, True),  # nothing in flight: one step
    (46.0, False, 50.0, False),
    (30.0, True, 100.0, True),
    (0.0, True, 50.0, True),
])
def test_stream_at_launch(step_ms: float | None, in_flight: bool, slo: float, want: bool) -> None:
    assert stream_at_launch(step_ms, in_flight, slo) is want


@pytest.mark.parametrize(("slo", "margin"), [(0.0, 0.9), (-1.0, 0.9), (50.0, 0.0), (50.0, 1.5)])
def test_stream_at_launch_refuses_bad_settings(slo: float, margin: float) -> None:
    with pytest.raises(ValueError, match="slo_itl_ms"):
        stream_at_launch(10.0, True, slo, margin)


def test_step_clock() -> None:
    c = StepClock(window=3)
    assert c.step_ms() is None
    c.landed(1.000)
    assert c.step_ms() is None  # one landing: no interval yet
    for t in (1.010, 1.030, 1.040):
        c.landed(t)
    assert c.step_ms() == pytest.approx(20.0)  # the longest of the last three intervals (10, 20, 10)
    c.landed(1.050)
    c.landed(1.060)
    assert c.step_ms() == pytest.approx(10.0)  # the 20 ms interval left the window
    c.restart()
    c.landed(5.0)  # after an idle spell: the 3.94 s gap is not a step
    assert c.step_ms() == pytest.approx(10.0)
    c.landed(5.004)
    assert c.step_ms() == pytest.approx(10.0)
    c.reset()  # a partition switch: nothing measured before counts
    assert c.step_ms() is None
    c.landed(6.0)
    assert c.step_ms() is None
    c.landed(6.03)
    assert c.step_ms() == pytest.approx(30.0)
    with pytest.raises(ValueError, match="window"):
        StepClock(window=0)


@pytest.mark.parametrize(("step_ms", "steps", "want"), [
    (15.0, 3, True), (15.1, 3, False), (45.0, 1, True), (None, 1, False), (11.25, 4, True)])
def test_stream_now(step_ms: float | None, steps: int, want: bool) -> None:
    assert stream_now(step_ms, steps, 50.0) is want
    with pytest.raises(ValueError, match="steps"):
        stream_now(step_ms, 0, 50.0)
