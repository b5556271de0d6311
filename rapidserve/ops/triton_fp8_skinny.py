"""Decode's fp8 linear layers (at most MAX_ROWS = 64 rows, per-row weight scales, per-token activations): the rows
quantized by `triton_fp8.quantize_tokens` (or already quantized by the op before, `skinny_fp8_linear_rows`), then one
Triton kernel that multiplies fp8 by fp8, reading each weight byte once (issue 39).

Why: a decode step at batch 1-64 is a read of every weight once, so fp8 weights should halve it. Through
`torch._scaled_mm` (cuBLASLt's row-wise fp8 GEMM) plus the quantizer the Qwen3-8B projections at one row took
13-35 us on the H200, no faster than bf16 (8-52 us); widening the fp8 weight to bf16 inside the bf16 skinny
kernel was slower still (the conversions bound it), and quantizing the rows inside each program (IEEE division
of 16 x K values in every one of ~200 programs) took 88-275 us: bench/results/fp8_linear_probe.md. At 64 rows
cuBLASLt's fp8 kernel read the weights at ~2.1 TB/s (bench/results/decode_profile_fp8/).

The math is `fp8.reference_linear`'s for "token" activations, up to the order of float32 sums:
    x8, sx = quantize_tokens(x)                     (quantize_input's numbers, bit for bit on the GPU)
    out[m, n] = (sum_k x8[m, k] w8[n, k]) * sx[m] * sw[n] (+ bias[n])
Program p computes output columns [p * BLOCK_N, (p + 1) * BLOCK_N) for all M rows (one row tile of BLOCK_M >= M,
rows past M masked), accumulating tl.dot in float32 over K in BLOCK_K steps, scaled in its epilogue. No split-K.
The tiles (`fp8_tiles.Fp8Tiles`) decide which tensor-core instruction Triton emits on Hopper (compiled for sm_90 on
a CPU, Triton 3.9): with BLOCK_M = 16 or 32 the product is x8 @ w8^T on mma.sync, which has no fp8 form there, so
both operands are widened to fp16 in registers every K step (cvt.rn.f16x2.e4m3x2); with BLOCK_M = 64, or with SWAP
(the product computed as w8 @ x8^T, the weight tile the tall operand, then transposed for the epilogue) and
BLOCK_N >= 64, at 4 or 8 warps, it is wgmma's native e4m3 x e4m3 from shared memory (a swapped tile narrower than 64
falls back to mma.sync). Both operands are K-major, as fp8 wgmma needs, and reach shared memory by 16-byte cp.async
in num_stages pipeline stages. Which family reads the weights fastest is measured, not assumed: the sweep times them.

Which call goes here, with which tiles, is `plan`, a pure function of (rows, N, K, device, tables): the tuned table
of this GPU (`fp8_tiles`, measured by bench/decode_profile.py --quantization fp8 --sweep) where it covers the call,
its entry either tiles or "scaled_mm"; else the untuned rule, the kernel as it was before the tables: at most
RULE_ROWS = 16 rows, tiles of the bf16 skinny kernel with K steps twice as long (`fp8_config`), on a grid of at least
MIN_PROGRAMS programs (a thin grid, a tensor-parallel shard or a small model, stays on `torch._scaled_mm`), and
17-64 rows on `torch._scaled_mm`. Graph-safe (no host reads of device values). NVIDIA only (`fp8_gpu.gpu_linear`
routes here when torch.version.hip is None): on ROCm the kernels are not measured, and its calls go to
`torch._scaled_mm`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops.fp8 import QuantizedRows
from rapidserve.ops.fp8_tiles import MAX_ROWS, SCALED_MM, Fp8Tables, Fp8Tiles, load_tables, lookup
from rapidserve.ops.triton_fp8 import quantize_tokens
from rapidserve.ops.triton_skinny import MIN_PROGRAMS, SkinnyConfig, skinny_config

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
RULE_ROWS = 16  # the untuned rule's rows: more go to torch._scaled_mm unless a table says otherwise
TUNED: Fp8Tables = load_tables()  # the packaged tables, validated once at import (read-only)


def fp8_config(n: int, k: int) -> SkinnyConfig:
    """The untuned rule's tiles for an [N, K] fp8 weight: the bf16 kernel's BLOCK_N with K steps twice as long (the
    same bytes a step), at most 1024."""
    cfg = skinny_config(n, k)
    return cfg._replace(block_k=min(1024, 2 * cfg.block_k))


def rule_tiles(rows: int, n: int, k: int) -> Fp8Tiles:
    """Untuned tiles for `rows` rows: `fp8_config` on a 16-row tile up to RULE_ROWS rows (what the rule routes here),
    above that a 64-row tile with 32 columns in K steps of 256 (wgmma; only for direct calls and tests: the rule
    sends these rows to torch._scaled_mm)."""
    if rows <= RULE_ROWS:
        cfg = fp8_config(n, k)
        return Fp8Tiles(16, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, False)
    return Fp8Tiles(64, 32, 256, 4, 4, False)


def plan(rows: int, n: int, k: int, device_name: str, tables: Fp8Tables) -> Fp8Tiles | None:
    """The tiles for `rows` rows of an [n, k] fp8 weight on `device_name`, or None for torch._scaled_mm (module
    docstring): the table's entry where one covers the call, else the untuned rule."""
    if not 0 < rows <= MAX_ROWS:
        return None
    entry = lookup(tables, device_name, n, k, rows) if tables else None
    if entry == SCALED_MM:
        return None
    if isinstance(entry, Fp8Tiles):
        return entry
    if rows > RULE_ROWS or -(-n // fp8_config(n, k).block_n) < MIN_PROGRAMS:
        return None
    return rule_tiles(rows, n, k)


def device_name(device: torch.device) -> str:
    """The name tables are keyed by: torch.cuda.get_device_name on a GPU (no device read), else the device type (the
    interpreter's "cpu", the compile check's "meta"), which no packaged table names."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _planned(rows: int, weight: torch.Tensor, tables: Fp8Tables | None) -> Fp8Tiles | None:
    tables = TUNED if tables is None else tables
    return plan(rows, *weight.shape, device_name(weight.device) if tables else "", tables)


@triton.jit
def _fp8_skinny_kernel(x8_ptr, sx_ptr, w_ptr, sw_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                       HAS_BIAS: tl.constexpr, EVEN: tl.constexpr, SWAP: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    x_rows = x8_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    # SWAP: acc^T [BLOCK_N, BLOCK_M] = w8 @ x8^T, the weight tile as wgmma's 64-tall operand
    acc_t = tl.zeros((BLOCK_N, BLOCK_M) if SWAP else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        x8 = tl.load(x_rows + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        if EVEN:  # N % BLOCK_N == 0 and K % BLOCK_K == 0: unmasked weight loads
            w = tl.load(w_rows + kk[None, :])
        else:
            w = tl.load(w_rows + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc_t = tl.dot(w, tl.trans(x8), acc_t) if SWAP else tl.dot(x8, tl.trans(w), acc_t)
    acc = tl.trans(acc_t) if SWAP else acc_t
    sx = tl.load(sx_ptr + rm, mask=rm < M, other=0.0)
    acc = acc * sx[:, None] * tl.load(sw_ptr + rn, mask=rn < N, other=0.0)[None, :]
    dt = out_ptr.dtype.element_ty
    if HAS_BIAS:  # as reference_linear: the product in the output dtype, then the bias added
        acc = acc.to(dt).to(tl.float32) + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(dt), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _fits(rows: int, cols: int, dense: bool, dtype: torch.dtype, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    return (0 < rows <= MAX_ROWS and dtype in (torch.bfloat16, torch.float16) and weight.dtype in FP8_DTYPES
            and dense and weight.is_contiguous() and cols == weight.shape[1] and scale.dtype == torch.float32
            and tuple(scale.shape) == (weight.shape[0],) and scale.is_contiguous())


def fp8_ok(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether `skinny_fp8_linear` may take this call: 1..MAX_ROWS rows of a 2-D bf16/fp16 x with a contiguous
    last dim, a contiguous fp8 weight [N, K] and float32 scales [N]."""
    return x.dim() == 2 and _fits(x.shape[0], x.shape[1], x.stride(-1) == 1, x.dtype, weight, scale)


def rows_ok(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """`fp8_ok` for rows already quantized (`skinny_fp8_linear_rows`): the same bounds on q [M, K] (of the weight's
    fp8 format, scale [M, 1] float32) and the rows' dtype."""
    q = rows.q
    return (q.dim() == 2 and q.dtype == weight.dtype and rows.scale.dtype == torch.float32
            and tuple(rows.scale.shape) == (q.shape[0], 1) and rows.scale.is_contiguous()
            and _fits(q.shape[0], q.shape[1], q.stride(-1) == 1, rows.dtype, weight, scale))


def routed(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, tables: Fp8Tables | None = None) -> bool:
    """Whether `fp8_gpu.gpu_linear` sends this call here: on a GPU, a call that `fp8_ok` and that `plan` gives tiles
    (`tables`: default the packaged ones)."""
    return x.is_cuda and fp8_ok(x, weight, scale) and _planned(x.shape[0], weight, tables) is not None


def routed_rows(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
                tables: Fp8Tables | None = None) -> bool:
    """`routed` for quantized rows (`fp8_gpu.gpu_linear_rows`): the same calls of the same rows go here."""
    return rows.q.is_cuda and rows_ok(rows, weight, scale) and _planned(rows.q.shape[0], weight, tables) is not None


def _launch(x8: torch.Tensor, sx: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            dtype: torch.dtype, config: Fp8Tiles | None) -> torch.Tensor:
    n, k = weight.shape
    m = x8.shape[0]
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias must be [{n}]; got {tuple(bias.shape)}")
    cfg = config or _planned(m, weight, None) or rule_tiles(m, n, k)
    if cfg.block_m < m:
        raise ValueError(f"tiles {cfg.label()} hold {cfg.block_m} rows; the call has {m}")
    out = torch.empty((m, n), dtype=dtype, device=x8.device)
    _fp8_skinny_kernel[(triton.cdiv(n, cfg.block_n),)](
        x8, sx, weight, scale, bias if bias is not None else scale, out, m, n, k, x8.stride(0),
        weight.stride(0), out.stride(0), HAS_BIAS=bias is not None, EVEN=n % cfg.block_n == 0 and k % cfg.block_k == 0,
        SWAP=cfg.swap, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def skinny_fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                      config: Fp8Tiles | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS) through an fp8 projection (weight [N, K], float32 scale [N]) -> [M, N] in x's
    dtype (module docstring), on `config`'s tiles (default: `plan`'s, else `rule_tiles`). ValueError for what it
    cannot take; callers check `fp8_ok` first."""
    n, k = weight.shape
    if not fp8_ok(x, weight, scale):
        raise ValueError(f"skinny_fp8_linear takes 1..{MAX_ROWS} rows of bf16/fp16 [M, {k}] with a contiguous last "
                         f"dim, a contiguous fp8 weight and float32 scales [{n}]; got x {tuple(x.shape)} {x.dtype}, "
                         f"weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)} {scale.dtype}")
    x8, sx = quantize_tokens(x, weight.dtype)
    return _launch(x8, sx, weight, scale, bias, x.dtype, config)


def skinny_fp8_linear_rows(rows: QuantizedRows, weight: torch.Tensor, scale: torch.Tensor,
                           bias: torch.Tensor | None = None, config: Fp8Tiles | None = None) -> torch.Tensor:
    """`skinny_fp8_linear` of the rows that `rows` quantize (the fused producers' output, triton_fp8_fused): the
    same kernel and tiles on the same x8 and scales, out in rows.dtype. ValueError unless `rows_ok`."""
    if not rows_ok(rows, weight, scale):
        n, k = weight.shape
        raise ValueError(f"skinny_fp8_linear_rows takes 1..{MAX_ROWS} rows q [M, {k}] of the weight's fp8 with "
                         f"scale [M, 1] float32 (of bf16/fp16 rows), a contiguous weight and float32 scales [{n}]; "
                         f"got q {tuple(rows.q.shape)} {rows.q.dtype}, scale {tuple(rows.scale.shape)}, rows of "
                         f"{rows.dtype}, weight {tuple(weight.shape)} {weight.dtype}, scale {tuple(scale.shape)}")
    return _launch(rows.q, rows.scale, weight, scale, bias, rows.dtype, config)


__all__ = ["RULE_ROWS", "TUNED", "device_name", "fp8_config", "fp8_ok", "plan", "routed", "routed_rows", "rows_ok",
           "rule_tiles", "skinny_fp8_linear", "skinny_fp8_linear_rows"]
