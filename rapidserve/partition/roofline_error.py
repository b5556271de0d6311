"""How far the roofline's estimates (partition/roofline.py) carry: per-entry errors of a predicted profile
against a measured one (`rapidserve profile` writes the report next to each profile it measures)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rapidserve.partition.profile import Profile

# (name in the report, p50 field of Entry)
METRICS: tuple[tuple[str, str], ...] = (
    ("decode_alone", "decode_ms_alone_p50"),
    ("decode_beside_prefill", "decode_ms_beside_prefill_p50"),
    ("prefill_tokens_per_s", "prefill_tokens_per_s"),
)


@dataclass(frozen=True)
class EntryError:
    """Signed relative errors (predicted - measured) / measured of one entry, per metric name."""

    config: str
    batch: int
    context: int
    errors: dict[str, float]


@dataclass(frozen=True)
class MetricStats:
    n: int
    median_abs: float
    p90_abs: float
    median_signed: float  # > 0: the model over-predicts


@dataclass(frozen=True)
class ErrorReport:
    gpu: str
    model: str
    rows: tuple[EntryError, ...]
    stats: dict[str, MetricStats]
    unmatched: tuple[tuple[str, int, int], ...]  # measured entries the prediction lacks

    def to_markdown(self) -> str:
        out = [f"### Roofline error against measurements: {self.gpu} / {self.model}", "",
               "| metric | entries | median abs | p90 abs | median signed |", "| --- | --- | --- | --- | --- |"]
        out += [f"| {m} | {s.n} | {s.median_abs:.1%} | {s.p90_abs:.1%} | {s.median_signed:+.1%} |"
                for m, s in self.stats.items()]
        out += ["", "| config | batch | context | " + " | ".join(m for m, _ in METRICS) + " |",
                "| --- " * (3 + len(METRICS)) + "|"]
        out += [f"| {r.config} | {r.batch} | {r.context} | " + " | ".join(f"{v:+.1%}" for v in r.errors.values()) + " |"
                for r in self.rows]
        if self.unmatched:
            out += ["", f"{len(self.unmatched)} measured entries have no prediction: {list(self.unmatched)[:5]}"]
        return "\n".join(out) + "\n"


def _p90(xs: Sequence[float]) -> float:
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=10, method="inclusive")[-1]


def compare(measured: Profile, predicted: Profile) -> ErrorReport:
    """Per-entry relative errors of `predicted` against `measured` (p50 latencies, tokens/s)."""
    pred = {(e.config, e.batch, e.context): e for e in predicted.entries}
    rows, unmatched = [], []
    for m in measured.entries:
        key = (m.config, m.batch, m.context)
        p = pred.get(key)
        if p is None:
            unmatched.append(key)
            continue
        errs = {name: (getattr(p, f) - getattr(m, f)) / getattr(m, f) for name, f in METRICS}
        rows.append(EntryError(*key, errs))
    if not rows:
        raise ValueError("the profiles share no (config, batch, context) entry")
    stats = {}
    for name, _ in METRICS:
        signed = [r.errors[name] for r in rows]
        absolute = [abs(x) for x in signed]
        stats[name] = MetricStats(len(rows), statistics.median(absolute), _p90(absolute),
                                  statistics.median(signed))
    return ErrorReport(measured.gpu, measured.model, tuple(rows), stats, tuple(unmatched))
