"""Where in the token stream the slow inter-token gaps fall, per system and rate of a compare run.

    python bench/gap_report.py bench/results/compare_runs/*.json --bound-ms 50

For each sweep file (one system and workload, written by bench/compare.py or `rapidserve bench`) and
rate: the p50/p99 of the first gap (first token to second) and of every later gap, and the share of
requests whose first gap, or any later gap, exceeds the bound. The strict goodput of compare.py
counts a request out for one gap over the bound, so this says whether the first gap (the hand-over
from prefill to decode in rapid mode) or the steady stream is at fault.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.benchmark.arrivals import rate_label  # noqa: E402
from rapidserve.benchmark.cli import positive_float  # noqa: E402
from rapidserve.benchmark.stats import RequestRecord, percentile  # noqa: E402
from rapidserve.jsonfile import DuplicateKeyError, load_unique  # noqa: E402


def gap_rows(label: str, result: dict, bound_ms: float) -> list[list[str]]:
    rows = []
    for run in result.get("runs", []):
        recs = [RequestRecord.from_json(r) for r in run.get("requests", [])]
        recs = [r for r in recs if r.success and len(r.itl_s) >= 2]
        if not recs:
            continue
        first = [1e3 * r.itl_s[0] for r in recs]
        later = [1e3 * g for r in recs for g in r.itl_s[1:]]
        first_over = sum(1 for g in first if g > bound_ms) / len(recs)
        later_over = sum(1 for r in recs if max(r.itl_s[1:]) * 1e3 > bound_ms) / len(recs)
        rows.append([label, rate_label(float(run["rate"])), str(len(recs)),
                     f"{percentile(first, 50):.1f}", f"{percentile(first, 99):.1f}",
                     f"{percentile(later, 50):.1f}", f"{percentile(later, 99):.1f}",
                     f"{100 * first_over:.0f}%", f"{100 * later_over:.0f}%"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="sweep result JSON files (compare_runs/*.json)")
    p.add_argument("--bound-ms", type=positive_float, default=50.0, help="the gap bound (default 50)")
    a = p.parse_args(argv)
    head = ["system", "rate", "requests", "first gap p50", "first gap p99", "later gaps p50", "later gaps p99",
            f"first gap > {a.bound_ms:g} ms", f"a later gap > {a.bound_ms:g} ms"]
    rows: list[list[str]] = []
    for path in a.files:
        try:
            result = load_unique(path)
        except DuplicateKeyError as e:
            p.error(str(e))
        except (OSError, ValueError) as e:
            p.error(f"{path}: not a readable sweep result JSON ({e})")
        if not isinstance(result, dict) or not isinstance(result.get("runs"), list):
            p.error(f"{path}: no 'runs' list; expected a sweep result from bench/compare.py or rapidserve bench")
        rows += gap_rows(str(result.get("label") or os.path.basename(path)), result, a.bound_ms)
    print("| " + " | ".join(head) + " |")
    print("|---" * len(head) + "|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
