"""The share of the ITL SLO duet plans its steps within, adapted to the token gaps its steps really made.

Duet (partition/policies.py) takes a step only where its corrected prediction is within `margin x SLO`. The margin
covers what the prediction leaves out: the host's time around a step, a step's jitter, a correction still catching
up. A fixed 0.9 leaves a tenth of the SLO unspent however well the predictions hold, and what the SLO is judged by is
each request's p95 inter-token gap: what must stay rare is a gap over the SLO, not a step near it. A step of 1440
tokens holds its decode rows' KV reads (~13 ms for 300 sequences of 1.2k tokens on an H200) whatever its prompt chunk,
so the SLO's last share goes whole to prompt tokens (0.97 rather than 0.9 of a 50-ms SLO: ~14% more of them a step
on 1024:256's near-limit steps).

`adapted` (pure) folds each landed step into a decayed count of the gaps that ended at *binding* steps (those the margin
sized, `sized_by_margin`: fused steps that carried prompt tokens, decode on a split's share; and that took at least
`binding` x the limit) and of those gaps over the SLO, then moves the margin on the event, once `min_gaps` (decayed)
have been counted: a gap over the SLO while the share over exceeds `target_over` lowers it by `down`, a gap within while
the share is under half of it raises it by `up` (additive both ways, within [lo, hi]); in between it holds. Moving on
events rather than on the share alone keeps a cluster of slow steps from walking the margin to `lo` while the decayed
share comes back down (`bench/margin_sim.py`: with step jitter of 1 / 2 / 4 / 6% it settles near 0.97 / 0.95 / 0.91 /
0.84 with ~1% of gaps over). Steps far below the limit (a light load) change nothing, so a margin learnt under load is
not inflated by idle periods. A gap over the SLO that would have been within it but for the device's idle time
before its step (the host late to plan and launch it: a step planned with nothing in flight, after a preemption's
quiet pool or a long host turn) is not counted either way: a smaller step would not have closed that bubble, and
on 2 x H200 (2026-11-30, bench/results/h200x2_1130e/) gaps over in a probe above the peak (12 over 50 ms in 133
fused steps, no step's device time over it, 80 ms of device idle in the probe: ~7-ms bubbles, by the totals; the
step trace, engine/step_trace.py, tells each apart) walked the margin to its floor, where it stayed for ~800 fused
steps. `target_over` is 1%: a request's p95 allows 5% of its gaps over the bound, and gaps over
cluster in the requests running while prompts arrive, so the engine-wide share is held well below that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from rapidserve.partition.shape import OVERALLOCATED, DecodeAlone, Fused, Split, StepTiming


@dataclass(frozen=True)
class MarginParams:
    start: float = 0.9  # the margin before anything was measured (the fixed margin duet had)
    lo: float = 0.8
    hi: float = 0.97
    target_over: float = 0.01  # the share of binding steps' gaps over the SLO to hold
    decay: float = 0.995  # per counted gap (half-life ~140 gaps)
    min_gaps: float = 50.0  # (decayed) gaps counted before the margin moves
    up: float = 0.001  # a gap within the SLO while few are over
    down: float = 0.02  # a gap over the SLO while too many are
    binding: float = 0.8  # a step counts when it took at least this share of the limit it was planned within

    def __post_init__(self) -> None:
        if not (0 < self.lo <= self.start <= self.hi <= 1 and 0 < self.target_over < 1 and 0 < self.decay < 1
                and self.min_gaps >= 1 and self.up > 0 and self.down > 0 and 0 < self.binding <= 1):
            raise ValueError(f"MarginParams({self}): need 0 < lo <= start <= hi <= 1, 0 < target_over < 1, "
                             "0 < decay < 1, min_gaps >= 1, up > 0, down > 0, 0 < binding <= 1")


DEFAULT_MARGIN = MarginParams()


@dataclass(frozen=True)
class Margin:
    """The margin now and the decayed counts it was moved by."""

    margin: float = DEFAULT_MARGIN.start
    gaps: float = 0.0
    over: float = 0.0


def sized_by_margin(timing: StepTiming) -> bool:
    """Whether the margin sized this step: a fused step that carried prompt tokens (its chunk), or decode on a split's
    share (a `Split`, or `DecodeAlone` on a split while the prefill worker holds prompts: duet picks the split whose
    decode step is within the limit). Decode alone on the whole GPU, with nothing pending, was not sized by it."""
    shape = timing.shape
    if isinstance(shape, Fused):
        return timing.chunk_tokens > 0
    if isinstance(shape, Split):
        return True
    return isinstance(shape, DecodeAlone) and shape.config != OVERALLOCATED


def adapted(m: Margin, timing: StepTiming, slo_itl_ms: float | None,
            params: MarginParams = DEFAULT_MARGIN) -> Margin:
    """`m` with one landed step folded in (module docstring). Pure. No SLO, no gap (no request decoded in both this
    step and the one before), a step the margin did not size (decode alone on the whole GPU, a fused step without
    prompt tokens) or one well under the limit: `m` unchanged."""
    gap = timing.gap_ms
    if slo_itl_ms is None or gap is None or not math.isfinite(gap) or gap < 0:
        return m
    if not sized_by_margin(timing):
        return m
    if not timing.measured_ms >= params.binding * m.margin * slo_itl_ms:
        return m
    is_over = gap > slo_itl_ms
    idle = timing.idle_ms
    if is_over and idle is not None and math.isfinite(idle) and gap - idle <= slo_itl_ms:
        return m  # a host-bound bubble: within the SLO but for the device's wait for the host (module docstring)
    gaps = m.gaps * params.decay + 1.0
    over = m.over * params.decay + (1.0 if is_over else 0.0)
    margin = m.margin
    if gaps >= params.min_gaps:
        share = over / gaps
        if is_over and share > params.target_over:
            margin -= params.down
        elif not is_over and share < params.target_over / 2:
            margin += params.up
    return replace(m, margin=min(max(margin, params.lo), params.hi), gaps=gaps, over=over)
