"""How well the step cost models fit the steps a server really ran: reads `--step-trace` files (engine/step_trace.py;
`bench/compare.py --step-traces` writes one per rapidserve system into compare_logs/) and, per step kind, says how far
the policy's predictions were off and which model would have fitted.

    python bench/step_fit.py compare_logs/*.steps.jsonl --slo-itl-ms 50 --out bench/results/step_fit_<run>

Models, fitted per kind on the first half of each file's steps (in time) and judged on the second half (so a model
is not credited for what it memorised):
* `policy`: the policy's own prediction times its correction ratio as the step saw it (what the policy planned with;
  steps with no prediction are left out of every model's figures, so all are judged on the same steps);
* `ratio`: the raw prediction times one least-squares ratio (a correction that had settled: what the online
  correction converges to);
* `linear`: measured ~ a + b x rows + c x context_sum + d x chunk tokens + e x chunk attention (sum of n x (cached +
  n / 2) over the chunks: a chunk's attention to its prefix and itself), least squares, no prediction used: the
  shape-by-shape model a profile-free fit would give.
For each: the median and p95 of |error| / measured, and the share of steps the model put within `margin x SLO` that
took longer than the SLO (a sized step's overrun: what breaks the ITL bound). Before it, every step by how it was
launched (behind a step in flight, or with none: engine/step_cycle.py LAUNCHES) with its gaps and steps over the SLO
and the device's idle time before it: a gap over with no step over it is a host-bound bubble, and this says which
launches made them. The models' table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.engine.step_trace import StepRecord, read_trace  # noqa: E402

MODELS = ("policy", "ratio", "linear")
FEATURES = ("1", "rows", "context_sum", "chunk_tokens", "chunk_attention")


def features(r: StepRecord) -> list[float]:
    """The linear model's regressors of one step (FEATURES)."""
    tokens = sum(n for n, _ in r.chunks)
    attention = sum(n * (start + n / 2) for n, start in r.chunks)
    return [1.0, float(r.rows), float(r.context_sum), float(tokens), attention]


def policy_ms(r: StepRecord) -> float | None:
    """What the policy planned the step at: the trace's `planned_ms` where it has one (the corrected prediction the
    policy compared with the SLO), else its raw prediction times its correction of the step's kind then (the
    correction's kinds: partition/correction.py; a split's decode and a fused decode-only step are corrected as
    "split" / "decode"), or the raw prediction where it held none."""
    if r.planned_ms is not None:
        return r.planned_ms
    if r.predicted_ms is None:
        return None
    key = {"fused": "fused", "fused_decode": "decode", "split": "split", "alone": "decode"}.get(r.kind, r.kind)
    return r.predicted_ms * r.correction.get(key, 1.0)


@dataclass(frozen=True)
class Fit:
    kind: str
    steps: int  # judged (the second half)
    fitted: int  # the first half
    errors: dict[str, tuple[float, float]]  # model -> (median, p95) of |error| / measured
    overruns: dict[str, float]  # model -> share of the steps it put within margin x SLO that took > SLO
    coefficients: dict[str, float]  # the linear model's, ms per unit of each feature
    ratio: float


def usable(recs: Sequence[StepRecord]) -> list[StepRecord]:
    """The steps every model can be judged on: a positive prediction and measured time."""
    return [r for r in recs if r.predicted_ms is not None and r.predicted_ms > 0 and r.measured_ms > 0]


