"""bench/gemm_duty_cycle.py's CPU parts: its FLOP count, its table, and the flags it refuses."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")
sys.path.insert(0, BENCH)

from gemm_duty_cycle import step_flop, table  # noqa: E402


def test_a_step_is_the_qwen3_8b_linears_of_36_layers() -> None:
    per_token = 4096 * 6144 + 4096 * 4096 + 4096 * 24576 + 12288 * 4096
    assert step_flop(2048) == 2.0 * 2048 * per_token * 36
    assert step_flop(8192) == 4 * step_flop(2048)


def test_table_rows() -> None:
    rows = [{"tokens": 2048, "idle_ms": 0.0, "ms": 42.321, "ms_min": 41.7, "ms_max": 50.32, "tflops": 672.4,
             "clock_power": "1500 MHz, 687.68 W"}]
    lines = table(rows)
    assert lines[0].startswith("| tokens | idle before each (ms)")
    assert lines[2] == "| 2048 | 0 | 42.32 [41.70, 50.32] | 672 | 1500 MHz, 687.68 W |"


@pytest.mark.parametrize("flags", [["--reps", "0"], ["--tokens", "0"], ["--idle-ms", "-1"], ["--tokens", "a,b"]])
def test_bad_flags_are_refused_by_name(flags: list[str]) -> None:
    got = subprocess.run([sys.executable, os.path.join(BENCH, "gemm_duty_cycle.py"), *flags],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "--" in got.stderr and "error:" in got.stderr


def test_write_md_titles_the_table_with_the_run(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    from gpu_timing import write_md

    res = {"gpu": "NVIDIA H200", "date": "2026-12-02 13:33 UTC", "command": "python bench/gemm_duty_cycle.py"}
    path = write_md(str(tmp_path), "gemm_duty_cycle", "A step's GEMMs", res, ["| a |", "|---|"])
    want = "# A step's GEMMs, NVIDIA H200 (2026-12-02 13:33 UTC)\n\n`python bench/gemm_duty_cycle.py`\n\n| a |\n|---|\n"
    with open(path) as fh:
        assert fh.read() == want
    assert capsys.readouterr().out == want
