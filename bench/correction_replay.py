"""The fused correction replayed over traced steps: the one fused ratio against the ratio by step size.

    python bench/correction_replay.py compare_logs/*.steps.jsonl [--min-tokens 1152]

For each `--step-trace` file (engine/step_trace.py), the steps are fed in order to partition/correction.py's
`corrected` as the policy fed them, and before each large fused step (decode rows plus prompt tokens >= --min-tokens:
the steps a 50-ms SLO sizes) the ratio each scheme would have priced it at is set against the step's own measured /
predicted: applied / true above 1 priced the step slower than it ran (its chunk smaller than the SLO allowed), below 1
faster (it ran over its plan). On the H200 traces of 2026-11-30 (bench/results/h200x2_1130f/) this is why the fused
correction is kept by size (partition/correction.py's docstring). Prints the table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.engine.step_trace import StepRecord, read_trace  # noqa: E402
from rapidserve.partition.correction import Correction, corrected  # noqa: E402
from rapidserve.partition.shape import OVERALLOCATED, DecodeAlone, Fused, StepShape, StepTiming  # noqa: E402

SCHEMES = ("one ratio", "by size")


def shape_of(r: StepRecord) -> StepShape:
    """The shape the correction's kinds need (step_tally.KINDS: fused and fused_decode are fused steps; split
    decode beside the prefill worker; alone decode on the whole GPU)."""
    if r.kind.startswith("fused"):
        return Fused(sum(n for n, _ in r.chunks))
    return DecodeAlone("split") if r.kind == "split" else DecodeAlone(OVERALLOCATED)  # decode on a share: "split"


def replay(recs: Iterable[StepRecord], min_tokens: int) -> dict[str, list[float]]:
    """Per scheme, applied / true for each large fused step with a prediction, in order (module docstring)."""
    c = Correction()
    out: dict[str, list[float]] = {s: [] for s in SCHEMES}
    for r in recs:
        if r.predicted_ms is None or not r.predicted_ms > 0 or not r.measured_ms > 0:
            continue
        chunk = sum(n for n, _ in r.chunks)
        if r.kind == "fused" and r.rows + chunk >= min_tokens:
            true = r.measured_ms / r.predicted_ms
            out["one ratio"].append(c.fused / true)
            out["by size"].append(c.fused_ratio(r.rows + chunk) / true)
        c = corrected(c, StepTiming(shape_of(r), r.rows, chunk if r.kind == "fused" else 0, r.predicted_ms,
                                    r.measured_ms))
    return out


def table(rows: Sequence[tuple[str, dict[str, list[float]]]]) -> str:
    lines = ["| trace | large fused steps | scheme | applied / true: median | p10 | p90 |", "|---|---|---|---|---|---|"]
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
