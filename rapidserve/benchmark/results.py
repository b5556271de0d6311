"""A sweep's result dict as the report and the plot read it: loading its JSON, naming its workload.

`trace_line` says in one line what a trace replay sent (the runner logs it, the report writes it).
Below both `report` (which writes the result, its markdown and its plot) and `plot` (which draws
results), so neither imports the other's helpers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any


def workload_title(workload: Mapping[str, Any]) -> str:
    """'fixed 4096:64', 'multiturn 1024:128 x4 (+128/turn)', or the trace's name."""
    name = str(workload.get("name", "?"))
    if name == "fixed":
        return f"fixed {workload.get('input_len')}:{workload.get('output_len')}"
    if name == "multiturn":
        return (f"multiturn {workload.get('input_len')}:{workload.get('output_len')} x{workload.get('num_turns')} "
                f"(+{workload.get('turn_input_len')}/turn)")
    if name == "trace":
        return f"trace {os.path.basename(str(workload.get('trace', '?')))}"
    return name


def trace_line(t: dict[str, Any]) -> str:
    """One line about a replay (`Replay.describe()`, the result's "trace"): file, window, counts,
    ideal hit rate."""
    start, end = t["window_s"]
    window = f"[{start:g}, {end:g}) s" if end is not None else f"{start:g} s to the end"
    hits = f"ideal prefix-cache hit rate {100 * t['ideal_hit_rate']:.1f}% ({t['block_size']}-token blocks"
    if "ideal_hit_rate_hash_blocks" in t:
        hits += f"; {100 * t['ideal_hit_rate_hash_blocks']:.1f}% in {t['hash_block_tokens']}-token hash blocks"
    else:
        hits += ": no hash ids in the trace, so every prompt is random tokens of its own"
    return (f"trace {t['file']} ({t['format']}), window {window} of trace time (lines {t['first_line']}-"
            f"{t['last_line']}), {t['arrivals']} arrivals: {t['replayed']} replayed of {t['in_window']} in the "
            f"window, {t['clipped']} clipped, {t['skipped']} skipped, {t['beyond_num_prompts']} past "
            f"--num-prompts; {hits})")


def load_result(path: str) -> dict[str, Any]:
    """A result JSON file as `rapidserve bench` wrote it (non-finite numbers are null there)."""
    with open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]
