"""The mean prompt and output lengths of a trace workload's first requests, for the device-time plan of
bench/frontier_parallel.sh (`--plan` with TRACE_WORKLOADS: the plan's probe lengths and request lifetimes come from
the prompt and output lengths, 4096:64 unless told).

    python bench/trace_lengths.py [--max-model-len 8192] -- --workload trace --trace FILE --num-prompts 64 [...]

Reads the flags of one `rapidserve bench` trace workload (others ignored): the first --num-prompts requests from
--trace-start seconds, each clipped to --max-model-len as the replay's default `--trace-overflow clip` clips it
(`workloads.clip_lengths`), and prints "PROMPT OUTPUT", the rounded means. Exit 2 naming the flag or
the file where it cannot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from rapidserve.benchmark.traces import TraceRequest, load_trace  # noqa: E402
from rapidserve.benchmark.workloads import clip_lengths  # noqa: E402


def window_means(requests: Sequence[TraceRequest], start_s: float, n: int, max_model_len: int) -> tuple[int, int]:
    """(prompt, output) means of the first `n` requests at or after `start_s`, each clipped to `max_model_len` as the
    replay clips them (`workloads.clip_lengths`). ValueError where the window holds none."""
    window = [r for r in requests if r.t_s >= start_s][:n]
    if not window:
        raise ValueError(f"no request at or after --trace-start {start_s:g} s")
    lens = [clip_lengths(r.input_len, r.output_len, max_model_len) for r in window]
    return round(statistics.mean(i for i, _ in lens)), round(statistics.mean(o for _, o in lens))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--trace-start", type=float, default=0.0)
    a, _ = ap.parse_known_args([x for x in (sys.argv[1:] if argv is None else argv) if x != "--"])
    if a.num_prompts < 1 or a.max_model_len < 2:
        ap.error("--num-prompts must be >= 1 and --max-model-len >= 2")
    try:
        prompt, output = window_means(load_trace(a.trace).requests, a.trace_start, a.num_prompts, a.max_model_len)
    except ValueError as e:  # traces.TraceError is a ValueError
        print(f"trace_lengths: {e}", file=sys.stderr)
        return 2
    print(prompt, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
