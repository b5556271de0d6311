"""bench/w8a16_ab.py, bench/decode_profile.py's W8A16 A/B (issue 39): the `w8a16` variant's bundle, the side-by-side
summary and the W8A16 table written from the two variants' step times (CPU; the timings are the GPU's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
from bench_module import load_bench

from rapidserve.ops import torch_ops_bundle
from rapidserve.ops.w8a16_table import W8a16Entry, W8a16Row, forced, load_table

ab = load_bench("w8a16_ab")
H200 = "NVIDIA H200"


def _rows() -> list[dict[str, Any]]:
    steps = {"fused": {1: 3.344, 16: 4.793, 64: 8.266}, "w8a16": {1: 2.95, 16: 4.60, 64: 8.50},
             "unfused": {1: 9.0, 16: 9.0, 64: 9.0}}
    return [{"batch": b, "variant": v, "replay_ms": ms, "launches": 400.0 if v == "fused" else 300.0}
            for v, by in steps.items() for b, ms in by.items()]


def test_the_two_variants_side_by_side() -> None:
    rows = _rows()
    assert ab.measured(rows) == [W8a16Row(1, 3.344, 2.95), W8a16Row(16, 4.793, 4.60), W8a16Row(64, 8.266, 8.50)]
    text = "\n".join(ab.summary(rows))
    assert "| 1 | 3.344 | 2.950 | -11.8% | 400 / 300 |" in text and "| 64 | 8.266 | 8.500 | +2.8% |" in text
    assert ab.measured([r for r in rows if r["variant"] != "w8a16"]) == []


def test_the_table_from_the_step_times(tmp_path: Path) -> None:
    """W8A16 on up to the largest batch where it wins at it and every smaller one (16 here: it loses at 64), written
    with the packaged table's other entries to <out> and the checkout's file (here a copy)."""
    packaged = {"GPU Z": W8a16Entry(8, "z")}
    notes = ab.write_table(_rows(), H200, "this run", tmp_path / "out", tmp_path / "repo.json", packaged)
    for path in (tmp_path / "out" / "w8a16_table.json", tmp_path / "repo.json"):
        assert load_table(path) == {H200: W8a16Entry(16, "this run"), "GPU Z": W8a16Entry(8, "z")}
    assert notes[0] == "batch 1: W8A16 -11.8% against W8A8", notes
    assert f"{H200}: W8A16 up to 16 rows (the engine's until now: 0)" in notes
    assert notes[-1].startswith("W8A16 table written: ") and "repo.json" in notes[-1]
    only_fused = [r for r in _rows() if r["variant"] == "fused"]
    assert ab.write_table(only_fused, H200, "x", tmp_path / "none", None, packaged) == [
        "no W8A16 table written: measure both the `fused` and the `w8a16` variants"]
    assert not (tmp_path / "none").exists()


def test_the_variant_forces_w8a16() -> None:
    ops = torch_ops_bundle()
    assert ab.variant_ops(ops, H200) is ops  # the torch bundle never runs W8A16
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from rapidserve.ops import triton_ops_bundle

    tri: Any = ab.variant_ops(triton_ops_bundle(skinny=True), H200)
    assert tri.name == "triton-w8a16" and tri.w8a16.keywords == {"w8a16": forced(H200)}