def halves(recs: Sequence[StepRecord]) -> tuple[list[StepRecord], list[StepRecord]]:
    """(the earlier half of `recs` in time, the later half)."""
    recs = sorted(recs, key=lambda r: r.t)
    return list(recs[:len(recs) // 2]), list(recs[len(recs) // 2:])


def fit_kind(kind: str, train: Sequence[StepRecord], test: Sequence[StepRecord], slo_ms: float,
             margin: float) -> Fit | None:
    """The three models fitted on `train` and judged on `test` (steps of one kind, `usable`); None with fewer than 4
    steps in either."""
    if len(train) < 4 or len(test) < 4:
        return None
    y_train = np.array([r.measured_ms for r in train])
    p_train = np.array([r.predicted_ms for r in train], dtype=float)
    ratio = float(p_train @ y_train / (p_train @ p_train))
    coef, *_ = np.linalg.lstsq(np.array([features(r) for r in train]), y_train, rcond=None)
    y = np.array([r.measured_ms for r in test])
    preds = {"policy": np.array([policy_ms(r) for r in test], dtype=float),
             "ratio": ratio * np.array([r.predicted_ms for r in test], dtype=float),
             "linear": np.array([features(r) for r in test]) @ coef}
    errors, overruns = {}, {}
    for name, p in preds.items():
        rel = np.abs(p - y) / y
        errors[name] = (float(np.median(rel)), float(np.percentile(rel, 95)))
        sized = p <= margin * slo_ms
        overruns[name] = float(np.mean(y[sized] > slo_ms)) if sized.any() else 0.0
    return Fit(kind, len(test), len(train), errors, overruns, dict(zip(FEATURES, map(float, coef), strict=True)),
               ratio)


def fit_traces(paths: Sequence[str], slo_ms: float, margin: float) -> list[Fit]:
    """Per kind: each file's usable steps split in time (its own worker's clock), the earlier halves pooled to fit,
    the later halves pooled to judge."""
    pools: dict[str, tuple[list[StepRecord], list[StepRecord]]] = {}
    for path in paths:
        recs = usable(read_trace(path))
        for kind in sorted({r.kind for r in recs}):
            train, test = halves([r for r in recs if r.kind == kind])
            pool = pools.setdefault(kind, ([], []))
            pool[0].extend(train)
            pool[1].extend(test)
    fits = (fit_kind(kind, train, test, slo_ms, margin) for kind, (train, test) in sorted(pools.items()))
    return [f for f in fits if f is not None]


def gaps_by_launch(paths: Sequence[str], slo_ms: float) -> list[tuple[str, int, int, int, float]]:
    """Per launch (engine/step_cycle.py LAUNCHES: behind a step in flight, or with none and why), over every step of
    the traces: (launch, steps, token gaps over the SLO, steps whose device time was over it, mean device idle ms
    before a step): where the gaps over the SLO with no step over it come from."""
    acc: dict[str, list[float]] = {}
    for path in paths:
        for r in read_trace(path):
            a = acc.setdefault(r.launch or "-", [0, 0, 0, 0.0, 0])
            a[0] += 1
            a[1] += r.gap_ms is not None and r.gap_ms > slo_ms
            a[2] += r.measured_ms > slo_ms
            if r.idle_ms is not None:
                a[3] += r.idle_ms
                a[4] += 1
    return [(k, int(a[0]), int(a[1]), int(a[2]), a[3] / a[4] if a[4] else 0.0) for k, a in sorted(acc.items())]


def launch_table(rows: Sequence[tuple[str, int, int, int, float]], slo_ms: float) -> str:
    lines = [f"| launch | steps | gaps over {slo_ms:g} ms | steps over {slo_ms:g} ms | mean idle before (ms) |",
             "|---|---|---|---|---|"]
    lines += [f"| {k} | {n} | {g} | {o} | {i:.2f} |" for k, n, g, o, i in rows]
    return "\n".join(lines) + "\n"


def table(fits: Sequence[Fit], slo_ms: float, margin: float) -> str:
    """The linear model's coefficients, then the table (last)."""
    lines = ["Linear model (ms per unit, fitted on the earlier halves): "
             + "; ".join(f"{f.kind}: " + ", ".join(f"{k} {v:.3g}" for k, v in f.coefficients.items())
                         + f" (least-squares ratio {f.ratio:.3f})" for f in fits), "",
             f"Judged on each trace's later half of steps; SLO {slo_ms:g} ms, sized = predicted within {margin:g} x "
             "SLO.", "",
             "| kind | steps | model | median abs err | p95 abs err | sized steps over SLO |",
             "|---|---|---|---|---|---|"]
    for f in fits:
        for m in MODELS:
            med, p95 = f.errors[m]
            lines.append(f"| {f.kind} | {f.steps} | {m} | {med:.1%} | {p95:.1%} | {f.overruns[m]:.1%} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", help="--step-trace files")
    ap.add_argument("--slo-itl-ms", type=float, default=50.0)
    ap.add_argument("--margin", type=float, default=0.9, help="a step is 'sized' when predicted within this x SLO")
    ap.add_argument("--out", default=None, help="write step_fit.json and step_fit.md here")
    a = ap.parse_args(argv)
    if not 0 < a.margin <= 1 or not a.slo_itl_ms > 0:
        ap.error(f"--margin {a.margin} must be in (0, 1] and --slo-itl-ms {a.slo_itl_ms} > 0")
    missing = [p for p in a.traces if not os.path.isfile(p)]
    if missing:
        ap.error(f"no such trace file: {', '.join(missing)}")
    try:
        fits = fit_traces(a.traces, a.slo_itl_ms, a.margin)
    except ValueError as e:
        print(f"step_fit: {e}", file=sys.stderr)
        return 1
    md = launch_table(gaps_by_launch(a.traces, a.slo_itl_ms), a.slo_itl_ms) + "\n" + table(fits, a.slo_itl_ms, a.margin)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "step_fit.json"), "w") as f:
            json.dump({"traces": list(a.traces), "slo_itl_ms": a.slo_itl_ms, "margin": a.margin,
                       "fits": [f.__dict__ for f in fits]}, f, indent=1)
        with open(os.path.join(a.out, "step_fit.md"), "w") as f:
            f.write(f"# Step cost models against the traced steps\n\n`python bench/step_fit.py {' '.join(a.traces)} "
                    f"--slo-itl-ms {a.slo_itl_ms:g} --margin {a.margin:g}`\n\n{md}")
    print(md if fits else "no kind had 8 steps with a prediction")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
