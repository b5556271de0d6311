"""W8A16 decode GEMMs (issue 39, ops/triton_w8a16.py, ops/w8a16_table.py), on CPU:

- the saturating cast to fp16 (`fp8.to_half`) at +-65504, and the reference (`fp8.reference_linear_half`);
- the bundles: the torch bundle never runs W8A16, `with_w8a16` binds a table into the Triton bundle's fields;
- under the Triton interpreter (a subprocess), the kernel against the reference: each tile family (16- and 32-row
  mma.sync tiles, swapped tiles), split-K, N and K tails, a bias, bf16 rows (cast in the kernel), fp16 rows and
  `fp8.HalfRows`, rows past 65504; the gated launch against silu_and_mul of the ungated one (`HalfRows` out, saturated);
  the RMSNorms and the decode attention that write `HalfRows` against the plain ones;
- compiled for sm_90 (no GPU), the W8A16 kernel widens only the weight tile (`cvt.rn.f16x2.e4m3x2` for BLOCK_N x
  BLOCK_K values a K step, W8A8's widens the rows too) on mma.sync f16, and on a swapped tile runs wgmma f16 with the
  widened weight as the register operand.
The table and the plan as tables of cases: tests/test_w8a16_table.py; the model's decode logits with W8A16 against
bf16 and W8A8: tests/test_w8a16_model.py; on the GPU: tests/test_w8a16_gpu.py.

Run as a script (``TRITON_INTERPRET=1 python tests/test_w8a16.py``) it performs the interpreter checks.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from typing import Any

import pytest
import torch
from triton_interp import interpreted_checks, run_checks, selected_by_test

from rapidserve.ops import fp8, torch_ops, torch_ops_bundle, with_w8a16
from rapidserve.ops.fp8_tiles import Fp8Tiles
from rapidserve.ops.w8a16_table import W8a16Device, W8a16Entry, forced

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
NV200 = W8a16Device(H200, True)
ON16 = {H200: W8a16Entry(16, "t")}  # (shared with tests/test_w8a16_table.py)


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


@pytest.mark.parametrize(("dtype", "half"), [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False),
                                             (None, False)])
def test_only_a_bf16_or_fp16_models_producers_write_fp16_rows(dtype: torch.dtype | None, half: bool) -> None:
    """`fused_fp8` says float16 (the producer writes `HalfRows`) only where W8A16's GEMM takes the rows: a float32
    model's producers quantize as before even where the bundle would run W8A16 at those rows (the GEMM would refuse
    fp16 rows of a float32 model and run W8A8 on rows already rounded to fp16: the review of 2026-12-01)."""
    import dataclasses

    from rapidserve.models.projections import HALF, fused_fp8

    layer = _layer(32, 32, seed=0)
    ops = dataclasses.replace(torch_ops_bundle(), w8a16=lambda rows, w: True)
    assert fused_fp8(ops, layer, 4, dtype) == (HALF if half else layer.weight.dtype)
    assert fused_fp8(ops, layer) == layer.weight.dtype  # rows not given: not asked


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
                "norms": "test_w8a16_norms_interpreter", "attention": "test_w8a16_attention_interpreter",
                "nan": "test_w8a16_keeps_nan_interpreter"}


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
@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_w8a16_keeps_nan_interpreter(interpreter: dict[str, str]) -> None:
    """A NaN stays NaN through every saturating cast to fp16 (check_nan)."""
    assert interpreter["nan"] == "", interpreter["nan"]


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


def check_nan() -> None:
    """A NaN stays NaN through each saturating cast to fp16, as `fp8.to_half` keeps it (a clamp by max/min drops a
    NaN to -65504 unless it propagates NaN, and a model gone NaN would then give finite logits on one path and NaN
    on another): the RMSNorm's fp16 rows (the whole row: its sum of squares is NaN), the kernel's cast of bf16 rows,
    the gated epilogue's fp16 rows. (The decode attention's reduce clamps the same way; no NaN reaches it here: the
    attention's running max drops a NaN score, so a NaN query gives finite output there, as in `decode_attention`.)"""
    from rapidserve.ops import triton_ops, triton_w8a16

    x = torch.randn(2, 256).to(torch.bfloat16)
    x[0, 5] = float("nan")
    w = torch.ones(256, dtype=torch.bfloat16)
    got = triton_w8a16.rms_norm_half(x, w, 1e-6).x
    want = fp8.half_rows(triton_ops.rms_norm(x, w, 1e-6)).x
    assert torch.equal(got.isnan(), want.isnan()) and bool(got[0].isnan().all()), got[0, :4]
    m, n, k, tiles = KERNEL_CASES[0]
    layer, gated = _layer(n, k, seed=30), _layer(2 * n, k, seed=31)
    rows = torch.randn(m, k).to(torch.bfloat16)
    rows[0, 3] = float("nan")
    out = triton_w8a16.w8a16_linear(rows, layer.weight, layer.weight_scale, config=tiles)
    assert bool(out[0].isnan().all()) and torch.equal(out.isnan(), fp8.reference_linear_half(rows, layer).isnan())
    g = triton_w8a16.w8a16_linear_silu_and_mul(rows, gated.weight, gated.weight_scale, config=tiles._replace(split_k=1))
    assert isinstance(g, fp8.HalfRows) and bool(g.x[0].isnan().all()), g.x[0, :4]


if __name__ == "__main__":
    sys.exit(run_checks({"kernel": check_kernel, "gated": check_gated, "norms": check_norms,
                         "attention": check_attention, "nan": check_nan}, sys.argv[1:]))
