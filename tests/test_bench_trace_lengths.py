"""bench/trace_lengths.py: a trace workload's mean lengths for bench/frontier_parallel.sh's plan."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rapidserve.benchmark.traces import TraceRequest
from tests.test_bench_compare import _load
from tests.test_server import ROOT

tl = _load("trace_lengths")

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
    f"2023-11-16 18:15:{s:02d}.000,{p},{o}\n" for s, p, o in [(0, 1000, 10), (1, 3000, 30), (2, 9000, 100), (3, 5, 1)])


def reqs(*lens: tuple[float, int, int]) -> list[TraceRequest]:
    return [TraceRequest(i + 1, t, p, o) for i, (t, p, o) in enumerate(lens)]


@pytest.mark.parametrize(("start", "n", "mml", "want"), [
    (0.0, 2, 8192, (2000, 20)),  # the first two
    (0.0, 10, 8192, (round((1000 + 3000 + 8092 + 5) / 4), round((10 + 30 + 100 + 1) / 4))),  # 9000 clipped to 8092
    (1.5, 10, 8192, (round((8092 + 5) / 2), round(101 / 2))),  # from the window's start
    (0.0, 1, 8, (4, 4)),  # over the model's length: the output capped at half of it, the prompt takes the rest
])
def test_window_means(start: float, n: int, mml: int, want: tuple[int, int]) -> None:
    got = tl.window_means(reqs((0, 1000, 10), (1, 3000, 30), (2, 9000, 100), (3, 5, 1)) if mml > 8 else
                          reqs((0, 4, 20)), start, n, mml)
    assert got == want


def test_an_empty_window_is_named() -> None:
    with pytest.raises(ValueError, match="--trace-start 9"):
        tl.window_means(reqs((0, 10, 1)), 9.0, 4, 8192)


def test_the_command_line_and_the_plan(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trace = tmp_path / "t.csv"
    trace.write_text(AZURE)
    flags = ["--", "--workload", "trace", "--trace", str(trace), "--trace-arrivals", "poisson", "--num-prompts", "2"]
    r = subprocess.run([sys.executable, "bench/trace_lengths.py", *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert (r.returncode, r.stdout.split()) == (0, ["2000", "20"]), r.stderr
    bad = subprocess.run([sys.executable, "bench/trace_lengths.py", "--", "--trace", str(tmp_path / "none.csv")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "none.csv" in bad.stderr
    zero = subprocess.run([sys.executable, "bench/trace_lengths.py", *flags[:-1], "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert zero.returncode == 2 and "--num-prompts must be >= 1" in zero.stderr
    unread = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHON": sys.executable, "KIND_GPUS": "2", "GROUP": "ours",
                                 "TRACE_WORKLOADS": f"--workload trace --trace {tmp_path / 'none.csv'}"}, timeout=60)
    assert unread.returncode == 0 and "4096-token prompts" in unread.stdout and "none.csv" in unread.stderr
    env = {**os.environ, "PYTHON": sys.executable, "KIND_GPUS": "2", "GROUP": "ours",
           "TRACE_WORKLOADS": " ".join(flags[1:])}
    plan = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert plan.returncode == 0 and "2000-token prompts" in plan.stdout, plan.stdout + plan.stderr


def test_the_plan_of_a_trace_search_counts_its_probe_not_num_prompts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench/frontier_parallel.sh --plan on a trace: each probe is --search-trace-probe's arrivals (else the trace's
    whole window, its --num-prompts), capped by the window; before, the plan took NUM_PROMPTS (48) whatever the
    trace's probes were."""
    trace = tmp_path / "t.csv"
    trace.write_text(AZURE)
    flags = f"--workload trace --trace {trace} --trace-arrivals poisson --num-prompts 256"

    def plan(search_args: str) -> str:
        env = {**os.environ, "PYTHON": sys.executable, "KIND_GPUS": "2", "GROUP": "ours", "TRACE_WORKLOADS": flags,
               "SEARCH_ARGS": search_args}
        r = subprocess.run(["bash", "bench/frontier_parallel.sh", "--plan"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    assert "64 arrivals a probe" in plan("--search-max-probes 10 --search-trace-probe 64")
    assert "256 arrivals a probe" in plan("--search-max-probes 10")  # the whole window
