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

Fused steps also keep a ratio per size class (`SIZE_EDGES`: the step's tokens, decode rows plus prompt tokens),
because the fused model's error depends on the step's size: its composition (step_costs.py) prices prompt tokens at
the whole GPU's rate for 4096-token forwards and has no per-step fixed part, so it under-predicts small steps and not
large ones. Measured on the H200 (2026-11-30, bench/results/h200x2_1130f/, the step traces): measured / predicted
1.41 at 384 tokens, 1.15-1.21 at 640-768, 0.97-1.01 at 1152-1536 on multi-turn, where the one fused ratio (an average
over the mix, 1.03-1.46) priced the large steps that meet the SLO up to 24% too slow, and their chunks came out
smaller than the SLO allowed. `Correction.fused_ratio(tokens)` is the ratio of the step's class once that class has
`MIN_CLASS_SAMPLES` steps, else that of the nearest class that has (a larger step is first priced at what the largest
learnt class says, and learns its own as it runs), else the one fused ratio.

Decode on a split keeps a ratio per configuration too (`Correction.split_ratio(config)`, its own once it has
`MIN_CLASS_SAMPLES` steps, else the one split ratio), and its ratio may fall to `lo_split` (0.25), below the others'
0.5: the profile's step beside prefill was measured beside a saturating 4096-token prefill stream, and on the H200's
multi-turn trace (2026-11-30) decode on split16 / 32 / 48 / 64 beside the short turns the prefill worker was handed ran
at 0.49 / 0.35 / 0.37 / 0.43 of that prediction (and decode alone on split16 at 0.65): the one split ratio sat at its
clamp, 0.5, pricing every split's decode step up to 1.4x slow, so the policy gave decode more of the GPU than it
needed, or fused where a split would have had more prefill throughput.

`--step-correction per-kind` (`CorrectionParams.by_shape` False) keeps one ratio per kind, each clamped to [0.5, 4],
as before 2026-11-30: no class is learnt, so `fused_ratio` and `split_ratio` read the kind's.

The update (pure, `corrected`): the sample r = measured / predicted is first clamped to within a factor
`step_clamp` of the current ratio (one outlier, a step that waited for a page fault or a compile, moves the
ratio at most alpha * (step_clamp - 1): 5% with the defaults), then r' = (1 - alpha) * ratio + alpha * r, and
the result is clamped to [lo, hi] (the split kind's lo: lo_split; a broken timer cannot make the policy believe
the GPU is 100x slower). A
steady 1.3 is reached to within 2% in about 25 steps. Steps without a prediction (None) or with a
non-positive time change nothing.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

from rapidserve.partition.shape import OVERALLOCATED, DecodeAlone, Fused, Split, StepShape, StepTiming

Kind = Literal["fused", "split", "decode"]
K = TypeVar("K", int, str)
# the fused steps' size classes: class k holds steps of SIZE_EDGES[k - 1] < tokens <= SIZE_EDGES[k] (the last, above)
SIZE_EDGES: tuple[int, ...] = (256, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096, 6144, 8192)
MIN_CLASS_SAMPLES = 8  # a class's own ratio is read once it has folded in this many steps


def size_class(tokens: int) -> int:
    """The size class of a fused step of `tokens` tokens (decode rows plus prompt tokens)."""
    return bisect_left(SIZE_EDGES, tokens)


@dataclass(frozen=True)
class Correction:
    """Measured / predicted step time per kind (1.0: the model is right), and per size class of the fused steps:
    (class, ratio, steps folded in), ascending by class."""

    fused: float = 1.0
    split: float = 1.0
    decode: float = 1.0
    samples: int = 0  # timings folded in so far (for logs)
    fused_classes: tuple[tuple[int, float, int], ...] = ()
    split_configs: tuple[tuple[str, float, int], ...] = ()  # (configuration, ratio, steps folded in), by name

    def ratio(self, kind: Kind) -> float:
        return float(getattr(self, kind))

    def split_ratio(self, config: str) -> float:
        """The ratio decode on split `config` is priced at: the configuration's own once it has MIN_CLASS_SAMPLES
        steps, else the one split ratio."""
        return next((r for c, r, n in self.split_configs if c == config and n >= MIN_CLASS_SAMPLES), self.split)

    def fused_ratio(self, tokens: int) -> float:
        """The ratio a fused step of `tokens` tokens is priced at: its class's, else the nearest learnt class's (the
        smaller on a tie), else the one fused ratio (module docstring)."""
        learnt = [(k, r) for k, r, n in self.fused_classes if n >= MIN_CLASS_SAMPLES]
        if not learnt:
            return self.fused
        c = size_class(tokens)
        return min(learnt, key=lambda kr: (abs(kr[0] - c), kr[0]))[1]


@dataclass(frozen=True)
class CorrectionParams:
    alpha: float = 0.1  # weight of one sample
    step_clamp: float = 1.5  # one sample counts as at most this factor above (or below) the current ratio
    lo: float = 0.5
    hi: float = 4.0
    lo_split: float = 0.25  # the split kind's lower clamp (module docstring: its model is the most pessimistic)
    by_shape: bool = True  # fused by size class, split by configuration; False: one ratio per kind (--step-correction)

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1 and self.step_clamp >= 1 and 0 < self.lo <= 1 <= self.hi
                and 0 < self.lo_split <= 1):
            raise ValueError(f"CorrectionParams({self}): need 0 < alpha <= 1, step_clamp >= 1, 0 < lo <= 1 <= hi, "
                             "0 < lo_split <= 1")


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
    lo = params.lo_split if kind == "split" and params.by_shape else params.lo
    r = timing.measured_ms / p
    out = replace(c, samples=c.samples + 1, **{kind: _folded(cur, r, params, lo)})
    if not params.by_shape:  # one ratio per kind: no class is learnt, so fused_ratio and split_ratio read the kind's
        return out
    if kind == "fused":
        k = size_class(timing.decode_batch + timing.chunk_tokens)
        return replace(out, fused_classes=_keyed(c.fused_classes, k, cur, r, params, lo))
    if kind == "split":
        assert isinstance(timing.shape, (Split, DecodeAlone))
        return replace(out, split_configs=_keyed(c.split_configs, timing.shape.config, cur, r, params, lo))
    return out


def _keyed(entries: tuple[tuple[K, float, int], ...], key: K, start: float, r: float, params: CorrectionParams,
           lo: float) -> tuple[tuple[K, float, int], ...]:
    """`entries` (key, ratio, steps) with sample `r` folded into `key`'s (a new key starts from `start`, the kind's
    one ratio before this sample), sorted by key."""
    mine = next(((x, n) for k, x, n in entries if k == key), None)
    ratio, n = mine if mine is not None else (start, 0)
    return tuple(sorted([*(e for e in entries if e[0] != key), (key, _folded(ratio, r, params, lo), n + 1)]))


def _folded(cur: float, r: float, params: CorrectionParams, lo: float) -> float:
    """`cur` with one sample `r` folded in: clamped to within step_clamp of it, averaged with weight alpha, then
    clamped to [lo, hi]."""
    sample = min(max(r, cur / params.step_clamp), cur * params.step_clamp)
    return min(max((1 - params.alpha) * cur + params.alpha * sample, lo), params.hi)
