"""One goodput-frontier table from several bench/compare.py --goodput-search reports: the groups of systems that
ran side by side on separate GPUs (bench/frontier_parallel.sh), or in separate device calls, joined without
running anything again.

    python bench/compare_merge.py frontier_ours-tp.json frontier_hybrid-chunks.json frontier_vllm-default.json \\
        --out bench/results/h200x4_MMDD --name frontier_tp

Every report must describe the same comparison as the first (compare_continue.load_prior's checks: model, --serve-args
with its TP size, workloads, search settings but how far each search looked, ...: a report whose searches ran
--search-repeats N times joins only reports of the same N); a system label may appear in one report only.
Writes <name>.json / .md (and the frontier plots, where matplotlib is there) as compare.py does: goodput by system
and ITL bound (with the composite row of the duet@B systems, computed from the merged frontiers), the better vLLM,
and the engine default's ratios to vLLM and to our other systems (compare_ratios.versus_ours). A report that is
missing or does not match is named and skipped; the merge fails (exit 1) only when none is left.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_args import folder_arg, stem_arg  # noqa: E402
from compare_continue import MATCH, MATCH_NEWER, load_prior  # noqa: E402
from compare_frontier import write_frontier_report  # noqa: E402
from compare_slo import COMPOSITE, is_part  # noqa: E402

from rapidserve.jsonfile import load_unique  # noqa: E402


def merge_reports(paths: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """(the merged report: the first readable report's header, every report's systems and frontiers in order;
    one line per report skipped and why). ValueError when no report can be read."""
    merged: dict[str, Any] | None = None
    skipped: list[str] = []
    for path in paths:
        if not os.path.isfile(path):
            skipped.append(f"{path}: no such file (that group wrote no report)")
            continue
        try:
            if merged is None:
                head = load_unique(path)  # ValueError naming the file: not JSON, a key written twice
                report = load_prior(path, head if isinstance(head, dict) else {})
                if report.get("mode") != "goodput_search":
                    raise ValueError(f"{path} is a sweep's report: merge joins --goodput-search reports")
                keep = (*MATCH, *MATCH_NEWER, "created", "vllm_model", "vllm_serve", "bench_args", "vllm_baseline")
                merged = {**{k: report.get(k) for k in keep}, "systems": [], "frontiers": []}
            else:
                report = load_prior(path, merged)
        except ValueError as e:
            skipped.append(str(e))
            continue
        have = {f["label"] for f in merged["frontiers"]}
        again = sorted(have & {f["label"] for f in report["frontiers"]})
        if again:
            skipped.append(f"{path}: {', '.join(again)} already in an earlier report; a system appears once")
            continue
        merged["systems"] += [{**s, "report": s.get("report", path)} for s in report["systems"]]
        merged["frontiers"] += report["frontiers"]
        merged["vllm_baseline"] = merged.get("vllm_baseline") or report.get("vllm_baseline")
    if merged is None:
        raise ValueError("no report could be read: " + "; ".join(skipped))
    return merged, skipped


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="+", help="compare.py --goodput-search reports (<name>.json), in table order")
    p.add_argument("--out", type=folder_arg, required=True, help="folder of the merged <name>.json / .md")
    p.add_argument("--name", type=stem_arg, default="frontier_merged")
    p.add_argument("--reference", default=None,
                   help="the system the ratios divide (default: the engine's default policy, the composite row "
                        "'default (SLO = bound)' where duet@B systems ran, else rapidserve)")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    try:
        merged, skipped = merge_reports(a.reports)
    except ValueError as e:
        print(f"compare_merge: {e}", file=sys.stderr)
        return 1
    for line in skipped:
        print(f"compare_merge: skipped {line}", file=sys.stderr)
    labels = list(dict.fromkeys(f["label"] for f in merged["frontiers"]))
    known = [*labels, *([COMPOSITE] if any(is_part(x) for x in labels) else [])]
    if a.reference is not None and a.reference not in known:  # else every ratio row would be silently missing
        p.error(f"--reference {a.reference!r} is none of the merged systems: give one of {', '.join(known)}")
    os.makedirs(a.out, exist_ok=True)
    meta = {**{k: v for k, v in merged.items() if k != "frontiers"}, "reference": a.reference}
    paths = write_frontier_report(argparse.Namespace(out=a.out, name=a.name), meta, [], plot=not a.no_plot,
                                  prior={"frontiers": merged["frontiers"]})
    print("wrote " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
