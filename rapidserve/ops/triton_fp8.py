"""The fp8 GEMM with block scales (DeepSeek-V3 / Qwen3-FP8 style: 128x128 weight blocks, activations per token
and 128 input columns) as one Triton kernel, for NVIDIA sm_89+ (float8e4nv) and AMD gfx94x (float8e4b8, e4m3fnuz).

    out[m, n] = sum over K blocks kb of (sum_{k in kb} x8[m, k] w8[n, k]) * sx[m, kb] * sw[n // bn, kb]

x8 [M, K] and sx [M, ceil(K / bk)] come from `fp8.quantize_input(..., "group", group=bk)`, w8 [N, K] and sw
[ceil(N / bn), ceil(K / bk)] from the checkpoint. Program (i, j) computes the [BLOCK_M, BLOCK_N] tile of out at
rows i * BLOCK_M, columns j * BLOCK_N, looping over K in BLOCK_K steps (BLOCK_K divides bk, so a step lies in one
scale column): each step's fp8 tile product is accumulated by tl.dot in float32 and scaled before it is added,
so the sum runs over exactly the products the definition has (fp8.reference_linear, the same up to the order of
float32 sums). Each output column n reads its own weight scale row n // bn, so BLOCK_N need not divide bn; rows
and columns past M, N and K are masked (partial blocks at the edges). Graph-safe: no host reads of device values.

Tile sizes are a first choice, not measured yet (issue 39's GPU part): 128-wide N and K steps, BLOCK_M by the row
count; on ROCm 64-long K steps and at most 64 rows, which keep the tiles within half a CU's 64 KiB of LDS
(two workgroups a CU).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops.fp8 import HALF_MAX as _HALF_MAX
from rapidserve.ops.fp8 import MIN_AMAX, fp8_max


class BlockConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def block_config(m: int, bk: int, hip: bool) -> BlockConfig:
    """Tile sizes for M rows and weight blocks bk columns wide (module docstring)."""
    block_k = min(bk, 64 if hip else 128)
    while bk % block_k:
        block_k //= 2
    top = 64 if hip else 128
    block_m = min(top, max(16, triton.next_power_of_2(m)))
    return BlockConfig(block_m, 128 if not hip else 64, max(block_k, 16), 4 if block_m <= 64 else 8,
                       2 if hip else 3)


@triton.jit
def _fp8_block_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_xsm, stride_wn,
                      stride_wsn, stride_om, BN_SCALE: tl.constexpr, BK_SCALE: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[m, n] for this program's tile: sum over K steps of dot(x8 tile, w8 tile^T) * sx[m, kb] * sw[n // bn, kb]
    (kb = the step's scale column)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + rn[None, :].to(tl.int64) * stride_wn  # the weight [N, K] read as its transpose [K, N]
    xs_rows = xs_ptr + rm.to(tl.int64) * stride_xsm
    ws_rows = ws_ptr + (rn // BN_SCALE).to(tl.int64) * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        kb = k0 // BK_SCALE
        sx = tl.load(xs_rows + kb, mask=m_ok, other=0.0)
        sw = tl.load(ws_rows + kb, mask=n_ok, other=0.0)
        acc += tl.dot(x, w) * sx[:, None] * sw[None, :]
    out = out_ptr + rm[:, None].to(tl.int64) * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def block_linear(x8: torch.Tensor, sx: torch.Tensor, w8: torch.Tensor, sw: torch.Tensor, block: tuple[int, int],
                 out_dtype: torch.dtype, config: BlockConfig | None = None) -> torch.Tensor:
    """x8 [M, K] (fp8, per-token-group scales sx [M, ceil(K / bk)]) @ w8 [N, K].T (block scales sw
    [ceil(N / bn), ceil(K / bk)]) -> [M, N] in `out_dtype` (module docstring). ValueError naming the mismatch for
    shapes or dtypes that do not fit."""
    m, k = x8.shape
    n = w8.shape[0]
    bn, bk = block
    want_sx, want_sw = (m, -(-k // bk)), (-(-n // bn), -(-k // bk))
    if w8.shape[1] != k or tuple(sx.shape) != want_sx or tuple(sw.shape) != want_sw:
        raise ValueError(f"block_linear: x8 {tuple(x8.shape)}, sx {tuple(sx.shape)} (want {want_sx}), w8 "
                         f"{tuple(w8.shape)}, sw {tuple(sw.shape)} (want {want_sw}) for blocks {block}")
    if x8.dtype != w8.dtype or sx.dtype != torch.float32 or sw.dtype != torch.float32:
        raise ValueError(f"block_linear takes x8 and w8 of one fp8 dtype and float32 scales; got {x8.dtype}, "
                         f"{w8.dtype}, {sx.dtype}, {sw.dtype}")
    out = torch.empty((m, n), dtype=out_dtype, device=x8.device)
    if m == 0:
        return out
    x8, w8, sx, sw = x8.contiguous(), w8.contiguous(), sx.contiguous(), sw.contiguous()
    cfg = config or block_config(m, bk, torch.version.hip is not None)
    if bk % cfg.block_k:
        raise ValueError(f"block_linear: BLOCK_K {cfg.block_k} must divide the scale blocks' {bk} columns")
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))
    _fp8_block_kernel[grid](x8, sx, w8, sw, out, m, n, k, x8.stride(0), sx.stride(0), w8.stride(0), sw.stride(0),
                            out.stride(0), BN_SCALE=bn, BK_SCALE=bk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                            BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


@triton.jit
def _quantize_tokens_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, TOP: tl.constexpr, RCP: tl.constexpr,
                            MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """Row `program_id`: amax over the row (first pass), then q = fp8(clamp(x / s, +-TOP)) with
    s = max(amax, MIN_AMAX) * RCP, RCP = 1 / TOP (second pass, the row's re-read mostly from L2), and s stored.
    USE_GDC (`ops.pdl`): waits for the kernel before, then lets the next one start."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = token_scale(amax, RCP, MIN_AMAX)
    q_row = q_ptr + row * stride_qm
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        tl.store(q_row + k0 + offs, to_fp8(x, scale, TOP, q_ptr.dtype.element_ty), mask=k0 + offs < K)
    tl.store(s_ptr + row, scale)


@triton.jit
def token_scale(amax, RCP: tl.constexpr, MIN_AMAX: tl.constexpr):
    """A row's scale from `amax`, [BLOCK] running maxima of |x| (0 where masked): max(amax, MIN_AMAX) * RCP in
    float32, `quantize_input`'s product (also the fused producers' of triton_fp8_fused)."""
    return tl.maximum(tl.max(amax, 0), MIN_AMAX) * RCP


@triton.jit
def to_fp8(x, scale, TOP: tl.constexpr, fp8: tl.constexpr):
    """fp8(clamp(x / scale, -TOP, TOP)) of float32 x: IEEE division, as torch (also the fused producers')."""
    return tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -TOP), TOP).to(fp8)


