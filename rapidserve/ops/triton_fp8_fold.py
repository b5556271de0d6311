"""The residual add + RMSNorm quantized per token (`triton_fp8_fused.add_rms_norm_fp8`) of a split-K fp8 GEMM's
output that was never reduced (issue 39): the norm reads the GEMM's float32 slice sums (`fp8.SplitSums`) and adds them
itself, so the reduce kernel (`triton_fp8_skinny._fp8_split_reduce_kernel`) is not launched. Where: o_proj's output
into the post-attention norm and down_proj's into the next layer's input norm, in a decode step of few rows
(`ops/fold_table.py` says which rows and why; the model asks for the sums with `Ops.fp8_linear_sums`).

The numbers are the unfused path's (the reduce kernel, then the fused norm), element by element:
    x[m, n] = ((ws[0, m, n] + ws[1, m, n] + ... + ws[S-1, m, n]) * sx[m] * sw[n] (+ bias[n] after a rounding)) in
              x's dtype                                    (`triton_fp8_skinny._epilogue`'s operations, in its order)
    then residual + x rounded, stored as the new residual, normalised and quantized as `_rms_norm_fp8_kernel` does.
A program (row, slice) as there: it forms its whole row (its S slices of it, read from L2) for the sum of squares,
then its slice's columns again for the quantized values it stores, and the residual sum's columns of its slice (the
whole row where one program takes the row). The sum of squares is the only reduction whose order could differ
from the unfused kernel's: it runs over the same [BLOCK] vector, and its layout on the GPU is the unfused kernel's
(tests/test_fp8_fold.py compiles both for sm_90 and compares).

Costs against the reduce launch it replaces: each program reads S x N float32 of its row instead of N bf16 (at one row,
Qwen3-8B's down_proj at S = 8: 128 KiB a program, 4 programs; the reduce kernel read the same bytes over its own
programs, then the norm read the row again). No host reads, no value-dependent shapes: CUDA-graph safe. Programmatic
dependent launch (`ops.pdl`): waits for the kernel before (the split GEMM, whose sums it reads) first, then lets the
next one start. NVIDIA only in practice: only the skinny fp8 kernel hands out sums (ROCm's fp8 GEMMs never split K).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops import triton_fp8_fused, triton_fp8_skinny
from rapidserve.ops.fp8 import QuantizedRows, SplitSums
from rapidserve.ops.triton_fp8 import to_fp8, token_constants, token_scale
from rapidserve.ops.triton_fp8_fused import RMS_MIN_SLICE, slice_cols
from rapidserve.ops.triton_ops import _warps


@triton.jit
def _summed_row(ws_ptr, sx_ptr, sw_ptr, b_ptr, r_ptr, res_out_ptr, row, M, n_cols, stride_r, cols,
                SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, STORE: tl.constexpr):
    """residual + the GEMM's output at columns `cols` of row `row` (module docstring), in the output's dtype, 0 past
    n_cols; STORE: those columns stored as the new residual."""
    mask = cols < n_cols
    part = ws_ptr + row * n_cols + cols
    acc = tl.load(part, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):  # the reduce kernel's order: 0, 1, ...
        acc += tl.load(part + s * M * n_cols, mask=mask, other=0.0)
    acc = acc * tl.load(sx_ptr + row) * tl.load(sw_ptr + cols, mask=mask, other=0.0)
    dt = res_out_ptr.dtype.element_ty
    if HAS_BIAS:  # as `_epilogue`: the product in the output dtype, then the bias added
        acc = acc.to(dt).to(tl.float32) + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
    x = (r.to(tl.float32) + acc.to(dt).to(tl.float32)).to(dt)
    if STORE:
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    return x


@triton.jit
def _sums_rms_norm_fp8_kernel(ws_ptr, sx_ptr, sw_ptr, b_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, M, n_cols,
                              stride_r, eps, TOP: tl.constexpr, RCP: tl.constexpr, MIN_AMAX: tl.constexpr,
                              SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, VEC: tl.constexpr,
                              WHOLE: tl.constexpr, SLICE: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (row, slice) of `_rms_norm_fp8_kernel`'s grid, its x the GEMM's summed slices (module docstring).
    USE_GDC (`ops.pdl`): waits for the kernel before, then lets the next one start."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    fp8 = q_ptr.dtype.element_ty
    dt = res_out_ptr.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    # triton_ops._rms_row's operations on the summed row
    x = _summed_row(ws_ptr, sx_ptr, sw_ptr, b_ptr, r_ptr, res_out_ptr, row, M, n_cols, stride_r, cols, SPLITS,
                    HAS_BIAS, WHOLE)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / n_cols
    rstd = tl.rsqrt(variance + eps)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0)
    y = ((h * rstd).to(dt).to(tl.float32) * w.to(tl.float32)).to(dt).to(tl.float32)
    scale = token_scale(tl.abs(y), RCP, MIN_AMAX)  # past n_cols y is 0
    if WHOLE:
        offs = (cols // VEC) * VEC + cols % VEC  # as `_rms_norm_fp8_kernel`'s store (its comment says why)
        tl.store(q_ptr + row * n_cols + offs, to_fp8(y, scale, TOP, fp8), mask=offs < n_cols)
        tl.store(s_ptr + row, scale)
    else:  # this program's slice, recomputed with the row's rsqrt (triton_fp8_fused._rms_slice's operations)
        sl = tl.program_id(1)
        s_cols = sl * SLICE + tl.arange(0, SLICE)
        xs = _summed_row(ws_ptr, sx_ptr, sw_ptr, b_ptr, r_ptr, res_out_ptr, row, M, n_cols, stride_r, s_cols,
                         SPLITS, HAS_BIAS, True)
        ws = tl.load(w_ptr + s_cols, mask=s_cols < n_cols, other=0.0)
        ys = ((xs.to(tl.float32) * rstd).to(dt).to(tl.float32) * ws.to(tl.float32)).to(dt).to(tl.float32)
        tl.store(q_ptr + row * n_cols + s_cols, to_fp8(ys, scale, TOP, fp8), mask=s_cols < n_cols)
        if sl == 0:
            tl.store(s_ptr + row, scale)


def sums_ok(sums: SplitSums, residual: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: sums as `triton_fp8_skinny` makes them (a contiguous float32
    workspace [S, M, N], sx [M, 1] and sw [N] float32 contiguous, bias [N] or None), a residual [M, N] of the output's
    dtype with a contiguous last dim, and a norm weight [N] of that dtype (another dtype promotes: the unfused path)."""
    ws = sums.ws
    if ws.dim() != 3 or ws.dtype != torch.float32 or not ws.is_contiguous():
        return False
    _, m, n = ws.shape
    return (tuple(sums.sx.shape) == (m, 1) and sums.sx.dtype == torch.float32 and sums.sx.is_contiguous()
            and tuple(sums.sw.shape) == (n,) and sums.sw.dtype == torch.float32 and sums.sw.is_contiguous()
            and (sums.bias is None or (tuple(sums.bias.shape) == (n,) and sums.bias.is_contiguous()))
            and tuple(residual.shape) == (m, n) and residual.dtype == sums.dtype and residual.stride(-1) == 1
            and tuple(weight.shape) == (n,) and weight.dtype == sums.dtype)


