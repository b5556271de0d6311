"""W8A16's decision (issue 39, ops/w8a16_table.py, `triton_w8a16.plan`) as tables of cases, on CPU: `w8a16_for_step`
(rows, device, table; never on ROCm or the CPU), the plan (the fp8 tile tables' entry, the untuned rule, tiles W8A16
cannot take, the shared memory its rows take, gated), `measured_entry`, the file's validation and round trip, the
packaged table EMPTY (the engine unchanged), and ROCm never asking. The kernels: tests/test_w8a16.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from test_w8a16 import H100, H200, NV200, ON16, _layer, needs_triton

from rapidserve.ops.fp8_tiles import SCALED_MM, Fp8Table, Fp8Tiles
from rapidserve.ops.w8a16_table import (
    EMPTY,
    TABLE_PATH,
    W8A16_TABLE,
    W8a16Device,
    W8a16Entry,
    W8a16Row,
    W8a16TableError,
    forced,
    load_table,
    measured_entry,
    w8a16_for_step,
    with_entry,
    write_table,
)


# ------------------------------------------------------------------------------------------------ the table
@pytest.mark.parametrize(("rows", "device", "table", "want"), [
    (1, NV200, ON16, True),
    (16, NV200, ON16, True),
    (17, NV200, ON16, False),  # past the entry's max_rows
    (1, NV200, EMPTY, False),  # the packaged table: no entry, never
    (1, W8a16Device(H100, True), ON16, False),  # a GPU without an entry: never (no default device)
    (1, W8a16Device(H200, False), ON16, False),  # ROCm (or the CPU) under an NVIDIA name: never
    (1, W8a16Device("AMD Instinct MI300X", False), {"AMD Instinct MI300X": W8a16Entry(64, "t")}, False),
    (1, W8a16Device("cpu", False), {"cpu": W8a16Entry(64, "t")}, False),
    (64, NV200, forced(H200), True),  # the bench variant's: every row count the kernel takes
    (1, NV200, {H200: W8a16Entry(0, "never")}, False),
])
def test_w8a16_for_step(rows: int, device: W8a16Device, table: dict[str, W8a16Entry], want: bool) -> None:
    assert w8a16_for_step(rows, device, table) is want


def test_w8a16_for_step_takes_a_step() -> None:
    with pytest.raises(ValueError, match="at least one row"):
        w8a16_for_step(0, NV200, ON16)


def test_the_packaged_table_runs_w8a8_everywhere() -> None:
    """The packaged entries are the GPUs' A/Bs (bench/decode_profile.py --write-w8a16-table): on the H200 (2026-12-01)
    W8A16 lost to W8A8 at every batch 1-64 (+8% to +34% a step), so its entry is 0 rows and the engine runs W8A8."""
    assert load_table(TABLE_PATH) == W8A16_TABLE and set(W8A16_TABLE) == {"NVIDIA H200"}
    assert all(e.max_rows == 0 and "decode_profile.py" in e.source for e in W8A16_TABLE.values())
    assert json.loads(TABLE_PATH.read_text())["NVIDIA H200"]["max_rows"] == 0


@pytest.mark.parametrize(("rows", "want"), [
    ([(1, 3.34, 3.00), (16, 4.79, 4.50), (64, 8.27, 8.60)], 16),  # wins at 1 and 16, loses at 64
    ([(64, 8.27, 8.60), (1, 3.34, 3.00)], 1),  # any order; 16 not measured: off there
    ([(1, 3.34, 3.32)], 0),  # within the margin: no win
    ([(1, 3.0, 2.5), (16, 4.0, 4.5), (32, 5.0, 4.0)], 1),  # a loss at 16 caps it below, whatever 32 says
    ([(1, 3.0, 2.5), (8, 3.5, 3.0), (64, 8.0, 7.0)], 64),
])
def test_measured_entry(rows: list[tuple[int, float, float]], want: int) -> None:
    assert measured_entry([W8a16Row(*r) for r in rows], "t") == W8a16Entry(want, "t")


def test_measured_entry_needs_each_batch_once() -> None:
    for rows in ([], [W8a16Row(1, 3.0, 2.0), W8a16Row(1, 3.0, 2.0)]):
        with pytest.raises(ValueError, match="each batch once"):
            measured_entry(rows, "t")


@pytest.mark.parametrize(("content", "field"), [
    ([], "the file"),
    ({"GPU": {"max_rows": 1}}, "GPU.source"),
    ({"GPU": {"max_rows": 65, "source": ""}}, "GPU.max_rows"),
    ({"GPU": {"max_rows": True, "source": ""}}, "GPU.max_rows"),
    ({"GPU": {"max_rows": 1, "source": "", "tiles": 1}}, "GPU.tiles"),
    ({" ": {"max_rows": 1, "source": ""}}, "' '"),
])
def test_a_bad_table_names_the_field(tmp_path: Path, content: object, field: str) -> None:
    path = tmp_path / "w8a16_table.json"
    path.write_text(json.dumps(content))
    with pytest.raises(W8a16TableError, match=re.escape(f"{path}: {field}")):
        load_table(path)


def test_the_table_file_round_trips(tmp_path: Path) -> None:
    table = with_entry(with_entry(EMPTY, H100, W8a16Entry(8, "a")), H200, W8a16Entry(16, "b"))
    assert write_table(tmp_path / "t.json", table) == table
    assert load_table(tmp_path / "missing.json") == {}
    with pytest.raises(ValueError, match="must not be empty"):
        with_entry(EMPTY, " ", W8a16Entry(1, "t"))


# ------------------------------------------------------------------------------------------------- the plan
QKV, OPROJ, GATE_UP = (6144, 4096), (4096, 4096), (24576, 4096)
M16_64 = Fp8Tiles(16, 64, 512, 4, 4, False)
SWAP = Fp8Tiles(16, 64, 128, 4, 4, True, 4)
M64 = Fp8Tiles(64, 32, 256, 4, 4, False)
SWAP64 = Fp8Tiles(64, 64, 128, 4, 6, True)
TABLES = {H200: Fp8Table(H200, "t", {QKV: ((1, M16_64), (64, SCALED_MM)),
                                     OPROJ: ((1, SWAP), (32, M64), (64, SWAP64)),
                                     GATE_UP: ((16, SWAP),)})}


@pytest.mark.parametrize(("rows", "shape", "device", "table", "gated", "want"), [
    (1, QKV, NV200, forced(H200), False, M16_64),  # the fp8 table's mma.sync tiles
    (1, OPROJ, NV200, forced(H200), False, SWAP),  # swapped tiles (wgmma with the register operand), split-K kept
    (2, OPROJ, NV200, forced(H200), False, None),  # the table's unswapped 64-row tile: W8A8 (a16_fits)
    (64, OPROJ, NV200, forced(H200), False, SWAP64),
    (64, QKV, NV200, forced(H200), False, None),  # the fp8 table says torch._scaled_mm: W8A8 there
    (1, GATE_UP, NV200, forced(H200), True, SWAP._replace(split_k=1)),  # gated: one pass over K
    (1, (24575, 4096), NV200, forced(H200), True, None),  # gated needs cat(gate, up): an even N
    (1, OPROJ, NV200, EMPTY, False, None),  # the packaged (empty) table: never
    (17, GATE_UP, NV200, ON16, False, None),  # past the W8A16 entry
    (1, OPROJ, W8a16Device(H200, False), forced(H200), False, None),  # ROCm: never
    (1, OPROJ, W8a16Device(H100, True), forced(H100), False, Fp8Tiles(16, 32, 512, 4, 4, False)),  # untuned rule
    (17, OPROJ, W8a16Device(H100, True), forced(H100), False, None),  # the rule's 17+ rows: torch._scaled_mm
    (65, OPROJ, NV200, forced(H200), False, None),  # past the kernel's rows
    # the untuned rule's gate|up tiles (16 x 64x512, 4 stages) take 4 x (32 + 128) x 512 bytes gated: 2 stages fit
    (1, GATE_UP, W8a16Device(H100, True), forced(H100), True, Fp8Tiles(16, 64, 512, 4, 2, False)),
    (1, GATE_UP, W8a16Device(H100, True), forced(H100), False, Fp8Tiles(16, 64, 512, 4, 4, False)),  # ungated fits
])
def test_plan(rows: int, shape: tuple[int, int], device: W8a16Device, table: dict[str, W8a16Entry], gated: bool,
              want: Fp8Tiles | None) -> None:
    pytest.importorskip("triton")
    from rapidserve.ops import triton_w8a16

    assert triton_w8a16.plan(rows, *shape, device, TABLES, table, gated) == want


@pytest.mark.parametrize(("tiles", "gated", "want"), [
    (Fp8Tiles(16, 64, 512, 4, 4, False), False, 4),  # 196608 bytes: fits
    (Fp8Tiles(16, 64, 512, 4, 4, False), True, 2),  # 327680, 245760 at 3: 163840 at 2
    (Fp8Tiles(64, 64, 256, 4, 8, True), False, 4),
    (Fp8Tiles(64, 256, 1024, 4, 3, True), True, None),  # over the limit even at 2 stages: W8A8
])
def test_fit_stages(tiles: Fp8Tiles, gated: bool, want: int | None) -> None:
    pytest.importorskip("triton")
    from rapidserve.ops.triton_w8a16 import SMEM_LIMIT, a16_smem_bytes, fit_stages

    got = fit_stages(tiles, gated)
    assert (got.num_stages if got is not None else None) == want
    if got is not None:
        assert a16_smem_bytes(got, gated) <= SMEM_LIMIT and got._replace(num_stages=tiles.num_stages) == tiles


@needs_triton
def test_cpu_tensors_are_never_routed() -> None:
    """W8A16 is for NVIDIA GPUs: a CPU weight under a table that would take it is not routed (`fp8_gpu`)."""
    from rapidserve.ops import fp8_gpu, triton_w8a16

    layer = _layer(64, 128, seed=0)
    x = torch.randn(1, 128).to(torch.bfloat16)
    assert not triton_w8a16.routed(x, layer.weight, layer.weight_scale, {"cpu": W8a16Entry(64, "t")})
    assert not fp8_gpu.w8a16_routed(1, layer, {"cpu": W8a16Entry(64, "t")})
    assert triton_w8a16.device_of(layer.weight) == W8a16Device("cpu", False)


@needs_triton
def test_rocm_never_asks_for_w8a16(monkeypatch: pytest.MonkeyPatch) -> None:
    """On ROCm (torch.version.hip set) the fp8 GEMMs are torch._scaled_mm: with a table forcing W8A16, neither the
    model's question (`w8a16_routed`) nor `gpu_linear` asks the W8A16 plan, and the plan says no for a non-NVIDIA
    device."""
    from rapidserve.ops import fp8_gpu, triton_w8a16

    def asked(*args: object, **kwargs: object) -> None:
        raise AssertionError("the W8A16 plan was asked on ROCm")

    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(triton_w8a16, "planned", asked)
    monkeypatch.setattr(triton_w8a16, "routed", asked)
    layer = _layer(64, 128, seed=3)
    x = torch.randn(2, 128).to(torch.bfloat16)
    table = forced("cpu")
    assert not fp8_gpu.w8a16_routed(2, layer, table)
    assert torch.equal(fp8_gpu.gpu_linear(x, layer, None, w8a16=table), fp8_gpu.gpu_linear(x, layer))
    assert triton_w8a16.plan(2, 64, 128, W8a16Device("AMD Instinct MI300X", False), {}, forced("AMD Instinct MI300X")) \
        is None


def test_a_table_of_zero_row_entries_asks_no_device() -> None:
    """`triton_w8a16.planned` answers None at once where no entry is above 0 rows (the packaged table), as for an
    empty one: every fp8 linear asks, and the device's name is not read for it."""
    from rapidserve.ops import triton_w8a16

    class NoDevice:  # any attribute read fails: the device must not be asked
        shape = (64, 64)

        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"asked the weight for {name}")

    zero = {"NVIDIA H200": W8a16Entry(0, "measured"), "NVIDIA H100 80GB HBM3": W8a16Entry(0, "measured")}
    for table in ({}, zero, None):
        assert triton_w8a16.planned(1, NoDevice(), table) is None  # type: ignore[arg-type]