HALF_MAX = tl.constexpr(_HALF_MAX)  # `to_half`'s bound (fp8.HALF_MAX, float16's largest finite value)


@triton.jit
def to_half(x):
    """float16(clamp(x, -65504, 65504)) of float32 x: W8A16's saturating cast (`fp8.to_half`: as e4m3's at 448), a NaN
    kept NaN (max and min that propagate it; their default drops a NaN to the bound)."""
    return tl.minimum(tl.maximum(x, -HALF_MAX, propagate_nan=tl.PropagateNan.ALL), HALF_MAX,
                      propagate_nan=tl.PropagateNan.ALL).to(tl.float16)


def token_constants(fp8: torch.dtype) -> dict[str, float]:
    """The per-token quantizer's constexprs for `fp8` (TOP = fp8_max, RCP = 1 / TOP, MIN_AMAX), which every kernel
    that quantizes rows as `quantize_tokens` does takes."""
    return {"TOP": fp8_max(fp8), "RCP": 1.0 / fp8_max(fp8), "MIN_AMAX": MIN_AMAX}


def quantize_tokens(x: torch.Tensor, fp8: torch.dtype, pdl: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fp8.quantize_input(x, "token", fp8)` as one kernel: (x8 [M, K] fp8, scale [M, 1] float32). The same
    numbers: IEEE division and the hardware's round-to-nearest-even cast (the interpreter's cast rounds otherwise).
    `pdl`: programmatic dependent launch (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"quantize_tokens takes a 2-D x with a contiguous last dim; got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    block = min(4096, triton.next_power_of_2(max(k, 16)))
    _quantize_tokens_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), **token_constants(fp8),
                                  BLOCK=block, num_warps=4 if block <= 2048 else 8,
                                  **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))
    return q, scale


__all__ = ["BlockConfig", "block_config", "block_linear", "quantize_tokens", "to_fp8", "token_constants",
           "token_scale"]
