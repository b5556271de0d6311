"""What the decode worker's steps were, counted for `Stats.step_kinds` (and so /metrics: server/metrics.py).

Every landed step of the one step loop becomes a `StepTiming` (engine/step_cycle.py: its shape, the prompt tokens
it carried, the policy's raw prediction `predicted_ms` and the measured time, the same record the online correction
reads); `StepTally.add` counts it under its kind (`step_kind`):

* "fused": a `Fused` step that carried prompt tokens (a mixed step in the decode worker);
* "fused_decode": a `Fused` step with no prompt tokens (decode alone on the whole GPU, as a fused policy runs it);
* "split": a `Split` step (decode on its share beside the prefill worker);
* "alone": a `DecodeAlone` step, on whatever configuration (the whole GPU when nothing is pending, or the split
  decode holds while the prefill worker finishes its prompts).

These are the shapes as the policy chose them; the correction's kinds differ (partition/correction.py: "alone" on
a split is corrected as "split", "fused_decode" as "decode"), and its ratios are reported beside the counts as
they are now (`correction_ratios`).

Per kind, cumulative since the worker started (a scraper takes deltas): `steps`; `measured_ms`, their measured
time; `over_slo`, those whose measured time exceeded the ITL SLO (none counted without an SLO); over the steps
that had a prediction, `predicted_ms` (the predictions) and `predicted_measured_ms` (those steps' measured time),
so predicted_measured_ms / predicted_ms is how far off the cost model was, by kind, over any window. A step whose
measured time is not a finite number >= 0 is counted in `steps` only. What the host saw (engine/step_cycle.py's
`Landed`): `gaps`, `gap_ms` and `gaps_over_slo`, the token gaps that ended at a step of the kind (a request decoded
in it and in the step before: the gap its stream got, host time included), their sum and those over the SLO; and
`idle_ms`, the device's idle time before the kind's steps; `host_ms`, the host's wall time to plan and launch them
(beside the device's work when one step runs ahead; the device's idle time when none does). A step's measured time
within the SLO with its gap over it is time outside the step: the host late to record it, or the device idle before
it (host_ms says whether planning and launching it was what the device waited for).

Cost: `add` runs once per landed step, on the host, after the step was recorded: a few additions into lists made
once (no allocation but Python's floats, no device work: the measured time is the one the correction reads);
the messages are built only when the worker sends its Stats (every `stats_interval_s`).
"""

from __future__ import annotations

import math
from typing import get_args

from rapidserve.engine.messages import STEP_KINDS, StepKindStats
from rapidserve.partition.correction import Correction, Kind
from rapidserve.partition.margin import Margin
from rapidserve.partition.shape import Fused, Split, StepShape, StepTiming

KINDS = STEP_KINDS  # declared with the message that carries them
FUSED, FUSED_DECODE, SPLIT, ALONE = range(len(KINDS))


def step_kind(shape: StepShape, chunk_tokens: int) -> int:
    """The index in KINDS of a landed step of `shape` that carried `chunk_tokens` prompt tokens."""
    if isinstance(shape, Fused):
        return FUSED if chunk_tokens > 0 else FUSED_DECODE
    if isinstance(shape, Split):
        return SPLIT
    return ALONE


class StepTally:
    """The cumulative counts of every kind (module docstring), `slo_itl_ms` the SLO a step is compared with
    (None: no SLO, nothing is over it)."""

    __slots__ = ("slo_ms", "steps", "measured_ms", "over_slo", "predicted_ms", "predicted_measured_ms", "gaps",
                 "gap_ms", "gaps_over_slo", "idle_ms", "host_ms")

    def __init__(self, slo_itl_ms: float | None) -> None:
        self.slo_ms = math.inf if slo_itl_ms is None else float(slo_itl_ms)
        n = len(KINDS)
        self.steps, self.over_slo, self.gaps, self.gaps_over_slo = [0] * n, [0] * n, [0] * n, [0] * n
        self.measured_ms, self.predicted_ms, self.predicted_measured_ms = [0.0] * n, [0.0] * n, [0.0] * n
        self.gap_ms, self.idle_ms, self.host_ms = [0.0] * n, [0.0] * n, [0.0] * n

    def add(self, t: StepTiming) -> None:
        """Count one landed step."""
        k = step_kind(t.shape, t.chunk_tokens)
        self.steps[k] += 1
        gap = t.gap_ms
        if gap is not None and 0.0 <= gap < math.inf:
            self.gaps[k] += 1
            self.gap_ms[k] += gap
            if gap > self.slo_ms:
                self.gaps_over_slo[k] += 1
        idle = t.idle_ms
        if idle is not None and 0.0 <= idle < math.inf:
            self.idle_ms[k] += idle
        host = t.host_ms
        if host is not None and 0.0 <= host < math.inf:
            self.host_ms[k] += host
        ms = t.measured_ms
        if not 0.0 <= ms < math.inf:  # NaN fails too
            return
        self.measured_ms[k] += ms
        if ms > self.slo_ms:
            self.over_slo[k] += 1
        p = t.predicted_ms
        if p is not None and 0.0 < p < math.inf:
            self.predicted_ms[k] += p
            self.predicted_measured_ms[k] += ms

    def snapshot(self) -> dict[str, StepKindStats]:
        """The counts so far, for `Stats.step_kinds`: the kinds with at least one step."""
        return {name: StepKindStats(self.steps[k], self.measured_ms[k], self.over_slo[k], self.predicted_ms[k],
                                    self.predicted_measured_ms[k], self.gaps[k], self.gap_ms[k],
                                    self.gaps_over_slo[k], self.idle_ms[k], self.host_ms[k])
                for k, name in enumerate(KINDS) if self.steps[k]}


def correction_ratios(policy: object) -> dict[str, float]:
    """The policy's online correction now (`Stats.step_correction`: measured / predicted per correction kind), or
    nothing for a policy that corrects nothing (one without a `Correction` as its `correction`); with it, under
    "slo_margin", the share of the ITL SLO its steps are planned within now where it adapts it (duet with an SLO and
    `--slo-margin auto`: partition/margin.py)."""
    c = getattr(policy, "correction", None)
    if not isinstance(c, Correction):
        return {}
    out = {k: c.ratio(k) for k in get_args(Kind)}
    m = getattr(policy, "margin", None)
    if isinstance(m, Margin) and getattr(policy, "margin_params", None) is not None:  # adapted, not fixed
        out["slo_margin"] = m.margin
    return out
