"""RMSNorm (alone or after the residual add) and SiLU-and-mul that write their output as per-token fp8 rows, the
input of the fp8 projection after them (issue 39: the separate quantizer cost a launch and a pass over the rows per
projection). Each row y of the op's output, exactly as triton_ops computes it and rounded to x's dtype, becomes

    scale = max(amax |y|, MIN_AMAX) * (1 / fp8_max)     float32, `fp8.quantize_input`'s product
    q     = fp8(clamp(y / scale, -fp8_max, fp8_max))   IEEE division, the hardware's round-to-nearest-even cast

through the same Triton helpers as `triton_fp8.quantize_tokens` (`token_scale`, `to_fp8`), so `op` then
`quantize_tokens` and the fused op give the same bits on the GPU; y is never written (the residual sum of
`add_rms_norm_fp8` is, as `triton_ops.add_rms_norm` writes it). The results are `fp8.QuantizedRows` for
`fp8_gpu.gpu_linear_rows`.

Layouts: x [M, K] (2-D; a last dim that is not contiguous is copied first), the output q [M, K] (RMSNorm) or
[M, I] (SiLU-and-mul of x [M, 2I] = cat(gate, up)) contiguous, scale [M, 1] float32. A row's scale needs the amax of
the whole row, so when rows are few (decode) each row is cut into slices of `slice_cols` columns, one program a
slice (grid [M, slices]): every program computes the whole row's amax itself (its inputs read again from L2: the
redundant work is the op without the division and the stores), then quantizes and stores only its slice, and the
first slice stores the scale. With one program a row, one SM did all of a row's work: for SiLU-and-mul over 12288
columns about 1370 instructions a thread at 16 warps (compiled for sm_90), issue-bound, 6.4 us a launch against
1.5 + 2.4 us for the two unfused kernels at one row (H200, bench/results/decode_profile_fp8/); the slices split the
quantization (IEEE divisions, the fp8 casts, the stores) and keep the amax's pass whole in each. How many slices
(`slice_cols`: about TARGET_PROGRAMS programs in all, slices of at least each op's MIN_SLICE columns) is a first
choice, not measured yet (bench/decode_profile.py --quantization fp8 --sweep times others). The slices change no
number: the amax is exact whoever takes it, and a slice's values are computed as the whole row's are.

RMSNorm holds its row in registers as triton_ops' kernel does (the same launch sizes, so the same float32 sums; the
slices recompute their columns with the row's rsqrt). SiLU-and-mul holds its row when it is one slice of at most
ONE_PASS_COLS, else reads it in LOOP_BLOCK-column steps, the amax first, then its slice's quantized values. A norm
weight of another dtype than x (whose product promotes) takes the two unfused launches. No host reads of device values
and no value-dependent shapes: CUDA-graph safe. Programmatic dependent launch (`ops.pdl`; NVIDIA sm_90+, on by default
there, `pdl=False` off): both kernels wait for the kernel before first, then let the next kernel (the fp8 GEMM, which
prefetches its weights meanwhile) start.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rapidserve.ops import pdl as pdl_launch
from rapidserve.ops import triton_ops
from rapidserve.ops.fp8 import QuantizedRows
from rapidserve.ops.triton_fp8 import quantize_tokens, to_fp8, token_constants, token_scale
from rapidserve.ops.triton_ops import _rms_row, _silu_mul, _warps

ONE_PASS_COLS = 16384  # SiLU-and-mul rows up to this wide stay in registers (16 warps: 32 values a thread)
LOOP_BLOCK = 4096  # wider rows: column steps of this many, as quantize_tokens takes them
TARGET_PROGRAMS = 128  # with few rows, slices until rows x slices is about this (the H100/H200 have 132 SMs)
RMS_MIN_SLICE = 1024  # the narrowest slice of a row: each program still takes the whole row's amax
SILU_MIN_SLICE = 1024


def slice_cols(rows: int, cols: int, min_slice: int, target: int = TARGET_PROGRAMS) -> int:
    """Columns each program quantizes of a row `cols` wide, when `rows` rows are quantized (module docstring): the
    whole row (`cols`) when the rows alone give `target` programs or a slice would not be narrower, else the power
    of two >= `min_slice` that cuts each row into at most target // rows slices."""
    pieces = min(target // max(rows, 1), cols // max(min_slice, 1))
    if pieces <= 1:
        return cols
    width = max(min_slice, triton.next_power_of_2(-(-cols // pieces)))
    return cols if width >= cols else width


@triton.jit
def _rms_slice(x_ptr, r_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, n_cols, rstd, cols,
               HAS_RESIDUAL: tl.constexpr):
    """`_rms_row`'s values at columns `cols` of a 2-D x's row `row`, with the row's rsqrt `rstd` (the same loads and
    elementwise math, so the same bits); with HAS_RESIDUAL stores those columns of the residual sum."""
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32) * rstd
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    return h.to(x.dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, res_out_ptr, n_cols, stride_x, stride_r, eps,
                         TOP: tl.constexpr, RCP: tl.constexpr, MIN_AMAX: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         BLOCK: tl.constexpr, VEC: tl.constexpr, WHOLE: tl.constexpr, SLICE: tl.constexpr,
                         USE_GDC: tl.constexpr):
    """WHOLE: one program a row (grid [M, 1]); else grid [M, cdiv(n_cols, SLICE)], program (row, s) quantizes
    columns [s * SLICE, (s + 1) * SLICE) (module docstring). USE_GDC (`ops.pdl`): waits for the kernel before, then
    lets the next one start."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    fp8 = q_ptr.dtype.element_ty
    # a 2-D x is triton_ops' row view (n_inner 1, inner stride 0): the same loads and sums as its kernel
    y, rstd = _rms_row(x_ptr, r_ptr, w_ptr, res_out_ptr, row, 1, stride_x, 0, stride_r, 0, n_cols, eps,
                       HAS_RESIDUAL, WHOLE, BLOCK)
    y = y.to(x_ptr.dtype.element_ty).to(tl.float32)  # what rms_norm stores and quantize_tokens loads
    scale = token_scale(tl.abs(y), RCP, MIN_AMAX)  # past n_cols y is 0
    if WHOLE:
        cols = tl.arange(0, BLOCK)
        # The fp8 store's offsets are `cols` spelled as runs of VEC (x's elements a 16-byte access): the compiler
        # then vectorises it as x's loads, so the row keeps their layout. A 16-wide fp8 store would lay out every
        # value of the row, the sum of squares included, 16 to a thread, and the float32 sum would run in another
        # order than triton_ops' kernel's (ttgir of both: tests/test_fp8_fused.py checks that the reductions'
        # layouts agree).
        offs = (cols // VEC) * VEC + cols % VEC
        tl.store(q_ptr + row * n_cols + offs, to_fp8(y, scale, TOP, fp8), mask=offs < n_cols)
        tl.store(s_ptr + row, scale)
    else:  # this program's slice of the row, recomputed with the row's rsqrt (whose sum is the whole row's above)
        sl = tl.program_id(1)
        s_cols = sl * SLICE + tl.arange(0, SLICE)
        ys = _rms_slice(x_ptr, r_ptr, w_ptr, res_out_ptr, row, stride_x, stride_r, n_cols, rstd, s_cols,
                        HAS_RESIDUAL)
        ys = ys.to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(q_ptr + row * n_cols + s_cols, to_fp8(ys, scale, TOP, fp8), mask=s_cols < n_cols)
        if sl == 0:
            tl.store(s_ptr + row, scale)


def _check_2d(name: str, x: torch.Tensor) -> torch.Tensor:
    if x.dim() != 2:
        raise ValueError(f"{name} takes rows x [M, K]; got {tuple(x.shape)}")
    return x if x.stride(-1) == 1 else x.contiguous()


def _rms_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             fp8: torch.dtype, slice_width: int | None, pdl: bool | None) -> tuple[QuantizedRows, torch.Tensor | None]:
    x = _check_2d("rms_norm_fp8", x)
    m, n_cols = x.shape
    if weight.shape != (n_cols,):
        raise ValueError(f"weight must be [{n_cols}] (the last dim of x); got {tuple(weight.shape)}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    if weight.dtype != x.dtype:  # the norm's output promotes: the unfused launches, the same numbers
        if residual is None:
            y, res = triton_ops.rms_norm(x, weight, eps, pdl=pdl), None
        else:
            y, res = triton_ops.add_rms_norm(x, residual, weight, eps, pdl=pdl)
        return QuantizedRows(*quantize_tokens(y, fp8, pdl=pdl), y.dtype), res
    q = torch.empty((m, n_cols), dtype=fp8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    if m == 0 or n_cols == 0:
        return QuantizedRows(q, scale, x.dtype), res_out
    r = _check_2d("add_rms_norm_fp8", residual) if residual is not None else x
    block = triton.next_power_of_2(n_cols)  # triton_ops' launch: one row a program, the same warps
    width = _slice_width(slice_width, slice_cols(m, n_cols, RMS_MIN_SLICE), block)
    _rms_norm_fp8_kernel[(m, triton.cdiv(n_cols, width))](
        x, r, weight, q, scale, res_out if res_out is not None else x, n_cols, x.stride(0),
        r.stride(0) if residual is not None else 0, eps, **token_constants(fp8), HAS_RESIDUAL=residual is not None,
        BLOCK=block, VEC=16 // x.element_size(), WHOLE=width >= block, SLICE=width, num_warps=_warps(block),
        enable_fp_fusion=False, **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))
    return QuantizedRows(q, scale, x.dtype), res_out


def _slice_width(given: int | None, rule: int, block: int) -> int:
    """A slice's columns: `given` (tests, the sweep) or the rule's, as a power of two; `block` (the row's padded
    width) for the whole row."""
    width = rule if given is None else given
    if width <= 0:
        raise ValueError(f"slice_width must be positive; got {width}")
    return block if width >= block else triton.next_power_of_2(width)


def rms_norm_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, fp8: torch.dtype,
                 slice_width: int | None = None, pdl: bool | None = None) -> QuantizedRows:
    """`triton_ops.rms_norm(x, weight, eps)` quantized per token to `fp8` in one launch (module docstring).
    `slice_width`: columns a program quantizes (default `slice_cols`' rule; the row's width or more: one program a
    row). `pdl`: programmatic dependent launch (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    return _rms_fp8(x, None, weight, eps, fp8, slice_width, pdl)[0]


def add_rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                     fp8: torch.dtype, slice_width: int | None = None,
                     pdl: bool | None = None) -> tuple[QuantizedRows, torch.Tensor]:
    """`triton_ops.add_rms_norm`'s (normed rows quantized per token to `fp8`, residual + x) in one launch;
    `slice_width`, `pdl` as `rms_norm_fp8`'s."""
    rows, res = _rms_fp8(x, residual, weight, eps, fp8, slice_width, pdl)
    assert res is not None
    return rows, res


@triton.jit
def _silu_row(x_row, cols, n_inter):
    """silu(gate) * up of columns `cols` (0 past n_inter) rounded to x's dtype, as float32."""
    mask = cols < n_inter
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + n_inter + cols, mask=mask, other=0.0)
    return _silu_mul(gate, up).to(gate.dtype).to(tl.float32)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, s_ptr, stride_xt, n_inter, slice_width, TOP: tl.constexpr,
                             RCP: tl.constexpr, MIN_AMAX: tl.constexpr, BLOCK: tl.constexpr, ONE_PASS: tl.constexpr,
                             Q_BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """Program (token, slice) (module docstring). USE_GDC (`ops.pdl`): waits for the kernel before, then lets the
    next one start."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0).to(tl.int64)
    sl = tl.program_id(1)
    x_row = x_ptr + t * stride_xt
    q_row = q_ptr + t * n_inter
    offs = tl.arange(0, BLOCK)
    fp8 = q_ptr.dtype.element_ty
    if ONE_PASS:  # the row in registers (BLOCK >= n_inter), one program a row
        y = _silu_row(x_row, offs, n_inter)
        scale = token_scale(tl.abs(y), RCP, MIN_AMAX)
        tl.store(q_row + offs, to_fp8(y, scale, TOP, fp8), mask=offs < n_inter)
    else:  # the amax over the whole row, then this program's slice again, quantized, in Q_BLOCK steps
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, n_inter, BLOCK):
            amax = tl.maximum(amax, tl.abs(_silu_row(x_row, k0 + offs, n_inter)))
        scale = token_scale(amax, RCP, MIN_AMAX)
        q_offs = tl.arange(0, Q_BLOCK)
        lo = sl * slice_width
        for k0 in range(lo, lo + slice_width, Q_BLOCK):
            y = _silu_row(x_row, k0 + q_offs, n_inter)
            tl.store(q_row + k0 + q_offs, to_fp8(y, scale, TOP, fp8), mask=k0 + q_offs < n_inter)
    if sl == 0:
        tl.store(s_ptr + t, scale)


def silu_and_mul_fp8(x: torch.Tensor, fp8: torch.dtype, one_pass_cols: int = ONE_PASS_COLS,
                     slice_width: int | None = None, pdl: bool | None = None) -> QuantizedRows:
    """`triton_ops.silu_and_mul(x)` (x [M, 2I] = cat(gate, up)) quantized per token to `fp8` in one launch: q
    [M, I], scale [M, 1] (module docstring). `one_pass_cols`: the widest row held in registers (tests set it
    lower to take the loop); `slice_width`: columns a program quantizes (default `slice_cols`' rule; I or more: one
    program a row); `pdl`: programmatic dependent launch (`ops.pdl.use_pdl`; None: where the GPU has it)."""
    x = _check_2d("silu_and_mul_fp8", x)
    if x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul_fp8 needs an even last dim (cat(gate, up)); got {tuple(x.shape)}")
    m, n_inter = x.shape[0], x.shape[1] // 2
    q = torch.empty((m, n_inter), dtype=fp8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0 or n_inter == 0:
        return QuantizedRows(q, scale, x.dtype)
    width = _slice_width(slice_width, slice_cols(m, n_inter, SILU_MIN_SLICE), triton.next_power_of_2(n_inter))
    one_pass = width >= n_inter and n_inter <= one_pass_cols
    block = triton.next_power_of_2(n_inter) if one_pass else min(LOOP_BLOCK, triton.next_power_of_2(n_inter))
    q_block = block if width >= n_inter else min(width, LOOP_BLOCK)  # a whole row quantized in the amax's steps
    if width >= n_inter:
        width = triton.cdiv(n_inter, q_block) * q_block
    _silu_and_mul_fp8_kernel[(m, triton.cdiv(n_inter, width))](
        x, q, scale, x.stride(0), n_inter, width, **token_constants(fp8), BLOCK=block, ONE_PASS=one_pass,
        Q_BLOCK=q_block, num_warps=max(4, min(16, block // 512)), enable_fp_fusion=False,
        **pdl_launch.launch_options(pdl_launch.use_pdl(pdl, x.device)))
    return QuantizedRows(q, scale, x.dtype)


__all__ = ["LOOP_BLOCK", "ONE_PASS_COLS", "RMS_MIN_SLICE", "SILU_MIN_SLICE", "TARGET_PROGRAMS", "add_rms_norm_fp8",
           "rms_norm_fp8", "silu_and_mul_fp8", "slice_cols"]
