"""bench/fp8_sweep.py's decisions on CPU (the timing itself needs a GPU: bench/decode_profile.py --quantization fp8
--sweep): the candidate tiles of each (rows, shape), which measured option a (shape, batch) keeps, and the table it
writes (ops/fp8_tiles.py's format, merged into the packaged table of the GPU, loadable by the engine)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import fp8_sweep  # noqa: E402

from rapidserve.loader.presets import preset_config  # noqa: E402
from rapidserve.ops import fp8_tiles  # noqa: E402
from rapidserve.ops import triton_fp8_skinny as fsk  # noqa: E402
from rapidserve.ops.fp8_tiles import SCALED_MM, Fp8Table, Fp8Tiles  # noqa: E402

QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]


def test_the_projections_of_a_model() -> None:
    assert fp8_sweep.shapes_of(preset_config("qwen3-8b")) == QWEN3_8B


@pytest.mark.parametrize("rows", [1, 2, 16, 17, 24, 32, 33, 64])
@pytest.mark.parametrize(("n", "k"), [*QWEN3_8B, (200, 304)])
def test_candidates_fit_the_rows_and_the_gpu(rows: int, n: int, k: int) -> None:
    c = fp8_sweep.candidates(rows, n, k)
    assert c[0] == fsk.rule_tiles(rows, n, k)  # the untuned rule is always timed
    assert len(set(c)) == len(c)
    for t in c:
        assert t.block_m >= rows and t.block_m in (16, 32, 64), t
        assert t.smem_bytes() <= fp8_sweep.SMEM_LIMIT and t.block_n <= n, t
        assert not t.swap or t.block_n >= 64, t  # swapped: the weight tile is wgmma's 64-tall operand
        if t.split_k > 1:  # a thin grid cut along a long K: each slice at least two K steps, the grid bounded
            assert t.split_k in fp8_sweep.SPLITS and t.split_k in fp8_tiles.SPLITS_K, t
            assert k >= 2 * t.split_k * t.block_k and -(-n // t.block_n) * t.split_k <= 1024, t
            assert fsk.split_slices(k, t)[1] == t.split_k, t  # as many slices as asked
    splits = {(t.swap, t.block_m, t.split_k) for t in c if t.split_k > 1}
    if (n, k) in QWEN3_8B:
        assert 32 <= len(c) <= 45, len(c)  # the sweep's budget (--budget-s) covers about this many a point
        assert any(t.swap and t.block_m == fp8_sweep.block_m(rows) for t in c)
        assert any(not t.swap and t.block_m == 64 and t.block_n == 16 for t in c)
        assert {s for _, _, s in splits} == ({2, 4, 8} if n <= 6144 else {2, 4})  # gate|up: a wide grid already
        if n <= 6144:  # the thin grids: every family split
            assert (True, fp8_sweep.block_m(rows), 8) in splits  # the swapped order
            assert (False, 16 if rows <= 16 else 64, 2) in splits  # x8 @ w8^T: mma.sync / wgmma
    else:
        assert splits == set()  # 304 is too short a K to cut


def _row(current: Fp8Tiles | None, engine: float, scaled: float, swept: dict[Fp8Tiles, float | None]) -> dict:
    def timing(us: float | None) -> dict[str, Any]:
        return {"error": "OutOfResources"} if us is None else {"us_each": us, "tbps": 1.0}
    return {"shape": [6144, 4096], "current": current.label() if current else SCALED_MM,
            "current_tiles": list(current) if current else None, "engine": timing(engine),
            "scaled_mm": timing(scaled),
            "sweep": {t.label(): {"tiles": list(t), **timing(us)} for t, us in swept.items()}}


RULE = Fp8Tiles(16, 64, 512, 4, 4)
SWAP = Fp8Tiles(16, 64, 256, 4, 4, True)
WIDE = Fp8Tiles(64, 16, 256, 4, 3)
SPLIT = Fp8Tiles(16, 64, 256, 4, 3, True, 4)


@pytest.mark.parametrize(("row", "want"), [
    (_row(RULE, 16.0, 20.0, {RULE: 16.1, SWAP: 12.0}), SWAP),  # clearly faster: taken
    (_row(RULE, 16.0, 20.0, {RULE: 16.1, SWAP: 15.8}), RULE),  # within MARGIN: the current choice kept
    (_row(RULE, 16.0, 14.0, {RULE: 16.1, SWAP: 15.0}), SCALED_MM),  # cuBLASLt fastest
    (_row(None, 23.0, 23.0, {WIDE: 15.0, SWAP: None}), WIDE),  # 17-64 rows: off cuBLASLt; a failed candidate ignored
    (_row(None, 23.0, 23.1, {WIDE: 22.9}), SCALED_MM),  # not clearly faster than cuBLASLt: stays there
    (_row(SWAP, 12.0, 20.0, {RULE: 16.0}), SWAP),  # a packaged table's tiles (not a candidate) kept
    (_row(RULE, 16.0, 20.0, {RULE: 16.1, SWAP: 12.0, SPLIT: 9.0}), SPLIT),  # split-K fastest: taken, split_k with it
    (_row(SPLIT, 9.0, 20.0, {RULE: 16.0, SPLIT: 9.1}), SPLIT),  # a table's split-K tiles kept
])
def test_which_measured_option_a_point_keeps(row: dict, want: object) -> None:
    picked = fp8_sweep.choose(row)
    assert picked is not None and picked[0] == want, picked


def test_points_not_swept_choose_nothing() -> None:
    row = _row(RULE, 16.0, 20.0, {})
    assert fp8_sweep.choose(row) is None  # nothing ran
    assert fp8_sweep.choose({**row, "sweep": "not reached (--budget-s)"}) is None
    assert fp8_sweep.choose({k: v for k, v in row.items() if k != "sweep"}) is None


def test_the_sweep_writes_a_table_the_engine_loads(tmp_path: Path) -> None:
    lin = {1: {"qkv_proj": _row(RULE, 16.0, 20.0, {RULE: 16.1, SWAP: 12.0}),
               "o_proj": {**_row(RULE, 11.0, 12.0, {RULE: 11.0}), "shape": [4096, 4096]},
               "down_proj": {**_row(RULE, 18.0, 30.0, {RULE: 18.0, SPLIT: 14.0}), "shape": [4096, 12288]}},
           64: {"qkv_proj": _row(None, 23.0, 23.0, {WIDE: 15.0}),
                "o_proj": {**_row(None, 11.0, 12.0, {}), "sweep": "not reached (--budget-s)", "shape": [4096, 4096]}}}
    old = Fp8Table("GPU A", "older", MappingProxyType({(6144, 4096): ((1, RULE),), (100, 200): ((8, RULE),)}))
    notes = fp8_sweep.write_table(lin, "GPU A", "a test sweep", tmp_path / "out", tmp_path / "repo",
                                  MappingProxyType({"GPU A": old}))
    files = [tmp_path / d / fp8_tiles.file_name("GPU A") for d in ("out/fp8_configs", "repo")]
    assert files[0].read_text() == files[1].read_text()
    tables = fp8_tiles.load_tables(tmp_path / "repo")
    table = tables["GPU A"]
    assert table.source == "a test sweep"
    assert dict(table.shapes) == {(6144, 4096): ((1, SWAP), (64, WIDE)),  # swept: replaced
                                  (4096, 4096): ((1, RULE),),  # the current choice kept
                                  (4096, 12288): ((1, SPLIT),),  # split-K, its split_k in the file
                                  (100, 200): ((8, RULE),)}  # the packaged table's other shapes kept
    assert fsk.plan(1, 4096, 12288, "GPU A", tables) == SPLIT
    assert fsk.plan(40, 6144, 4096, "GPU A", tables) == WIDE  # rows 17-64 now on the kernel
    assert any("not swept" in n and "[4096, 4096] batch 64" in n for n in notes), notes
    assert notes[-1].startswith("fp8 table written: ")
    written = json.loads(files[0].read_text())["shapes"]
    assert written["6144x4096"]["64"]["BLOCK_M"] == 64 and "split_k" not in written["6144x4096"]["64"]
    assert written["4096x12288"]["1"]["split_k"] == 4
    assert fp8_sweep.write_table({1: {"o_proj": _row(RULE, 1.0, 1.0, {})}}, "GPU A", "x", tmp_path / "none",
                                 None)[-1] == "no fp8 table written: nothing was swept"


def test_the_markdown_names_every_layer_and_slice() -> None:
    lin = {1: {"qkv_proj": _row(RULE, 16.0, 20.0, {RULE: 16.1, SWAP: 12.0})}}
    prod = {1: {"add_rms_norm_fp8": {"rule": {"us_each": 2.5}, "whole row": {"us_each": 3.3}},
                "silu_and_mul_fp8": {"rule": {"us_each": 3.0}, "whole row": {"error": "x"}}}}
    text = "\n".join(fp8_sweep.markdown(lin, prod))
    assert "| qkv_proj | [6144, 4096] | 20.0 (1.00) | 16.0 (1.00) m16 64x512 w4 s4 | 12.0 (1.00) m16 64x256" in text
    assert "| silu_and_mul_fp8 | 3.00 | error |" in text


def test_the_sweep_runs_on_a_tiny_fp8_model_interpreted() -> None:
    """fp8_linears, producers, the table and the markdown end to end on a tiny fp8 model, the kernels under the Triton
    interpreter and a CPU clock standing in for the CUDA-graph one (check_dry_run)."""
    from triton_interp import run_interpreted

    out = run_interpreted(__file__, timeout=600)
    assert "fp8 sweep dry run: ok" in out


def check_dry_run() -> None:
    import dataclasses
    import math
    import time

    import torch

    from rapidserve.config_builder import build_engine_config
    from rapidserve.ops import fp8
    from rapidserve.quant_config import ONLINE_FP8
    from rapidserve.runner import ModelRunner

    def cpu_clock(calls: list) -> float:
        t0 = time.perf_counter()
        for f in calls:
            f()
        return (time.perf_counter() - t0) * 1e6 / len(calls)

    cfg, source = build_engine_config("preset:tiny-qwen3", device="cpu", dtype="float16", quantization="fp8",
                                      num_kv_blocks=16, enforce_eager=True)
    cfg = dataclasses.replace(cfg, quantization=ONLINE_FP8)
    model = ModelRunner(cfg, source, show_progress=False).model
    lin = {b: fp8_sweep.fp8_linears(model, b, True, math.inf, cpu_clock, torch.float16) for b in (1, 20)}
    for b, by_layer in lin.items():
        assert set(by_layer) == set(fp8_sweep.LAYERS)
        for name, row in by_layer.items():
            n, k = row["shape"]
            assert "us_each" in row["scaled_mm"] and "us_each" in row["engine"], (b, name, row)
            assert row["current"] == SCALED_MM  # grids this thin (N <= 256) stay on torch._scaled_mm
            assert [r["tiles"] for r in row["sweep"].values()] == [list(t) for t in fp8_sweep.candidates(b, n, k)]
            assert all("us_each" in r for r in row["sweep"].values()), row["sweep"]
    layer = model.layers[0].o_proj  # a candidate that is wrong, or cannot take the rows, is not timed
    rows = fp8_sweep._rows(20, layer.weight.shape[1], layer.weight.dtype, "cpu", torch.float16)
    want = fp8.reference_linear_rows(rows._replace(dtype=torch.float32), layer)
    tiles = fp8_sweep.candidates(20, *layer.weight.shape)[0]
    assert fp8_sweep._wrong(rows, layer, tiles, want) is None
    assert fp8_sweep._wrong(rows, layer, tiles, 2 * want)["error"].startswith("wrong result")  # type: ignore[index]
    small = fp8_sweep._wrong(rows, layer, tiles._replace(block_m=16), want)
    assert small == {"error": "ValueError: tiles m16 32x256 w4 s4 hold 16 rows; the call has 20"}, small
    late = fp8_sweep.fp8_linears(model, 1, True, -math.inf, cpu_clock, torch.float16)
    assert {r["sweep"] for r in late.values()} == {"not reached (--budget-s)"}
    prod = fp8_sweep.producers(model, 1, cpu_clock, torch.float16)
    assert all("us_each" in r for by in prod.values() for r in by.values()), prod
    table, notes = fp8_sweep.table_of(lin, "cpu", "dry run")
    assert table is not None and len(notes) == 8
    fp8_tiles.parse_table(json.loads(json.dumps(fp8_tiles.table_json(table))), "device_name=cpu.json")
    assert "## fused producers at batch 1" in "\n".join(fp8_sweep.markdown(lin, {1: prod}))


if __name__ == "__main__":
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("set TRITON_INTERPRET=1 before running the interpreter checks")
    check_dry_run()
    from triton_interp import exit_passed

    print("fp8 sweep dry run: ok")
    exit_passed()
