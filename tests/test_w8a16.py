"""W8A16 decode GEMMs (issue 39, ops/triton_w8a16.py, ops/w8a16_table.py), on CPU:

- the table and the decision as tables of cases: `w8a16_for_step` (rows, device, table; never on ROCm or the CPU),
  `triton_w8a16.plan` (the fp8 tile tables' entry, the untuned rule, tiles W8A16 cannot take, gated, ROCm),
  `measured_entry`, the file's validation and round trip, and the packaged table EMPTY (the engine unchanged);
- the saturating cast to fp16 (`fp8.to_half`) at +-65504, and the reference (`fp8.reference_linear_half`);
- the bundles: the torch bundle never runs W8A16, `with_w8a16` binds a table into the Triton bundle's fields;
- under the Triton interpreter (a subprocess), the kernel against the reference: each tile family (16- and 32-row
  mma.sync tiles, swapped tiles), split-K, N and K tails, a bias, bf16 rows (cast in the kernel), fp16 rows and
  `fp8.HalfRows`, rows past 65504; the gated launch against silu_and_mul of the ungated one (`HalfRows` out, saturated);
  the RMSNorms and the decode attention that write `HalfRows` against the plain ones;
- compiled for sm_90 (no GPU), the W8A16 kernel widens only the weight tile (`cvt.rn.f16x2.e4m3x2` for BLOCK_N x
  BLOCK_K values a K step, W8A8's widens the rows too) on mma.sync f16, and on a swapped tile runs wgmma f16 with the
  widened weight as the register operand.
The model's decode logits with W8A16 against bf16 and W8A8: tests/test_w8a16_model.py; on the GPU:
tests/test_w8a16_gpu.py.

Run as a script (``TRITON_INTERPRET=1 python tests/test_w8a16.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from triton_interp import interpreted_checks, run_checks, selected_by_test

from rapidserve.ops import fp8, torch_ops, torch_ops_bundle, with_w8a16
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

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
NV200 = W8a16Device(H200, True)
ON16 = {H200: W8a16Entry(16, "t")}


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


def test_the_packaged_table_is_empty() -> None:
    """Nothing of W8A16 has run on a GPU: the packaged file has no entry, so the engine runs W8A8 everywhere."""
    assert load_table(TABLE_PATH) == W8A16_TABLE == {} and json.loads(TABLE_PATH.read_text()) == {}


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


# ---------------------------------------------------------------------------------------------- the numbers
def test_to_half_saturates_at_the_fp16_max() -> None:
    x = torch.tensor([1e5, -1e5, 65504, 65520, -70000, float("inf"), -float("inf"), 1.5, 0.0]).to(torch.bfloat16)
    got = fp8.to_half(x)
    assert got.dtype == torch.float16 and torch.isfinite(got).all()
    assert got.tolist() == [65504, -65504, 65504, 65504, -65504, 65504, -65504, 1.5, 0.0]
    assert torch.isnan(fp8.to_half(torch.tensor([float("nan")]))).all()
    h = torch.randn(5, dtype=torch.float16)
    assert fp8.to_half(h) is h


def _layer(n: int, k: int, seed: int, dt: torch.dtype = torch.float8_e4m3fn) -> fp8.Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    layer = fp8.Fp8Linear(n, k, dt, "token", None, torch.device("cpu"))
    w8, s = fp8.quantize_weight(torch.randn(n, k, generator=g) / k**0.5, "channel", None, dt)
    layer.weight.copy_(w8)
    layer.weight_scale.copy_(s)
    return layer


def test_the_reference_is_closer_to_the_float_product_than_w8a8() -> None:
    """W8A16's reference on the fp8 weight against the float product of the same (dequantized) weight: no activation
    rounding to e4m3's 3 mantissa bits, so nearer than W8A8's (`reference_linear`) by far; a row past 65504
    saturates."""
    layer = _layer(96, 256, seed=1)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(8, 256, generator=g) * 4).to(torch.bfloat16)
    exact = x.float() @ layer.dequantized().T
    half = (fp8.reference_linear_half(x, layer).float() - exact).abs().max()
    w8a8 = (fp8.reference_linear(x, layer).float() - exact).abs().max()
    assert half * 4 < w8a8, (half, w8a8)
    big = torch.full((1, 256), 1e5).to(torch.bfloat16)
    assert torch.equal(fp8.reference_linear_half(big, layer), fp8.reference_linear_half(big.clamp(max=65504), layer))
    with pytest.raises(ValueError, match="per-row weight scales"):
        fp8.reference_linear_half(x, fp8.Fp8Linear(96, 256, torch.float8_e4m3fn, "group", (128, 128),
                                                   torch.device("cpu")))


# ---------------------------------------------------------------------------------------------- the bundles
def test_the_torch_bundle_never_runs_w8a16() -> None:
    ops = torch_ops_bundle()
    assert ops.w8a16 is torch_ops.no_w8a16 and not ops.w8a16(1, _layer(32, 32, seed=0))
    assert with_w8a16(ops, forced("cpu")) is ops  # nothing there reads a table


@needs_triton
def test_with_w8a16_binds_the_table_in_the_triton_bundle() -> None:
    from rapidserve.ops import fp8_gpu, fp8_ops, triton_ops_bundle, with_launch
    from rapidserve.ops.pdl_table import LaunchChoice

    ops = triton_ops_bundle(skinny=True)
    assert ops.w8a16 is fp8_gpu.w8a16_routed and ops.fp8_linear_silu_and_mul is fp8_gpu.gpu_linear_silu_and_mul
    table = forced(H200)
    bound = with_w8a16(ops, table)
    assert bound.name == "triton-w8a16"
    for name in ("fp8_linear", "w8a16", "fp8_linear_silu_and_mul", "fp8_linear_half"):
        fn: Any = getattr(bound, name)
        assert fn.keywords == {"w8a16": table}, name
    launched: Any = with_launch(bound, LaunchChoice(True, 64)).fp8_linear_silu_and_mul  # the table kept
    assert launched.keywords == {"pdl": True, "prefetch": 64} and launched.func.keywords == {"w8a16": table}
    ref = fp8_ops(dataclasses.replace(bound, fp8_linear=lambda x, layer, bias=None: x), "cpu")  # a GPU without fp8
    assert ref.w8a16 is torch_ops.no_w8a16 and ref.fp8_linear_silu_and_mul is torch_ops.fp8_linear_silu_and_mul
    assert ref.fp8_linear_half is fp8.reference_linear_half and ref.add_rms_norm_half is torch_ops.add_rms_norm_half


# ------------------------------------------------------------------------------------ sm_90 compile (no GPU)
def _ptx(tiles: Fp8Tiles, a16: bool, x_dtype: torch.dtype = torch.float16, gated: bool = False) -> str:
    """The PTX of the launch `tiles` make for a [16, 4096] x [4096, 4096] call (W8A16, or W8A8's rows launch),
    recorded on meta tensors as the sm_90 GPU would launch it and compiled for sm_90 (bench/amd_compile_check)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from bench.amd_compile_check import make_job
    from bench.amd_launches import TARGETS, jit_function, recording
    from rapidserve.ops import triton_fp8_skinny, triton_w8a16

    meta, n, k = torch.device("meta"), 4096, 4096
    w8 = torch.empty(2 * n if gated else n, k, dtype=torch.float8_e4m3fn, device=meta)
    sw = torch.empty(w8.shape[0], dtype=torch.float32, device=meta)
    sink: list[Any] = []
    tg = TARGETS["sm_90"]
    with recording(tg, sink, lambda: "w8a16"):
        if not a16:
            rows = fp8.QuantizedRows(torch.empty(16, k, dtype=torch.float8_e4m3fn, device=meta),
                                     torch.empty(16, 1, device=meta), torch.bfloat16)
            triton_fp8_skinny.skinny_fp8_linear_rows(rows, w8, sw, config=tiles)
        elif gated:
            triton_w8a16.w8a16_linear_silu_and_mul(torch.empty(16, k, dtype=x_dtype, device=meta), w8, sw,
                                                   config=tiles)
        else:
            triton_w8a16.w8a16_linear(torch.empty(16, k, dtype=x_dtype, device=meta), w8, sw, config=tiles)
    (launch,) = [launch for launch in sink if launch.kernel == "_fp8_skinny_kernel"]
    job = make_job(launch, tg, {})
    compiled = triton.compile(ASTSource(jit_function(job.kernel), job.signature, job.constexprs, job.attrs),
                              target=GPUTarget(tg.backend, tg.arch, tg.warp_size), options=job.options)
    return str(compiled.asm["ptx"])


def _cvts(ptx: str) -> int:
    return len(re.findall(r"cvt\.rn\.f16x2\.e4m3x2", ptx))


@needs_triton
@pytest.mark.parametrize("tiles", [Fp8Tiles(16, 64, 512, 4, 4, False), Fp8Tiles(32, 64, 128, 4, 4, False)])
def test_w8a16_widens_only_the_weight_on_mma_sync(tiles: Fp8Tiles) -> None:
    """An unswapped 16- or 32-row tile: mma.sync f16 in both forms; W8A8 widens its e4m3 rows and the weight, W8A16
    only the weight, BLOCK_N x BLOCK_K values a K step over the program's threads, two an instruction (the rows are
    fp16 already: no e4m3 conversion of them at all); bf16 rows are cast in registers, the weight's count the same."""
    threads = 32 * tiles.num_warps
    weight_cvts = tiles.block_n * tiles.block_k // threads // 2
    w8a8, w8a16 = _ptx(tiles, a16=False), _ptx(tiles, a16=True)
    for ptx in (w8a8, w8a16):
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx and "wgmma" not in ptx
    assert _cvts(w8a16) == weight_cvts, (_cvts(w8a16), weight_cvts)
    rows_cvts = tiles.block_m * tiles.block_k // 32 // 2  # every warp widens the whole row tile
    assert _cvts(w8a8) == weight_cvts + rows_cvts, (_cvts(w8a8), weight_cvts, rows_cvts)
    assert _cvts(_ptx(tiles, a16=True, x_dtype=torch.bfloat16)) == weight_cvts


@needs_triton
def test_w8a16_on_a_swapped_tile_is_wgmma_with_the_weight_in_registers() -> None:
    """SWAP with BLOCK_N 64: W8A8 runs e4m3 wgmma from shared memory and widens nothing; W8A16 runs wgmma f16 whose
    operand A (the widened weight) is registers ({%r...}) and B (the rows) a shared-memory descriptor; the gated launch
    (gate|up with SiLU-and-mul) widens two weight tiles."""
    tiles = Fp8Tiles(16, 64, 128, 4, 4, True)
    w8a8, w8a16 = _ptx(tiles, a16=False), _ptx(tiles, a16=True)
    assert "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3" in w8a8 and _cvts(w8a8) == 0
    (op,) = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n16k16\.f32\.f16\.f16 \{[^}]*\}, (\S)", w8a16))
    assert op == "{", "operand A of the f16 wgmma is not in registers"
    assert _cvts(w8a16) == 64 * 128 // 128 // 2
    assert _cvts(_ptx(tiles, a16=True, gated=True)) == 2 * 64 * 128 // 128 // 2


