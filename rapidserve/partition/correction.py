"""Online correction of the step cost models: a running ratio of measured to predicted step time per kind.

A cost model (partition/step_costs.py) is off by a steady factor on a GPU it was not fitted to (the
roofline's peaks and efficiencies, a profile measured on a cooler or another board, a kernel that changed
since). The decode worker reports each landed step (`shape.StepTiming`: the model's prediction and the
measured time); `corrected` folds it into the ratio of its kind, and the policy multiplies its predictions
of that kind by the ratio before comparing them with the SLO. So a GPU 30% slower than predicted raises the
fused kind's ratio towards 1.3 and the SLO-aware chunk budget shrinks accordingly.

Kinds (`kind_of`), one ratio each, as their errors differ:
* "fused": a fused step that carried prompt tokens (`Fused` with chunk tokens > 0);
* "split": decode on a split's share while the prefill worker runs (`Split`, and `DecodeAlone` on a split
  configuration, which is how decode runs while the prefill worker still holds prompts);
* "decode": decode alone on the whole GPU (`DecodeAlone` overallocated, or a fused step with no prompt tokens).

The update (pure, `corrected`): the sample r = measured / predicted is first clamped to within a factor
`step_clamp` of the current ratio (one outlier, a step that waited for a page fault or a compile, moves the
ratio at most alpha * (step_clamp - 1): 5% with the defaults), then r' = (1 - alpha) * ratio + alpha * r, and
the result is clamped to [lo, hi] (a broken timer cannot make the policy believe the GPU is 100x slower). A
steady 1.3 is reached to within 2% in about 25 steps. Steps without a prediction (None) or with a
non-positive time change nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from rapidserve.partition.shape import OVERALLOCATED, DecodeAlone, Fused, Split, StepShape, StepTiming

Kind = Literal["fused", "split", "decode"]


@dataclass(frozen=True)
class Correction:
    """Measured / predicted step time per kind (1.0: the model is right)."""

    fused: float = 1.0
    split: float = 1.0
    decode: float = 1.0
    samples: int = 0  # timings folded in so far (for logs)

    def ratio(self, kind: Kind) -> float:
        return float(getattr(self, kind))


@dataclass(frozen=True)
class CorrectionParams:
    alpha: float = 0.1  # weight of one sample
    step_clamp: float = 1.5  # one sample counts as at most this factor above (or below) the current ratio
    lo: float = 0.5
    hi: float = 4.0

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1 and self.step_clamp >= 1 and 0 < self.lo <= 1 <= self.hi):
            raise ValueError(f"CorrectionParams({self}): need 0 < alpha <= 1, step_clamp >= 1, 0 < lo <= 1 <= hi")


DEFAULT_CORRECTION = CorrectionParams()


def kind_of(shape: StepShape, chunk_tokens: int) -> Kind:
    """Which ratio a landed step of `shape` that carried `chunk_tokens` prompt tokens updates (module docstring)."""
    if isinstance(shape, Fused):
        return "fused" if chunk_tokens > 0 else "decode"
    if isinstance(shape, Split):
        return "split"
    assert isinstance(shape, DecodeAlone)
    return "decode" if shape.config == OVERALLOCATED else "split"


def corrected(c: Correction, timing: StepTiming, params: CorrectionParams = DEFAULT_CORRECTION) -> Correction:
    """`c` with `timing` folded in (module docstring). Pure."""
    p = timing.predicted_ms
    if p is None or not p > 0 or not timing.measured_ms > 0 or not math.isfinite(timing.measured_ms):
        return c
    kind = kind_of(timing.shape, timing.chunk_tokens)
    cur = c.ratio(kind)
    sample = min(max(timing.measured_ms / p, cur / params.step_clamp), cur * params.step_clamp)
    new = min(max((1 - params.alpha) * cur + params.alpha * sample, params.lo), params.hi)
    return replace(c, samples=c.samples + 1, **{kind: new})
