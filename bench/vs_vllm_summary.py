"""Issue 16's table from a compare.py report (<name>.json) that ran vLLM's settings and ours with --peak-fractions.

    python bench/vs_vllm_summary.py REPORT.json [--fractions 0.5,0.75,0.9] [--out TABLE.md]

Per workload and system: closed requests/s (and over the vLLM baseline's), p99 ITL closed, TTFT p50 and p99 ITL
at each fraction of the reference's closed peak (the same Poisson rate for every system: compare_peak's
`fraction_rates`), and goodput at p99 ITL <= 100 ms (compare.py's definition; the report's first ITL bound when
100 ms is not among them) over the better of the vLLM systems' goodputs. Prints the markdown.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_peak import fraction_rates, fractions_arg, rate_of  # noqa: E402

from rapidserve.jsonfile import load_unique  # noqa: E402


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary(report: dict[str, Any], fractions: Sequence[float]) -> str:
    base = report.get("vllm_baseline")
    peaks = report.get("peaks") or {}
    bounds = [float(b) for b in report.get("itl_bounds_ms") or [100.0]]
    bound = 100.0 if 100.0 in bounds else bounds[0]
    gkey = f"goodput_p99_itl_le_{bound:g}ms"
    vllms = {s["label"] for s in report["systems"] if s.get("kind") == "vllm"}
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    head = ["system", "closed req/s (vs vLLM)", "p99 ITL closed ms"]
    for f in fractions:
        head += [f"TTFT p50 @ {f:g} ms", f"p99 ITL @ {f:g} ms"]
    head += [f"goodput p99 ITL <= {bound:g} ms (vs better vLLM)"]
    lines = [f"Baseline `{base}`; Poisson rates at {', '.join(f'{f:g}' for f in fractions)} of the reference's "
             f"(`{report.get('peak_reference')}`) closed peak.", ""]
    for title in dict.fromkeys(s["title"] for s in report["sweeps"]):
        peak = peaks.get(title)
        lines += [f"### {title} (reference peak {_f(peak, '.2f')} req/s)", "",
                  "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        sweeps = [s for s in report["sweeps"] if s["title"] == title]
        by_label = {s["label"]: {rate_of(r): r["summary"] for r in s["runs"]} for s in sweeps}

        def goodput(label: str, title: str = title) -> float | None:
            g = rows.get((title, label), {}).get(gkey)
            return None if g is None else float(g["goodput"])

        best_vllm = max((g for g in (goodput(v) for v in vllms) if g is not None), default=None)
        base_closed = by_label.get(base, {}).get(math.inf, {}).get("request_throughput")
        for s in sweeps:
            runs = by_label[s["label"]]
            closed = runs.get(math.inf, {})
            rps = closed.get("request_throughput")
            cells = [s["label"], f"{_f(rps, '.2f')} ({_f(rps / base_closed if rps and base_closed else None, '.2f')}x)",
                     _f(closed.get("itl_ms", {}).get("p99"), ".1f")]
            for f in fractions:
                at = fraction_rates(peak, (f,), ())
                run = runs.get(at[0], {}) if at else {}
                cells += [_f(run.get("ttft_ms", {}).get("median"), ".0f"), _f(run.get("itl_ms", {}).get("p99"), ".1f")]
            g = goodput(s["label"])
            ratio = g / best_vllm if g is not None and best_vllm else None
            cells.append("-" if g is None else f"{g:.2f} ({_f(ratio, '.2f')}x)")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--fractions", default=None, help="default: the report's --peak-fractions")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    try:
        report = load_unique(a.report)  # ValueError naming the file: not JSON, a key written twice
        fractions = fractions_arg(a.fractions) if a.fractions else tuple(report.get("peak_fractions") or ())
        text = summary(report, fractions)
    except (OSError, ValueError, KeyError, TypeError) as e:
        ap.error(f"{a.report}: {e!r}: give a compare.py report (<name>.json) and fractions in (0, 2]")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