# --------------------------------------------------------------------------------------- the interpreter checks
INTERP_TESTS = {"kernel": "test_w8a16_kernel_interpreter", "gated": "test_w8a16_gated_interpreter",
                "norms": "test_w8a16_norms_interpreter", "attention": "test_w8a16_attention_interpreter"}


@pytest.fixture(scope="module")
def interpreter(request: pytest.FixtureRequest) -> dict[str, str]:
    """The module's interpreter checks, in one subprocess (tests/triton_interp.py)."""
    return interpreted_checks(__file__, selected_by_test(request, INTERP_TESTS), timeout=600)


@needs_triton
def test_w8a16_kernel_interpreter(interpreter: dict[str, str]) -> None:
    """W8A16 launches under TRITON_INTERPRET=1 against `fp8.reference_linear_half` (check_kernel)."""
    assert interpreter["kernel"] == "", interpreter["kernel"]


@needs_triton
def test_w8a16_gated_interpreter(interpreter: dict[str, str]) -> None:
    """The gated launch against silu_and_mul of the ungated one (check_gated)."""
    assert interpreter["gated"] == "", interpreter["gated"]


@needs_triton
def test_w8a16_attention_interpreter(interpreter: dict[str, str]) -> None:
    """The decode attention's output as W8A16's rows against `fp8.half_rows` of its float output (check_attention)."""
    assert interpreter["attention"] == "", interpreter["attention"]


