"""Issue 16's table from a compare.py report (<name>.json) that ran vLLM's settings and ours with --peak-fractions.

    python bench/vs_vllm_summary.py REPORT.json [--fractions 0.5,0.75,0.9] [--out TABLE.md]

Per workload and system: closed requests/s (and over the vLLM baseline's), p99 ITL closed, TTFT p50 and p99 ITL
at each fraction of the baseline's closed peak (the same Poisson rate for every system), and goodput at p99
ITL <= 100 ms (compare.py's definition) over the better of the vLLM systems' goodputs. Prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any


def _runs_by_rate(sweep: dict[str, Any]) -> dict[float, dict[str, Any]]:
    out = {}
    for r in sweep["runs"]:
        rate = math.inf if r["rate"] in ("inf", math.inf) else float(r["rate"])
        out[rate] = r["summary"]
    return out


def _f(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def summary(report: dict[str, Any], fractions: list[float]) -> str:
    base = report.get("vllm_baseline")
    peaks = report.get("peaks") or {}
    vllms = {s["label"] for s in report["systems"] if s.get("kind") == "vllm"}
    rows = {(r["workload"], r["system"]): r for r in report["rows"]}
    head = ["system", "closed req/s (vs vLLM)", "p99 ITL closed ms"]
    for f in fractions:
        head += [f"TTFT p50 @ {f:g} ms", f"p99 ITL @ {f:g} ms"]
    head += ["goodput p99 ITL <= 100 ms (vs better vLLM)"]
    lines = [f"Baseline `{base}`; Poisson rates at {', '.join(f'{f:g}' for f in fractions)} of its closed peak.", ""]
    for sw_title in dict.fromkeys(s["title"] for s in report["sweeps"]):
        peak = peaks.get(sw_title)
        lines += [f"### {sw_title} (baseline peak {_f(peak, '.2f')} req/s)", "",
                  "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
        sweeps = [s for s in report["sweeps"] if s["title"] == sw_title]
        by_label = {s["label"]: _runs_by_rate(s) for s in sweeps}

        def goodput(label: str, title: str = sw_title) -> float | None:
            g = rows.get((title, label), {}).get("goodput_p99_itl_le_100ms")
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
                at = runs.get(round(f * peak, 2), {}) if peak else {}
                cells += [_f(at.get("ttft_ms", {}).get("median"), ".0f"), _f(at.get("itl_ms", {}).get("p99"), ".1f")]
            g = goodput(s["label"])
            ratio = g / best_vllm if g is not None and best_vllm else None
            cells.append("-" if g is None else f"{g:.2f} ({_f(ratio, '.2f')}x)")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report")
    ap.add_argument("--fractions", default=None, help="default: the report's --peak-fractions")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with open(a.report) as f:
        report = json.load(f)
    fractions = [float(x) for x in a.fractions.split(",")] if a.fractions else list(report.get("peak_fractions") or [])
    text = summary(report, fractions)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
