"""When the decode worker streams a request's first token (rapid mode), and the step time it judges by.

Prefill samples a request's first token and hands it to decode in PrefillDone; decode streams it when
the request joins its decode batch. Decode launches each step one ahead (async scheduling), so when
the request's first decode step is launched, another step is usually still in flight, and the second
token reaches the client only after both have run. Two moments to stream the first token:

* at the launch of the request's first decode step: the time to first token is shortest, and the gap
  to the second token is what is left of the step in flight plus one step, at most two steps;
* once the step in flight has landed (just after that launch): the time to first token is longer by
  what was left of that step, and the gap to the second token is about one step.

`stream_at_launch` picks the first whenever the gap it makes stays within the inter-token SLO:
`steps * step_ms <= margin * slo_itl_ms`, `steps` being 2 with a step in flight and 1 without. With no
step time measured yet it waits (the second). A PrefillDone that decode reads while it waits for a step
to land (it serves its inbox meanwhile) joins the step after the one queued behind it: its first token
may stream at once if three steps fit (`stream_now(step_ms, 3, ...)`). `StepClock` measures the decode
step from the times steps land while the pipeline runs back to back.
"""

from __future__ import annotations

from collections import deque


def stream_now(step_ms: float | None, steps: int, slo_itl_ms: float, margin: float = 0.9) -> bool:
    """Stream a first token now, when the step computing the second lands `steps` decode steps from now
    at the latest: True iff those steps fit in `margin` x the SLO (never with no step time measured). Pure."""
    if slo_itl_ms <= 0 or not 0 < margin <= 1:
        raise ValueError(f"slo_itl_ms={slo_itl_ms} must be > 0 and margin={margin} in (0, 1]")
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    return step_ms is not None and steps * step_ms <= margin * slo_itl_ms


def stream_at_launch(step_ms: float | None, in_flight: bool, slo_itl_ms: float, margin: float = 0.9) -> bool:
    """Stream first tokens at the launch of their first decode step (True), or once the step in flight
    has landed (False). Pure."""
    return stream_now(step_ms, 2 if in_flight else 1, slo_itl_ms, margin)


class StepClock:
    """The recent decode step time: the longest of the last `window` intervals between steps landing,
    counted only while steps run back to back (`restart` when a step is launched with none in flight,
    so the time the worker sat idle is never taken for a step), and only in the current compute
    partition (`reset` on a switch: a step on 16 SMs is not the whole GPU's, and a first token streamed
    early on the old figure would leave a gap beyond the SLO)."""

    def __init__(self, window: int = 4) -> None:
        if window < 1:
            raise ValueError(f"window={window} must be >= 1")
        self._intervals: deque[float] = deque(maxlen=window)
        self._last: float | None = None

    def restart(self) -> None:
        """The pipeline starts again after an idle spell: the next interval is not a step."""
        self._last = None

    def reset(self) -> None:
        """The step itself changed (a partition switch): forget every interval measured before."""
        self._last = None
        self._intervals.clear()

    def landed(self, now: float) -> None:
        if self._last is not None:
            self._intervals.append(max(0.0, now - self._last))
        self._last = now

    def step_ms(self) -> float | None:
        return max(self._intervals) * 1e3 if self._intervals else None