@needs_triton
def test_w8a16_norms_interpreter(interpreter: dict[str, str]) -> None:
    """The RMSNorms that write W8A16's fp16 rows against the plain ones, saturated (check_norms)."""
    assert interpreter["norms"] == "", interpreter["norms"]


# (rows, N, K, tiles): a 16-row mma.sync tile, a swapped one with split-K (its reduce without sx), a 32-row tile with
# N and K tails and split-K, a swapped 64-row tile; small, for the interpreter
KERNEL_CASES = (
    (1, 64, 128, Fp8Tiles(16, 32, 32, 4, 2, False)),
    (3, 64, 160, Fp8Tiles(16, 64, 32, 4, 2, True, 4)),
    (20, 40, 200, Fp8Tiles(32, 32, 64, 4, 2, False, 2)),
    (40, 64, 96, Fp8Tiles(64, 64, 32, 4, 2, True)),
)


def _ulps(got: torch.Tensor, want: torch.Tensor, bias: torch.Tensor | None) -> float:
    """The largest |got - want| in units of the output dtype's relative spacing (eps) at the magnitude of the value
    rounded: want's, and with a bias the product's before it too (rounded to the output dtype first, as the reference
    does): at most 1 where the two differ only by one rounding of different float32 sums at each step."""
    eps = torch.finfo(got.dtype).eps
    scale = want.float().abs().clamp(min=1.0)
    if bias is not None:
        scale = scale + (want.float() - bias.float()).abs()
    return float(((got.float() - want.float()).abs() / (scale * eps)).max())


