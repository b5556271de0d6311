"""The order in which pytest-xdist hands out the suite's files (`--dist loadfile`, the README's test command): the
longest first, so that the run does not end on one worker with a long file while the other has nothing left.

pytest-xdist's own order (`--loadscope-reorder`, its default) is by the number of tests in a file, most first,
which puts the files of one or two long tests (engines and servers started end to end) last, and the AMD compile
check (17 tests, one of them ~300 CPU-s with its own compile processes) in the middle of the run. Here files are
taken by `SECONDS` (measured, rounded; only the order matters, so a stale figure costs time, never a result), the
others after them in pytest-xdist's order. conftest.py applies it in pytest-xdist's workers (their collections are
what the controller hands out) and turns the controller's reordering off; a run that is not distributed keeps
pytest's order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Protocol

# The longest files, seconds of one run of the whole suite on 2 loaded cores (the sum of their tests' setup, call
# and teardown; pytest --durations), 2026-11-29. Keep the longest files here; the rest may go unlisted.
SECONDS: dict[str, int] = {
    "tests/test_amd_compile.py": 1250, "tests/test_engine.py": 360, "tests/test_fuzz_http.py": 305,
    "tests/test_request_fields.py": 290, "tests/test_moe_align.py": 190, "tests/test_bench_compare.py": 165,
    "tests/test_structured_server.py": 145, "tests/test_fp8_fused.py": 125, "tests/test_kv_fp8_attention.py": 120,
    "tests/test_fp8_ops.py": 115, "tests/test_llm_equivalence.py": 100, "tests/test_llm_one_loop.py": 90,
    "tests/test_step_shapes.py": 85, "tests/test_soak.py": 85, "tests/test_drift_engine.py": 85,
    "tests/test_loader.py": 80, "tests/test_tokenizer.py": 75, "tests/test_server_supervision.py": 75,
    "tests/test_attention_window.py": 75, "tests/test_server_failures.py": 70, "tests/test_fused_decode_ops.py": 70,
    "tests/test_disagg_engine.py": 70, "tests/test_router_scaleout.py": 65, "tests/test_bench_cli.py": 65,
    "tests/test_server.py": 55, "tests/test_attention_decode.py": 55, "tests/test_data_parallel_engines.py": 45,
    "tests/test_deploy_slurm.py": 45, "tests/test_moe_ops.py": 45, "tests/test_decode_attn_tune.py": 40,
    "tests/test_tool_server.py": 40, "tests/test_hybrid_server.py": 40, "tests/test_attention.py": 40,
}


class _Item(Protocol):
    nodeid: str


def file_of(item: _Item) -> str:
    return item.nodeid.split("::", 1)[0]


def longest_first(items: Sequence[_Item]) -> list[_Item]:
    """`items` regrouped by file, the files in `SECONDS` first (longest first), then the rest by their number of
    tests (most first: pytest-xdist's own order); each file's tests keep their order. Stable: equal keys keep
    pytest's order."""
    tests = Counter(file_of(i) for i in items)
    first_seen = {f: n for n, f in enumerate(dict.fromkeys(file_of(i) for i in items))}

    def key(item: _Item) -> tuple[int, int, int]:
        f = file_of(item)
        return -SECONDS.get(f, 0), -tests[f], first_seen[f]

    return sorted(items, key=key)
