"""The mean prompt and output lengths of a trace workload's first requests, for the device-time plan of
bench/frontier_parallel.sh (`--plan` with TRACE_WORKLOADS: the plan's probe lengths and request lifetimes come from
the prompt and output lengths, 4096:64 unless told).

    python bench/trace_lengths.py [--max-model-len 8192] -- --workload trace --trace FILE --num-prompts 64 [...]

Reads the flags of one `rapidserve bench` trace workload (others ignored): the first --num-prompts requests from
--trace-start seconds, each prompt clipped so that prompt + output fits --max-model-len (as the replay's default
`--trace-overflow clip` keeps the output), and prints "PROMPT OUTPUT", the rounded means. Exit 2 naming the flag or
the file where it cannot.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any


def _traces() -> ModuleType:
    """rapidserve/benchmark/traces.py by its path (standard library only): the plan runs where the package's
    dependencies may not be installed (the system Python that `--plan` uses), as frontier_plan.py reads presets."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "rapidserve", "benchmark", "traces.py")
    spec = importlib.util.spec_from_file_location("_trace_lengths_traces", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve the module by name
    spec.loader.exec_module(mod)
    return mod


def window_means(requests: Sequence[Any], start_s: float, n: int, max_model_len: int) -> tuple[int, int]:
    """(prompt, output) means of the first `n` requests at or after `start_s`, prompts clipped to the room the output
    leaves in `max_model_len`. ValueError where the window holds none."""
    window = [r for r in requests if r.t_s >= start_s][:n]
    if not window:
        raise ValueError(f"no request at or after --trace-start {start_s:g} s")
    outs = [min(r.output_len, max_model_len - 1) for r in window]
    ins = [max(1, min(r.input_len, max_model_len - o)) for r, o in zip(window, outs, strict=True)]
    return round(statistics.mean(ins)), round(statistics.mean(outs))


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
        prompt, output = window_means(_traces().load_trace(a.trace).requests, a.trace_start, a.num_prompts,
                                      a.max_model_len)
    except ValueError as e:  # traces.TraceError is a ValueError
        print(f"trace_lengths: {e}", file=sys.stderr)
        return 2
    print(prompt, output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
