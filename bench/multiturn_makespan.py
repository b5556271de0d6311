"""Where a closed multi-turn run's time goes: its makespan split into the first round and the tail.

With every conversation sent at once (`rapidserve bench --workload multiturn --request-rate inf`), requests/s is
requests / makespan, and the makespan is the end of the first round (the last turn-0 first token: every
conversation has started) plus the tail of the conversation that ends last (its turns' TTFTs and ITLs). This
prints both per run, from bench/compare.py's per-run files (`<out>/compare_runs/*.json`, or the
`vs_vllm_detail.tar.gz` of bench/vs_vllm.sh unpacked), so a throughput gap can be read as "the first round's
prefill was slower" or "the tail's decode steps were slower".

    python bench/multiturn_makespan.py DIR_OR_FILES... [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rapidserve.jsonfile import load_unique  # noqa: E402


def breakdown(requests: list[dict[str, Any]]) -> dict[str, float]:
    """The makespan of one run and its parts (seconds; ITL and TTFT of the last conversation in ms)."""
    ok = [r for r in requests if r.get("success")]
    if not ok or any(r.get("conversation") is None or r.get("turn") is None for r in ok):
        raise ValueError("not a multi-turn run: every request needs a conversation and a turn")
    if not any(r["turn"] == 0 for r in ok):
        raise ValueError("no first turn succeeded: the first round has no end")
    t0 = min(r["start_s"] for r in ok)
    convs: dict[int, list[dict[str, Any]]] = {}
    for r in ok:
        convs.setdefault(int(r["conversation"]), []).append(r)
    last = sorted(max(convs.values(), key=lambda rs: max(x["start_s"] + x["e2e_s"] for x in rs)),
                  key=lambda x: x["turn"])
    itl = [g for x in last for g in x["itl_s"]]
    return {
        "requests": len(ok),
        "makespan_s": max(r["start_s"] + r["e2e_s"] for r in ok) - t0,
        "first_round_end_s": max(r["start_s"] + r["ttft_s"] for r in ok if r["turn"] == 0) - t0,
        "last_conversation_first_token_s": last[0]["start_s"] + last[0]["ttft_s"] - t0,
        "last_conversation_itl_mean_ms": 1e3 * statistics.fmean(itl) if itl else 0.0,
        "last_conversation_later_ttft_mean_ms": 1e3 * statistics.fmean(x["ttft_s"] for x in last[1:]) if last[1:]
        else 0.0,
    }


def runs_of(path: Path) -> list[tuple[str, dict[str, float]]]:
    d = load_unique(path)  # ValueError naming the file: not JSON, a key written twice
    label = d.get("label", path.stem)
    return [(label, breakdown(run["requests"])) for run in d.get("runs", [])]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", type=Path, help="compare_runs/*.json files, or folders holding them")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    files: list[Path] = []
    for p in a.paths:
        files += sorted(p.rglob("*.json")) if p.is_dir() else [p]
    rows: list[dict[str, Any]] = []
    for f in files:
        try:
            rows += [{"label": label, "file": f.name, **b} for label, b in runs_of(f)]
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            print(f"multiturn_makespan: skipping {f}: {e}", file=sys.stderr)
    if not rows:
        print("multiturn_makespan: no multi-turn run found", file=sys.stderr)
        return 2
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    print("| system | makespan (s) | first round ends (s) | last conversation: mean ITL (ms) "
          "| mean TTFT of its later turns (ms) |")
    print("|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["label"], r["file"])):
        print(f"| {r['label']} | {r['makespan_s']:.2f} | {r['first_round_end_s']:.2f} | "
              f"{r['last_conversation_itl_mean_ms']:.1f} | {r['last_conversation_later_ttft_mean_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