def check_kernel() -> None:
    """Each KERNEL_CASES launch (`w8a16_linear`) in fp16 rows and in bf16 rows (cast to fp16 in the kernel), one value
    past 65504 (saturated), with a bias on every other case: the reference's numbers up to the order of the float32
    sums (at most one unit of the output's last place)."""
    from rapidserve.ops import triton_w8a16

    g = torch.Generator().manual_seed(5)
    for i, (m, n, k, tiles) in enumerate(KERNEL_CASES):
        layer = _layer(n, k, seed=i)
        for dt in (torch.float16, torch.bfloat16):
            x = (torch.randn(m, k, generator=g) * 3).to(dt)
            x[0, 1] = 1e5 if dt == torch.bfloat16 else 65504
            bias = torch.randn(n, generator=g).to(dt) if i % 2 else None
            got = triton_w8a16.w8a16_linear(x, layer.weight, layer.weight_scale, bias, config=tiles)
            want = fp8.reference_linear_half(x, layer, bias)
            assert got.dtype == dt and got.shape == (m, n) and torch.isfinite(got).all(), (tiles.label(), dt)
            assert _ulps(got, want, bias) <= 1.0, (tiles.label(), dt, _ulps(got, want, bias))
            # the same rows as a producer's fp16 rows (`HalfRows`): no cast in the kernel, the same output
            half = triton_w8a16.w8a16_linear(fp8.half_rows(x), layer.weight, layer.weight_scale, bias, config=tiles)
            assert half.dtype == dt and torch.equal(half, got), (tiles.label(), dt)


def check_gated() -> None:
    """`w8a16_linear_silu_and_mul` equals silu_and_mul of `w8a16_linear`'s output on the same tiles without split-K
    (the same float32 sums, the same epilogue), bit for bit, in fp16 and bf16 rows: as `HalfRows` for a W8A16 down
    (that output saturated to fp16: `fp8.half_rows`), or in the rows' dtype; and from `HalfRows` too."""
    from rapidserve.ops import triton_ops, triton_w8a16

    g = torch.Generator().manual_seed(6)
    for i, (m, n, k, tiles) in enumerate(KERNEL_CASES):
        layer = _layer(2 * n, k, seed=10 + i)
        one_pass = tiles._replace(split_k=1)
        for dt in (torch.float16, torch.bfloat16):
            x = (torch.randn(m, k, generator=g) * 2).to(dt)
            x[0, :4] = 300.0  # a product past 65504 (the rows' own value, saturated in the fp16 rows)
            want = triton_ops.silu_and_mul(triton_w8a16.w8a16_linear(x, layer.weight, layer.weight_scale,
                                                                      config=one_pass))
            got = triton_w8a16.w8a16_linear_silu_and_mul(x, layer.weight, layer.weight_scale, config=tiles)
            assert isinstance(got, fp8.HalfRows) and got.dtype == dt and got.x.dtype == torch.float16
            assert torch.equal(got.x, fp8.to_half(want)), (tiles.label(), dt)
            plain = triton_w8a16.w8a16_linear_silu_and_mul(x, layer.weight, layer.weight_scale, config=tiles,
                                                           half_out=False)
            assert isinstance(plain, torch.Tensor) and torch.equal(plain, want), (tiles.label(), dt)
            rows = fp8.half_rows(x)  # the same numbers from fp16 rows: no cast in the kernel
            again = triton_w8a16.w8a16_linear_silu_and_mul(rows, layer.weight, layer.weight_scale, config=tiles)
            assert isinstance(again, fp8.HalfRows) and torch.equal(again.x, got.x), (tiles.label(), dt)


