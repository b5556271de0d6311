"""The fused correction replayed over traced steps: the one fused ratio against the ratio by step size.

    python bench/correction_replay.py compare_logs/*.steps.jsonl [--min-tokens 1152]

For each `--step-trace` file (engine/step_trace.py), the steps are fed in order to partition/correction.py's
`corrected` as the policy fed them, and before each large fused step (decode rows plus prompt tokens >= --min-tokens:
the steps a 50-ms SLO sizes) the ratio each scheme would have priced it at is set against the step's own measured /
predicted: applied / true above 1 priced the step slower than it ran (its chunk smaller than the SLO allowed), below 1
faster (it ran over its plan); and before each decode step on a split, the one split ratio against the
configuration's own. On the H200 traces of 2026-11-30 (bench/results/h200x2_1130f/) this is why the fused
correction is kept by size (partition/correction.py's docstring). Prints the table last.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterable, Sequence

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.engine.step_trace import StepRecord, read_trace  # noqa: E402
from rapidserve.partition.correction import Correction, CorrectionParams, corrected  # noqa: E402
from rapidserve.partition.shape import OVERALLOCATED, DecodeAlone, Fused, StepShape, StepTiming  # noqa: E402

SCHEMES = ("fused: one ratio (before)", "fused: by size (now)", "split: one ratio, clamp 0.5 (before)",
           "split: by configuration, clamp 0.25 (now)")
BEFORE = CorrectionParams(by_shape=False)  # the correction before 2026-11-30 (--step-correction per-kind)


def config_of(r: StepRecord) -> str:
    """The configuration decode ran on, from the record's shape (`Split(config='split16', ...)`; else the whole GPU)."""
    m = re.search(r"config='([^']+)'", r.shape)
    return m.group(1) if m else OVERALLOCATED


def shape_of(r: StepRecord) -> StepShape:
    """The shape the correction's kinds need (fused and fused_decode records are fused steps; every other decode step
    is decode alone on its configuration: on a split it is corrected as the split kind, by configuration)."""
    if r.kind.startswith("fused"):
        return Fused(sum(n for n, _ in r.chunks))
    return DecodeAlone(config_of(r))


def replay(recs: Iterable[StepRecord], min_tokens: int) -> dict[str, list[float]]:
    """Per scheme, applied / true for each large fused step and each decode step on a split with a prediction, in
    order: the correction as it was before 2026-11-30 (`BEFORE`, its one ratio per kind) and as it is now (module
    docstring)."""
    before, now = Correction(), Correction()
    out: dict[str, list[float]] = {s: [] for s in SCHEMES}
    for r in recs:
        if r.predicted_ms is None or not r.predicted_ms > 0 or not r.measured_ms > 0:
            continue
        chunk = sum(n for n, _ in r.chunks)
        shape = shape_of(r)
        true = r.measured_ms / r.predicted_ms
        if r.kind == "fused" and r.rows + chunk >= min_tokens:
            out[SCHEMES[0]].append(before.fused / true)
            out[SCHEMES[1]].append(now.fused_ratio(r.rows + chunk) / true)
        if isinstance(shape, DecodeAlone) and shape.config != OVERALLOCATED:  # decode on a split
            out[SCHEMES[2]].append(before.split / true)
            out[SCHEMES[3]].append(now.split_ratio(shape.config) / true)
        timing = StepTiming(shape, r.rows, chunk if r.kind == "fused" else 0, r.predicted_ms, r.measured_ms)
        before, now = corrected(before, timing, BEFORE), corrected(now, timing)
    return out


def table(rows: Sequence[tuple[str, dict[str, list[float]]]]) -> str:
    lines = ["| trace | steps judged | scheme | applied / true: median | p10 | p90 |", "|---|---|---|---|---|---|"]
    for name, res in rows:
        for s in SCHEMES:
            v = np.array(res[s])
            if not len(v):
                continue
            lines.append(f"| {name} | {len(v)} | {s} | {np.median(v):.3f} | {np.percentile(v, 10):.3f} | "
                         f"{np.percentile(v, 90):.3f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="--step-trace files")
    ap.add_argument("--min-tokens", type=int, default=1152, help="a fused step this large or larger is judged")
    a = ap.parse_args(argv)
    if a.min_tokens < 1:
        ap.error("--min-tokens must be >= 1")
    missing = [p for p in a.traces if not os.path.isfile(p)]
    if missing:
        ap.error(f"no such trace file: {', '.join(missing)}")
    print(table([(p, replay(read_trace(p), a.min_tokens)) for p in a.traces]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
