"""Decode's skinny fp8 GEMM, its decisions on CPU (issue 39): the tuned tables (ops/fp8_tiles.py: format, validation
naming the file and field, lookup by rows), which calls `triton_fp8_skinny.plan` sends to the kernel and with which
tiles (a table's entry, the untuned rule, or torch._scaled_mm), and how many slices the fused producers cut a row into
(`triton_fp8_fused.slice_cols`). The kernels' numbers: test_fp8_ops.py / test_fp8_fused.py (interpreter),
test_fp8_gpu.py / test_fp8_fused_gpu.py (GPU)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import MappingProxyType

import pytest

from rapidserve.ops import fp8_tiles
from rapidserve.ops.fp8_tiles import SCALED_MM, Fp8Table, Fp8TableError, Fp8Tiles

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

T1 = Fp8Tiles(16, 64, 256, 4, 4, True)
T16 = Fp8Tiles(16, 32, 512, 4, 3, False)
T32 = Fp8Tiles(32, 64, 256, 4, 4, True)
T1_SPLIT = Fp8Tiles(16, 64, 256, 4, 3, True, 4)  # split-K: four K slices, then the reduce kernel
T64_SPLIT = Fp8Tiles(64, 32, 256, 4, 3, False, 8)
TABLES = MappingProxyType({"GPU A": Fp8Table("GPU A", "test", MappingProxyType({
    (6144, 4096): ((1, T1), (16, T16), (64, SCALED_MM)),
    (4096, 12288): ((32, T32),),
    (4096, 4096): ((1, T1_SPLIT), (64, T64_SPLIT)),
}))})


def _file(tmp_path: Path, d: object, name: str = "device_name=GPU_A.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(d))
    return path


def _good() -> dict[str, object]:
    return fp8_tiles.table_json(TABLES["GPU A"])


def test_a_table_round_trips_and_the_packaged_tables_load(tmp_path: Path) -> None:
    table = fp8_tiles.load_table(_file(tmp_path, _good()))
    assert table == TABLES["GPU A"]
    d = _good()
    assert d["shapes"]["6144x4096"]["64"] == "scaled_mm"  # type: ignore[index]
    assert d["shapes"]["6144x4096"]["1"] == {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256,  # type: ignore[index]
                                             "num_warps": 4, "num_stages": 4, "SWAP": True}  # no split_k: 1
    assert d["shapes"]["4096x4096"]["1"]["split_k"] == 4  # type: ignore[index]
    assert fp8_tiles.load_tables(tmp_path) == {"GPU A": table}
    assert fp8_tiles.load_tables(tmp_path / "none") == {}
    for t in fp8_tiles.load_tables().values():  # whatever is committed parses, and names its own device
        assert (fp8_tiles.CONFIG_DIR / fp8_tiles.file_name(t.device_name)).is_file()


@pytest.mark.parametrize(("device", "n", "k", "rows", "want"), [
    ("GPU A", 6144, 4096, 1, T1),
    ("GPU A", 6144, 4096, 2, T16),  # the smallest key >= rows
    ("GPU A", 6144, 4096, 16, T16),
    ("GPU A", 6144, 4096, 17, SCALED_MM),
    ("GPU A", 6144, 4096, 64, SCALED_MM),
    ("GPU A", 4096, 12288, 8, T32),
    ("GPU A", 4096, 12288, 32, T32),
    ("GPU A", 4096, 12288, 33, None),  # past the largest key: not covered
    ("GPU A", 4096, 4096, 1, T1_SPLIT),  # split-K entries
    ("GPU A", 4096, 4096, 2, T64_SPLIT),
    ("GPU A", 4096, 4096, 65, None),
    ("GPU A", 2048, 4096, 1, None),  # a shape without a table
    ("GPU B", 6144, 4096, 1, None),  # a device without a file
])
def test_lookup(device: str, n: int, k: int, rows: int, want: object) -> None:
    assert fp8_tiles.lookup(TABLES, device, n, k, rows) == want


def _set(d: dict, path: str, value: object) -> dict:
    *head, last = path.split("/")
    node = d
    for p in head:
        node = node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return d


@pytest.mark.parametrize(("path", "value", "match"), [
    ("shapes/6144x4096/1/BLOCK_M", 48, r"shapes\.6144x4096\.1\.BLOCK_M: must be one of \[16, 32, 64\], got 48"),
    ("shapes/6144x4096/1/BLOCK_K", 96, r"\.1\.BLOCK_K: must be one of"),
    ("shapes/6144x4096/1/num_stages", 0, r"\.1\.num_stages: must be one of"),
    ("shapes/6144x4096/1/SWAP", 1, r"\.1\.SWAP: must be true or false, got 1"),
    ("shapes/6144x4096/1/GROUP_M", 8, r"\.1\.GROUP_M: unknown field"),
    ("shapes/6144x4096/1/num_warps", KeyError, r"\.1\.num_warps: missing"),
    ("shapes/6144x4096/1/split_k", 2, None),  # optional: 1 where left out
    ("shapes/4096x4096/1/split_k", KeyError, None),
    ("shapes/4096x4096/1/split_k", 5, r"shapes\.4096x4096\.1\.split_k: must be one of \[1, 2, 3, 4, 6, 8, 12, 16\], "
                                      r"got 5"),
    ("shapes/4096x4096/1/split_k", 0, r"\.1\.split_k: must be one of"),
    ("shapes/4096x4096/1/split_k", True, r"\.1\.split_k: must be one of .*, got True"),
    ("shapes/4096x4096/1/split_k", "4", r"\.1\.split_k: must be one of .*, got '4'"),
    ("shapes/4096x4096/1/splitk", 4, r"\.1\.splitk: unknown field \"splitk\" in the object at `shapes\.4096x4096\.1` "
                                     r"\(allowed: BLOCK_M, .*, SWAP, split_k\); did you mean \"split_k\"\?"),
    ("shapes/6144x4096/16/BLOCK_M", 16, None),  # 16 rows in a 16-row tile: fine
    ("shapes/4096x12288/32/BLOCK_M", 16, r"shapes\.4096x12288\.32\.BLOCK_M: must hold the key's 32 rows, got 16"),
    ("shapes/6144x4096/65", "scaled_mm", r"shapes\.6144x4096\.65: the key must be a row count in 1\.\.64"),
    ("shapes/6144x4096/0", "scaled_mm", r"the key must be a row count"),
    ("shapes/6144x4096/8", "cublas", r"shapes\.6144x4096\.8: must be tiles or 'scaled_mm', got 'cublas'"),
    ("shapes/6144x4096/8", [16], r"shapes\.6144x4096\.8: must be a JSON object, got list"),
    ("shapes/6144x", {"1": "scaled_mm"}, r"shapes\.6144x: the key must be the weight's 'NxK'"),
    ("shapes/64x64", {}, r"shapes\.64x64: must be a non-empty object"),
    ("shapes", {}, r"shapes: must be a non-empty object"),
    ("source", 3, r"source: must be a string"),
    ("device_name", "", r"device_name: must be a non-empty string"),
    ("device_name", "GPU B", r"the file name: must be 'device_name=GPU_B\.json'"),
    ("E", 8, r"E: unknown field"),
])
def test_bad_tables_are_refused_by_file_and_field(tmp_path: Path, path: str, value: object,
                                                  match: str | None) -> None:
    f = _file(tmp_path, _set(_good(), path, value))
    if match is None:
        fp8_tiles.load_table(f)
        return
    with pytest.raises(Fp8TableError, match=match) as e:
        fp8_tiles.load_table(f)
    assert str(e.value).startswith(str(f))


def test_a_file_that_is_not_json(tmp_path: Path) -> None:
    f = tmp_path / "device_name=GPU_A.json"
    f.write_text("{")
    with pytest.raises(Fp8TableError, match="the file: is not JSON"):
        fp8_tiles.load_tables(tmp_path)


def test_tiles_shared_memory() -> None:
    assert Fp8Tiles(16, 64, 512, 4, 4).smem_bytes() == 4 * 80 * 512
    assert Fp8Tiles(64, 32, 256, 4, 3, True).label() == "m64 32x256 w4 s3 swap"
    assert Fp8Tiles(64, 32, 256, 4, 3, True, 4).label() == "m64 32x256 w4 s3 swap split4"
    assert Fp8Tiles(16, 64, 512, 4, 4).split_k == 1  # the default: one program a column tile


def test_split_k_left_out_reads_as_one(tmp_path: Path) -> None:
    """A file written before split-K (no split_k anywhere) loads as it did: every entry one pass over K."""
    d = _good()
    for by_rows in d["shapes"].values():  # type: ignore[union-attr]
        for entry in by_rows.values():
            if isinstance(entry, dict):
                entry.pop("split_k", None)
    table = fp8_tiles.load_table(_file(tmp_path, d))
    assert {e.split_k for entries in table.shapes.values() for _, e in entries if isinstance(e, Fp8Tiles)} == {1}


@needs_triton
@pytest.mark.parametrize(("rows", "n", "k", "device", "want"), [
    (1, 6144, 4096, "GPU A", T1),  # a table's tiles
    (2, 6144, 4096, "GPU A", T16),
    (17, 6144, 4096, "GPU A", None),  # the table says torch._scaled_mm
    (64, 6144, 4096, "GPU A", None),
    (20, 4096, 12288, "GPU A", T32),  # 17-64 rows where a table says so
    (33, 4096, 12288, "GPU A", None),  # past the table's rows: the rule, which keeps 17+ rows on torch._scaled_mm
    (1, 2048, 6144, "GPU A", None),  # no table for the shape: the rule, here a thin grid (torch._scaled_mm)
    (1, 4096, 4096, "GPU B", Fp8Tiles(16, 32, 512, 4, 4)),  # no table for the device: the rule (fp8_config's tiles)
    (1, 4096, 4096, "GPU A", T1_SPLIT),  # a table's split-K tiles, as they are
    (16, 4096, 4096, "GPU A", T64_SPLIT),
    (64, 4096, 4096, "GPU A", T64_SPLIT),
    (16, 6144, 4096, "GPU B", Fp8Tiles(16, 64, 512, 4, 4)),  # no table for the device: the rule
    (16, 4096, 12288, "GPU B", Fp8Tiles(16, 32, 1024, 4, 4)),  # long K: longer steps
    (17, 6144, 4096, "GPU B", None),
    (1, 2048, 4096, "GPU B", None),  # a thin grid (64 programs < MIN_PROGRAMS): torch._scaled_mm
    (0, 6144, 4096, "GPU A", None),
    (65, 6144, 4096, "GPU A", None),  # past the kernel's 64 rows
])
def test_which_calls_the_skinny_kernel_takes(rows: int, n: int, k: int, device: str, want: Fp8Tiles | None) -> None:
    from rapidserve.ops import triton_fp8_skinny as fsk

    assert fsk.plan(rows, n, k, device, TABLES) == want
    if device == "GPU B":  # no table at all: the same
        assert fsk.plan(rows, n, k, device, {}) == want


@needs_triton
@pytest.mark.parametrize(("rows", "cols", "min_slice", "want"), [
    (1, 12288, 1024, 1024),  # SiLU-and-mul of Qwen3-8B at one row: 12 programs
    (16, 12288, 1024, 2048),  # 8 pieces a row at most (128 // 16): 6 of 2048
    (64, 12288, 1024, 8192),  # 2 pieces a row: 8192 + 4096
    (128, 12288, 1024, 12288),  # the rows alone fill the GPU: one program a row
    (1, 4096, 1024, 1024),  # RMSNorm at one row: 4 slices
    (40, 4096, 1024, 2048),  # 3 pieces allowed: 2 of 2048
    (64, 4096, 1024, 2048),
    (3, 96, 1024, 96),  # narrower than one slice: whole rows
    (1, 1500, 1024, 1500),
    (1, 3000, 1024, 2048),  # 2 pieces: 2048 + 952
])
def test_slices_of_a_row(rows: int, cols: int, min_slice: int, want: int) -> None:
    from rapidserve.ops.triton_fp8_fused import TARGET_PROGRAMS, slice_cols

    assert TARGET_PROGRAMS == 128
    assert slice_cols(rows, cols, min_slice) == want
