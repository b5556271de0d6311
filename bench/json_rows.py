"""Compact JSON for the compile reports (bench/amd_compile_check.py, bench/kernel_compile_audit.py): one line a row,
each row's users ("label: step" strings) with the steps that differ only in their batch folded into one entry."""

from __future__ import annotations

import json
from typing import Any


def compact_uses(uses: list[str]) -> list[str]:
    """`uses` with the steps that differ only in their batch folded, in first-seen order: "m: decode b1",
    "m: decode b2" -> "m: decode b1,2" (a row lists a kernel's users without hundreds of near-identical lines)."""
    groups: dict[str, list[str]] = {}
    for use in uses:
        head, sep, last = use.rpartition(" b")
        key, batch = (head, last) if sep and last.isdigit() else (use, "")
        seen = groups.setdefault(key, [])
        if batch and batch not in seen:
            seen.append(batch)
    return [f"{k} b{','.join(v)}" if v else k for k, v in groups.items()]


def dump_report(report: dict[str, Any]) -> str:
    """`report` as JSON, its "rows" one line each (their "used_by" compacted by `compact_uses`), the rest indented."""
    rows = [{**r, "used_by": compact_uses(r["used_by"])} if "used_by" in r else r for r in report["rows"]]
    head = json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1, default=str)[:-2]
    body = ",\n  ".join(json.dumps(r, default=str) for r in rows)
    return f'{head},\n "rows": [\n  {body}\n ]\n}}\n'
