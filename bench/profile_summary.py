"""Where a worker's loop spends its wall time, from py-spy's raw (collapsed) stacks.

    python bench/profile_summary.py PROFILE.txt [--loop DecodeWorker.run] [--top 15]

py-spy samples every thread at a fixed rate (`--idle`: waiting threads too), so a function's share of
the loop thread's samples is its share of wall time. Only stacks of the thread that runs `--loop` (the
decode worker's `DecodeWorker.run`, in every mode; a profile from before the one engine: the hybrid worker's
`HybridWorker.run_ahead`) count; start-up
(weights, graph capture) is outside the loop and left out. Prints the inclusive share of the loop's
phases and of the calls worth knowing, then the top leaf frames (self time).
"""

from __future__ import annotations

import argparse
import collections
import re

PHASES = ("drain", "begin_step", "decide", "shape_state", "repartition", "admit", "step", "_step", "launch_step",
          "_launch", "decode", "prefill", "grammar_rows", "_grammar_mask",
          "synchronize", "fill", "fill_or_blame", "sample_or_blame", "sample_next", "apply_grammar_mask",
          "sample", "_complete", "record", "publish", "schedule", "launch", "record_once", "read_inbox",
          "step_ahead", "tolist", "to_host", "wait")
FRAME = re.compile(r"^(?P<func>[^ ]+) \((?P<file>[^:]+):\d+\)$")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile")
    ap.add_argument("--loop", default="DecodeWorker.run", help="the loop's frame (py-spy's qualified name)")
    ap.add_argument("--top", type=int, default=15)
    a = ap.parse_args()
    total = 0
    incl: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    with open(a.profile) as f:
        for line in f:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            names = [m.group("func") if (m := FRAME.match(x)) else x for x in frames]
            if a.loop not in names:
                continue
            count = int(n)
            total += count
            below = names[names.index(a.loop) + 1 :]
            for func in set(below):
                short = func.rpartition(".")[2]
                if short in PHASES:
                    incl[func] += count
            leaf[frames[-1]] += count
    if not total:
        raise SystemExit(f"no stack runs {a.loop!r} in {a.profile}")
    print(f"{a.profile}: {total} samples in {a.loop}")
    print("| inclusive | share |")
    print("|---|---|")
    for func, n in incl.most_common():
        print(f"| {func} | {100 * n / total:.1f}% |")
    print(f"\n| top {a.top} leaf frames | share |")
    print("|---|---|")
    for frame, n in leaf.most_common(a.top):
        print(f"| {frame} | {100 * n / total:.1f}% |")


if __name__ == "__main__":
    main()
