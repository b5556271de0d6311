"""bench/mlp_slices_ab.py's CPU parts: the --models items it accepts and refuses, and its table."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))

from mlp_slices_ab import parse_model, table  # noqa: E402


@pytest.mark.parametrize(("text", "want"), [
    ("preset:qwen3-8b", ("qwen3-8b", False, None)),
    ("preset:qwen3-8b:fp8", ("qwen3-8b", True, None)),
    ("preset:llama-3.1-70b:fp8:20", ("llama-3.1-70b", True, 20)),
    ("preset:llama-3.1-70b:20", ("llama-3.1-70b", False, 20)),
])
def test_model_items(text: str, want: tuple[str, bool, int | None]) -> None:
    assert parse_model(text) == want


@pytest.mark.parametrize(("text", "says"), [
    ("qwen3-8b", "preset:NAME"), ("preset:", "preset:NAME"), ("preset:x:int8", "'int8' is neither"),
    ("preset:x:0", "'0' is neither"), ("preset:x:-3", "'-3' is neither"),
])
def test_bad_model_items_are_named(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_model(text)


def test_table_says_the_saving_and_the_time_ratio() -> None:
    row = {"model": "preset:m", "shape": "1x8192", "chunk": 2048, "logits_rel_err": 1e-3, "argmax_agrees": False,
           "whole": {"peak_gib": 2.5, "ms": 100.0, "ms_min": 99.0, "ms_max": 101.0, "n": 14},
           "sliced": {"peak_gib": 1.25, "ms": 102.0, "ms_min": 101.0, "ms_max": 103.0, "n": 14}}
    lines = table([row])
    assert lines[-1] == ("| preset:m | 1x8192 | 2.500 | 1.250 | 1.250 | 100.00 [99.00, 101.00] | "
                         "102.00 [101.00, 103.00] | 1.020 | 1.00e-03 | DIFFERS |")


def test_write_json_makes_the_folder_and_returns_the_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from gpu_timing import write_json

    path = write_json(str(tmp_path / "new"), "mlp_slices_ab", {"rows": [1, 2]})
    assert path == str(tmp_path / "new" / "mlp_slices_ab.json")
    with open(path) as fh:
        assert json.load(fh) == {"rows": [1, 2]}


@pytest.mark.parametrize("flags", [["--chunk", "0"], ["--reps", "0"], ["--rounds", "0"], ["--models", "qwen3-8b"]])
def test_bad_flags_are_refused_before_any_gpu_work(flags: list[str]) -> None:
    import subprocess

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench", "mlp_slices_ab.py")
    got = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, timeout=120)
    assert got.returncode == 2
    assert "error:" in got.stderr and ("--chunk, --reps and --rounds" in got.stderr or "preset:NAME" in got.stderr)
