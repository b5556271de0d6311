"""A sweep's result dict as the report and the plot read it: loading its JSON, naming its workload.

Below both `report` (which writes the result, its markdown and its plot) and `plot` (which draws
results), so neither imports the other's helpers.
"""

from __future__ import annotations

import json
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
    return name


def load_result(path: str) -> dict[str, Any]:
    """A result JSON file as `rapidserve bench` wrote it (non-finite numbers are null there)."""
    with open(path) as f:
        return json.load(f)  # type: ignore[no-any-return]