def check_norms() -> None:
    """`rms_norm_half` / `add_rms_norm_half` (the plain RMSNorm's launch writing fp16) equal `fp8.half_rows` of the
    plain launches bit for bit, a row past 65504 saturated, in bf16 and fp16; a weight of another dtype takes the
    plain launch."""
    from rapidserve.ops import triton_ops, triton_w8a16

    g = torch.Generator().manual_seed(8)
    for dt in (torch.bfloat16, torch.float16):
        for m, k in ((1, 256), (3, 200)):
            x = torch.randn(m, k, generator=g).to(dt)
            r = torch.randn(m, k, generator=g).to(dt)
            w = (1 + 0.1 * torch.randn(k, generator=g)).to(dt)
            w[:3] = 40000.0  # normed values of |h| > 1.64 pass 65504: saturated
            got = triton_w8a16.rms_norm_half(x, w, 1e-6)
            want = fp8.half_rows(triton_ops.rms_norm(x, w, 1e-6))
            assert got.dtype == dt and torch.equal(got.x, want.x), (dt, m)
            (rows, res), (plain, want_res) = (triton_w8a16.add_rms_norm_half(x, r, w, 1e-6),
                                              triton_ops.add_rms_norm(x, r, w, 1e-6))
            assert torch.equal(rows.x, fp8.to_half(plain)) and torch.equal(res, want_res), (dt, m)
            if dt == torch.bfloat16:  # saturated; an fp16 model's own overflow stays its inf (`fp8.to_half`)
                assert torch.isfinite(rows.x).all() and float(rows.x.float().abs().max()) == 65504
            promoted = triton_w8a16.rms_norm_half(x, w.float(), 1e-6)
            assert torch.equal(promoted.x, fp8.to_half(triton_ops.rms_norm(x, w.float(), 1e-6)))


def check_attention() -> None:
    """`decode_attention_fp8(out_fp8=float16)`: W8A16's rows of the decode output, `fp8.half_rows` of
    `decode_attention`'s output bit for bit: a bf16 output's written by the reduce kernel (2 and 5 splits, values past
    65504 saturated), an fp16 output's the output itself, one split of a bf16 output the float output (the projection
    casts it); the torch backend's the same numbers by definition."""
    from test_attention import decode_seqs, make_batch

    from rapidserve.attention import torch_ref
    from rapidserve.attention import triton_paged_decode as tp
    from rapidserve.ops import torch_kv

    for dt in (torch.bfloat16, torch.float16):
        b = make_batch(decode_seqs([40, 1, 17]), num_kv_heads=2, group=2, head_dim=32, block_size=16, dtype=dt,
                       decode=True, seed=12)
        b.v_new[:, :, :4] = 3e5 if dt == torch.bfloat16 else 6e4  # outputs past fp16's max (bf16)
        torch_kv.write_kv(b.k_new, b.v_new, b.k_cache, b.v_cache, b.meta.slot_mapping)
        args = (b.q, b.k_cache, b.v_cache, b.meta.block_tables, b.meta.context_lens, 32**-0.5)
        for n in (1, 2, 5):
            out = tp.decode_attention(*args, num_splits=n)
            flat = out.view(out.shape[0], -1)
            got = tp.decode_attention_fp8(*args, out_fp8=torch.float16, num_splits=n)
            if dt == torch.bfloat16 and n == 1:
                assert isinstance(got, torch.Tensor) and torch.equal(got, flat), (dt, n)
                continue
            assert isinstance(got, fp8.HalfRows) and got.dtype == dt, (dt, n)
            assert torch.equal(got.x, fp8.to_half(flat)), (dt, n)
            if dt == torch.bfloat16:
                assert float(got.x.float().abs().max()) == 65504, (dt, n)
        ref = torch_ref.decode_attention_fp8(*args, out_fp8=torch.float16)
        want = torch_ref.decode_attention(*args)
        assert isinstance(ref, fp8.HalfRows) and torch.equal(ref.x, fp8.to_half(want.reshape(want.shape[0], -1)))


if __name__ == "__main__":
    sys.exit(run_checks({"kernel": check_kernel, "gated": check_gated, "norms": check_norms,
                         "attention": check_attention}, sys.argv[1:]))
