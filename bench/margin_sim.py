"""Duet's adapted SLO margin (rapidserve/partition/margin.py) on simulated steps, no GPU: where it settles and how
many token gaps go over the SLO, for a range of step jitter and host time around the steps.

Each simulated step is planned just under `margin x SLO` (uniform in 93-100% of it: the chunk search lands under the
limit), takes that times a normal factor of mean 1 and sd JITTER, and its gap adds |normal(0, HOST ms)|; `adapted`
folds each in, as DuetPolicy.observe does on the decode worker. Prints, per (jitter, host): the margin every
`--every` steps, its mean, and the share of gaps over the SLO (the controller holds it near its 1% target).

    python bench/margin_sim.py [--steps 5000] [--slo-ms 50] [--out DIR]

What it does not model: a real GPU's step-time distribution (heavier tails: a page fault, a compile, a switch of
configuration), or the chunk's effect on later steps; the GPU A/B is bench/frontier_plan.py's group margin-ab.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from table_out import write_table_files  # noqa: E402

from rapidserve.partition.margin import DEFAULT_MARGIN, Margin, adapted  # noqa: E402
from rapidserve.partition.shape import Fused, StepTiming  # noqa: E402

CASES = ((0.01, 0.3), (0.02, 0.5), (0.04, 1.0), (0.06, 2.0))  # (step jitter as a share, host ms sd)


def simulate(jitter: float, host_ms: float, steps: int, slo_ms: float, every: int, seed: int) -> dict[str, object]:
    rng = random.Random(seed)
    m, over, total, trace = Margin(DEFAULT_MARGIN.start), 0, 0.0, []
    for i in range(steps):
        planned = m.margin * slo_ms * rng.uniform(0.93, 1.0)
        measured = planned * rng.gauss(1.0, jitter)
        gap = measured + abs(rng.gauss(0.0, host_ms))
        over += gap > slo_ms
        total += m.margin
        m = adapted(m, StepTiming(Fused(1024), 256, 1024, planned, measured, gap), slo_ms)
        if (i + 1) % every == 0:
            trace.append(round(m.margin, 3))
    return {"jitter": jitter, "host_ms": host_ms, "margin_every": trace, "margin_mean": round(total / steps, 3),
            "gaps_over_share": round(over / steps, 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--every", type=int, default=1000, help="print the margin every this many steps")
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write margin_sim.json and .md here")
    a = ap.parse_args(argv)
    if a.steps < 1 or a.every < 1 or not a.slo_ms > 0:
        ap.error("--steps and --every must be >= 1 and --slo-ms > 0")
    rows = [simulate(j, h, a.steps, a.slo_ms, a.every, a.seed) for j, h in CASES]
    lines = [f"| step jitter | host ms (sd) | margin every {a.every} steps | mean margin | gaps over the SLO |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['jitter']:.0%} | {r['host_ms']} | {r['margin_every']} | {r['margin_mean']} | "
              f"{r['gaps_over_share']:.2%} |" for r in rows]
    md = "\n".join(lines)
    write_table_files(a.out, "margin_sim", a, rows, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