def add_rms_norm_fp8_sums(sums: SplitSums, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          fp8: torch.dtype, slice_width: int | None = None,
                          pdl: bool | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """`triton_fp8_fused.add_rms_norm_fp8(x, residual, weight, eps, fp8)` of the x that `sums` stand for
    (`fp8.reduce_sums_reference`), in one launch without x's reduce (module docstring): (the normed rows quantized,
    residual + x). Operands the kernel does not take (`sums_ok`) go the unfused way: the reduce kernel, then the
    fused norm (the same numbers). `slice_width`, `pdl` as `add_rms_norm_fp8`'s."""
    if not sums_ok(sums, residual, weight):
        x = triton_fp8_skinny.reduce_sums(sums, pdl=pdl)
        return triton_fp8_fused.add_rms_norm_fp8(x, residual, weight, eps, fp8, slice_width, pdl)
    splits, m, n_cols = sums.ws.shape
    device = sums.ws.device
    q = torch.empty((m, n_cols), dtype=fp8, device=device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=device)
    res_out = torch.empty((m, n_cols), dtype=sums.dtype, device=device)
    if m == 0 or n_cols == 0:
        return QuantizedRows(q, scale, sums.dtype), res_out
    block = triton.next_power_of_2(n_cols)  # triton_ops' launch: one row a program, the same warps
    width = triton_fp8_fused._slice_width(slice_width, slice_cols(m, n_cols, RMS_MIN_SLICE), block)
    _sums_rms_norm_fp8_kernel[(m, triton.cdiv(n_cols, width))](
        sums.ws, sums.sx, sums.sw, sums.bias if sums.bias is not None else sums.sw, residual, weight, q, scale,
        res_out, m, n_cols, residual.stride(0), eps, **token_constants(fp8), SPLITS=splits,
        HAS_BIAS=sums.bias is not None, BLOCK=block, VEC=16 // res_out.element_size(), WHOLE=width >= block,
        SLICE=width, num_warps=_warps(block), enable_fp_fusion=False,
        **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, device)))
    return QuantizedRows(q, scale, sums.dtype), res_out


__all__ = ["add_rms_norm_fp8_sums", "sums_ok"]
